"""Progress display for every executor: one bar per stage (steps for training, with the epoch in progress; batches
for extraction). On a Ray cluster each stage's worker shows its own lines (Ray forwards them to the driver's log).

The reporter is the ``emit`` callback stages receive: it accepts any record (training records with epoch, step,
loss parts and images/s; extraction progress; the event types of :mod:`pipelines.engine.events`) and shows it; the
MLflow tracker of the cluster package plugs into the same callback, so training code never calls a tracker directly.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable

from tqdm.auto import tqdm

from pipelines.engine.events import ProgressUpdate, StageEvent, StageRecord


class ProgressReporter:
    """Shows stages on stderr and forwards every record to ``sinks``.

    On a terminal (and ``enabled``): one tqdm bar per stage (stage label, epoch, images/s, ETA). Otherwise (a log
    file, CI, ``--no-progress``): flushed lines, one when a stage starts and ends and, inside long stages, one every
    ``line_interval_s`` seconds with progress, images/s and ETA, never bars drawn into files.
    """

    def __init__(self, enabled: bool = True, sinks: list[Callable[[Any], None]] | None = None, stream=None,
                 line_interval_s: float = 10.0, label: str = "") -> None:
        self.sinks = list(sinks or [])
        self.stream = stream or sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.bars = bool(enabled and callable(isatty) and isatty())
        self.line_interval_s = float(line_interval_s)
        # lines of several processes sharing one terminal (compat demo) carry the scenario they belong to
        self.label = f"[{label}] " if label else ""
        self._bar: tqdm | None = None
        self._stage: StageEvent | None = None
        self._started = 0.0
        self._last_line = 0.0

    def __call__(self, record: Any) -> None:
        for sink in self.sinks:
            sink(record)
        if isinstance(record, StageRecord):
            record = record.record
        if isinstance(record, StageEvent):
            self._on_stage(record)
        elif isinstance(record, ProgressUpdate):
            self._on_progress(record)
        # training summaries (per epoch) go to the sinks only: the steps' updates already show the epoch in progress

    def _prefix(self, event: StageEvent) -> str:
        """``[label] [i/n] stage``; without the counter where the position in the graph is not known (total 0)."""
        counter = f"[{event.index + 1}/{event.total}] " if event.total else ""
        return f"{self.label}{counter}{event.label}"

    def follow(self, event: StageEvent) -> None:
        """Show the progress of ``event``'s stage from now on without announcing it (a stage worker whose driver
        announces the start and the end)."""
        self._close()
        self._stage = event
        self._started = self._last_line = time.perf_counter()

    def _on_stage(self, event: StageEvent) -> None:
        prefix = self._prefix(event)
        if event.status == "started":
            self.follow(event)
            if self.bars:
                self._bar = tqdm(total=None, desc=prefix, file=self.stream, leave=False, dynamic_ncols=True)
            else:
                print(f"{prefix}: started", file=self.stream, flush=True)
        else:
            self._close()
            extra = f" in {event.seconds:.1f} s" if event.seconds is not None else ""
            print(f"{prefix}: {event.status}{extra}", file=self.stream, flush=True)

    def _on_progress(self, update: ProgressUpdate) -> None:
        if not self.bars:
            self._progress_line(update)
            return
        if self._bar is None:
            return
        if self._bar.total != update.total:
            self._bar.total = update.total
            self._bar.unit = update.unit
        self._bar.n = update.done
        postfix = {}
        if update.images_per_second is not None:
            postfix["img/s"] = f"{update.images_per_second:.0f}"
        if update.loss is not None:
            postfix["loss"] = f"{update.loss:.3f}"
        if update.epoch is not None and update.epochs:
            postfix["epoch"] = f"{update.epoch}/{update.epochs}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.refresh()

    def _progress_line(self, update: ProgressUpdate) -> None:
        """A periodic flushed line for logs: done/total units, images/s, ETA from the stage's elapsed time."""
        now = time.perf_counter()
        if self._stage is None or now - self._last_line < self.line_interval_s or update.total <= 0:
            return
        self._last_line = now
        elapsed = now - self._started
        remaining = elapsed / max(update.done, 1) * max(update.total - update.done, 0)
        speed = f", {update.images_per_second:.0f} img/s" if update.images_per_second is not None else ""
        epoch = f"epoch {update.epoch}/{update.epochs}, " if update.epoch is not None and update.epochs else ""
        print(f"{self._prefix(self._stage)}: {epoch}{update.unit} {update.done}/{update.total}{speed}, "
              f"{elapsed:.0f} s elapsed, ETA {remaining:.0f} s", file=self.stream, flush=True)

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        """Close the open bar and every sink that can be closed (the tracker ends its runs there)."""
        self._close()
        for sink in self.sinks:
            close = getattr(sink, "close", None)
            if callable(close):
                close()

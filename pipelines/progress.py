"""Progress display for the local executor: one bar per stage (epochs for training, batches for extraction).

The reporter is the ``emit`` callback stages receive: it accepts any record (training records with epoch, step,
loss parts and images/s; extraction progress) and shows it; the MLflow tracker of the cluster package plugs into
the same callback, so training code never calls a tracker directly.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from tqdm.auto import tqdm


@dataclass
class StageEvent:
    """Start/end/skip of a stage: ``status`` is started | done | skipped | failed; seconds only when done."""

    stage_key: str
    label: str
    kind: str
    status: str
    index: int
    total: int
    seconds: float | None = None


@dataclass
class ProgressUpdate:
    """Work done inside a stage: ``done`` of ``total`` units (``unit``: epoch | batch); images/s over the stage."""

    stage_key: str
    done: int
    total: int
    unit: str
    images_per_second: float | None = None
    loss: float | None = None


@dataclass
class StageRecord:
    """A record tagged with the stage that produced it. Executors that run stages concurrently (Ray) wrap records in
    it so that sinks such as the MLflow tracker need not guess which open stage a training record belongs to."""

    stage_key: str
    record: Any


class ProgressReporter:
    """Shows stages as tqdm bars (stage label, epoch, images/s, ETA) on stderr; forwards records to ``sinks``."""

    def __init__(self, enabled: bool = True, sinks: list[Callable[[Any], None]] | None = None, stream=None) -> None:
        self.enabled = enabled
        self.sinks = list(sinks or [])
        self.stream = stream or sys.stderr
        self._bar: tqdm | None = None
        self._stage: StageEvent | None = None
        self._started = 0.0

    def __call__(self, record: Any) -> None:
        for sink in self.sinks:
            sink(record)
        if isinstance(record, StageRecord):
            record = record.record
        if isinstance(record, StageEvent):
            self._on_stage(record)
        elif isinstance(record, ProgressUpdate):
            self._on_progress(record)
        else:
            self._on_training_record(record)

    def _on_stage(self, event: StageEvent) -> None:
        if not self.enabled:
            return
        prefix = f"[{event.index + 1}/{event.total}] {event.label}"
        if event.status == "started":
            self._close()
            self._stage = event
            self._started = time.perf_counter()
            self._bar = tqdm(total=None, desc=prefix, file=self.stream, leave=False, dynamic_ncols=True)
        else:
            self._close()
            extra = f" in {event.seconds:.1f} s" if event.seconds is not None else ""
            print(f"{prefix}: {event.status}{extra}", file=self.stream, flush=True)

    def _on_progress(self, update: ProgressUpdate) -> None:
        if not self.enabled or self._bar is None:
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
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.refresh()

    def _on_training_record(self, record: Any) -> None:
        # TrainRecord of pipelines.training: epoch (0-based), epochs, images_per_second, loss
        epoch = getattr(record, "epoch", None)
        if epoch is None or self._stage is None:
            return
        total = getattr(record, "epochs", None) or getattr(record, "num_epochs", None)
        loss = getattr(record, "loss", None)
        self._on_progress(ProgressUpdate(
            self._stage.stage_key, int(epoch) + 1, int(total) if total else int(epoch) + 1, "epoch",
            getattr(record, "images_per_second", None), float(loss) if isinstance(loss, (int, float)) else None,
        ))

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

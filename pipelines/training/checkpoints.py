"""Epoch checkpoints of long training stages: written to the run store, read back when a stage restarts.

A stage that trains for hours (pre-training, fine-tuning) saves its whole training state at epoch ends chosen by its
:class:`CheckpointPolicy` (by time by default, or every N epochs) and once more when SIGTERM, the preemption signal,
arrives, under::

    checkpoints/<stage_key>/epoch-<NNNNN>[-step-<NNNNNN>].pt     torch.save of the state dict (tensors and plain data)
    checkpoints/<stage_key>/epoch-<NNNNN>[-step-<NNNNNN>].json   {"epochs_done", "step_in_epoch", "blob", "sha256", "size"}

written blob first, manifest last (as stage artifacts), so a checkpoint exists exactly when its JSON does. A
restarted stage (a retried Ray task on another node, ``compat run --resume``) restores the newest checkpoint whose
blob matches its sha256 and continues from there; the stage key (config slice, parents, code version) names the
folder, so a checkpoint is only ever restored into the very computation that wrote it. Older checkpoints are deleted
once a newer one is committed; all of a stage's checkpoints are deleted when the stage itself is committed
(:func:`collect_garbage`). Bytes are read with ``torch.load(weights_only=True)``: no pickle from the store.
"""
from __future__ import annotations

import contextlib
import io as _stdio
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol

import torch

from pipelines.store.run_store import RunStore, sha256_bytes

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"


@dataclass
class EpochCheckpoint:
    """Training state after ``epochs_done`` completed epochs of a stage (plus ``state["step_in_epoch"]`` steps of
    the next one when written on SIGTERM between two epochs).

    state: what :func:`pipelines.training.loop_state.training_state` builds: model, optimiser, scheduler, RNG states (torch,
    numpy, python, augmentation), sampler position, method extra modules, model-selection state, records so far.
    """

    epochs_done: int
    state: dict[str, Any]


# By default a checkpoint's write time is at most this fraction of the training time between two checkpoints.
MAX_WRITE_FRACTION = 0.02


@dataclass
class CheckpointPolicy:
    """When a training loop saves at an epoch end (it always saves on SIGTERM).

    every_epochs: N > 0 saves after every N epochs; None saves by time: at the first epoch end at least
    ``every_minutes`` after the previous save (or the stage's start) AND at least ``write_seconds / MAX_WRITE_FRACTION``
    after it, where ``write_seconds`` is the last measured write, so writes cost <= 2 % of the training time whatever
    the store's speed (a 1.2 GB ViT-B + AdamW state at 100 MB/s: one save per 10 minutes at most).
    """

    every_epochs: int | None = None
    every_minutes: float = 10.0
    last_save: float = field(default_factory=time.monotonic)
    write_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.every_epochs is not None and (isinstance(self.every_epochs, bool) or
                                              not isinstance(self.every_epochs, int) or self.every_epochs < 1):
            raise ValueError(f"training.checkpoint_every_epochs must be null (by time), 0 (off) or an int >= 1, "
                             f"got {self.every_epochs!r}")
        if not (isinstance(self.every_minutes, (int, float)) and 0 <= self.every_minutes < float("inf")):
            raise ValueError(f"training.checkpoint_every_minutes must be a finite number >= 0, got "
                             f"{self.every_minutes!r}")

    def due(self, epochs_done: int, now: float | None = None) -> bool:
        """Whether to save after ``epochs_done`` completed epochs."""
        if self.every_epochs is not None:
            return epochs_done % self.every_epochs == 0
        elapsed = (time.monotonic() if now is None else now) - self.last_save
        return elapsed >= max(60.0 * self.every_minutes, self.write_seconds / MAX_WRITE_FRACTION)

    def wrote(self, seconds: float, now: float | None = None) -> None:
        """Record a save that took ``seconds`` and ended at ``now`` (monotonic seconds)."""
        self.write_seconds = float(seconds)
        self.last_save = time.monotonic() if now is None else now


def policy_from_settings(every_epochs: int | None, every_minutes: float) -> CheckpointPolicy | None:
    """The policy of ``training.checkpoint_every_epochs`` / ``checkpoint_every_minutes``; None when 0 turns
    checkpoints off."""
    if every_epochs == 0:
        return None
    return CheckpointPolicy(every_epochs, every_minutes)


class CheckpointSink(Protocol):
    """Where a training loop keeps its checkpoints; ``policy`` decides at which epoch ends."""

    policy: CheckpointPolicy

    def load_latest(self) -> EpochCheckpoint | None: ...

    def save(self, checkpoint: EpochCheckpoint) -> None: ...


def encode_state(state: dict[str, Any]) -> bytes:
    """torch.save bytes of a state dict (tensors, numbers, strings, lists, tuples, dicts only)."""
    buffer = _stdio.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def decode_state(data: bytes) -> dict[str, Any]:
    """The state dict of :func:`encode_state` bytes, read with ``weights_only=True`` (no arbitrary pickle)."""
    return torch.load(_stdio.BytesIO(data), map_location="cpu", weights_only=True)


class StoreCheckpointSink:
    """Checkpoints of stage ``stage_key`` in a :class:`RunStore` (a local folder or s3://, the same code)."""

    def __init__(self, store: RunStore, stage_key: str, policy: CheckpointPolicy) -> None:
        if not isinstance(policy, CheckpointPolicy):
            raise TypeError(f"policy must be a CheckpointPolicy, got {type(policy).__name__}")
        self.store = store
        self.stage_key = stage_key
        self.policy = policy
        self.folder = f"{CHECKPOINTS}/{stage_key}"
        self.saved = 0  # checkpoints written by this object (tests, notes)

    def _names(self) -> list[str]:
        """Committed checkpoint names (without extension), oldest first (names sort by epoch, then step)."""
        return sorted(name[:-5] for name in self.store.list_files(self.folder) if name.endswith(".json"))

    def load_latest(self) -> EpochCheckpoint | None:
        """The newest committed checkpoint whose blob verifies; a corrupt one is skipped with a warning."""
        for name in reversed(self._names()):
            try:
                manifest = json.loads(self.store.read_bytes(f"{self.folder}/{name}.json"))
                data = self.store.read_bytes(f"{self.folder}/{manifest['blob']}")
            except (FileNotFoundError, ValueError, KeyError) as error:
                log.warning("checkpoint %s/%s unreadable (%s); trying an older one", self.folder, name, error)
                continue
            if sha256_bytes(data) != manifest["sha256"] or len(data) != manifest["size"]:
                log.warning("checkpoint %s/%s: sha256 mismatch (expected %s); trying an older one", self.folder,
                            manifest["blob"], manifest["sha256"])
                continue
            return EpochCheckpoint(int(manifest["epochs_done"]), decode_state(data))
        return None

    def save(self, checkpoint: EpochCheckpoint) -> None:
        """Write the blob, then its manifest; then delete the older checkpoints of the stage."""
        step = int(checkpoint.state.get("step_in_epoch", 0) or 0)
        name = f"epoch-{checkpoint.epochs_done:05d}" + (f"-step-{step:06d}" if step else "")
        older = self._names()
        data = encode_state(checkpoint.state)
        self.store.write_bytes(f"{self.folder}/{name}.pt", data)
        manifest = {"stage_key": self.stage_key, "epochs_done": checkpoint.epochs_done, "step_in_epoch": step,
                    "blob": f"{name}.pt", "sha256": sha256_bytes(data), "size": len(data)}
        self.store.write_bytes(f"{self.folder}/{name}.json", json.dumps(manifest, indent=1).encode("utf-8"))
        self.saved += 1
        for stale in older:
            if stale != name:
                self.store.delete_file(f"{self.folder}/{stale}.json")  # manifest first: never a dangling manifest
                self.store.delete_file(f"{self.folder}/{stale}.pt")


def collect_garbage(store: RunStore, stage_key: str) -> int:
    """Delete every checkpoint of ``stage_key`` (call once the stage is committed); returns the bytes freed."""
    return store.delete_tree(f"{CHECKPOINTS}/{stage_key}")


def collect_committed(store: RunStore) -> int:
    """Delete the checkpoints of every committed stage (those left by a process that died between the commit and
    its own clean-up); returns the bytes freed."""
    freed = 0
    for name in store.list_dirs(CHECKPOINTS):
        if store.has(name):
            freed += collect_garbage(store, name)
    return freed


# ---- SIGTERM (preemption) ----------------------------------------------------------------------------------------
class PreemptionFlag:
    """Set by the SIGTERM handler of :func:`preemption_guard`; the training loop checks it between steps."""

    def __init__(self) -> None:
        self.received = False
        self.previous: Any = signal.SIG_DFL

    def __bool__(self) -> bool:
        return self.received

    def exit(self, message: str) -> None:
        """Leave the process the way SIGTERM would have without the guard (so Ray sees a dead worker and retries
        the task, and a shell sees status 143), after logging ``message``."""
        log.warning(message)
        print(message, flush=True)
        previous = self.previous
        signal.signal(signal.SIGTERM, previous if previous not in (None,) else signal.SIG_DFL)
        if callable(previous):
            previous(signal.SIGTERM, None)
        os.kill(os.getpid(), signal.SIGTERM)
        raise SystemExit(128 + signal.SIGTERM)  # only reached when SIGTERM is ignored


@contextlib.contextmanager
def preemption_guard(enabled: bool = True) -> Iterator[PreemptionFlag]:
    """Within the block SIGTERM only sets the yielded flag (main thread only; elsewhere the flag stays unset and
    SIGTERM keeps its previous meaning). The previous handler is restored on exit."""
    flag = PreemptionFlag()
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum: int, frame: Any) -> None:
        flag.received = True

    try:
        flag.previous = signal.signal(signal.SIGTERM, handler)
    except (ValueError, OSError):  # not the main interpreter thread after all
        yield flag
        return
    try:
        yield flag
    finally:
        if signal.getsignal(signal.SIGTERM) is handler:
            signal.signal(signal.SIGTERM, flag.previous if flag.previous is not None else signal.SIG_DFL)


__all__ = ["EpochCheckpoint", "CheckpointSink", "StoreCheckpointSink", "collect_garbage", "collect_committed",
           "encode_state", "decode_state", "preemption_guard", "PreemptionFlag", "CHECKPOINTS"]

"""The records the engine and the stages emit besides training records: a stage's start / end / skip
(:class:`StageEvent`), work done inside a stage (:class:`ProgressUpdate`) and a record tagged with its stage
(:class:`StageRecord`). Plain data: the engine, the stages and the tracker import these types; the display that
shows them is :mod:`pipelines.engine.progress`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pipelines.graph.stage_kind import StageKind
from pipelines.records.stage_records import CommittedStage


StageStatus = Literal["started", "done", "skipped", "failed"]


@dataclass
class StageEvent:
    """Start/end/skip of a stage: ``status`` is started | done | skipped | failed; seconds only when done.
    committed: when done or skipped, the committed record and its blob table (what a tracker logs and uploads)."""

    stage_key: str
    label: str
    kind: StageKind
    status: StageStatus
    index: int
    total: int
    seconds: float | None = None
    committed: CommittedStage | None = None


@dataclass
class ProgressUpdate:
    """Work done inside a stage: ``done`` of ``total`` units (``unit``: step | batch | ...); images/s over the stage;
    for training steps, the epoch in progress (1-based) of ``epochs``."""

    stage_key: str
    done: int
    total: int
    unit: str
    images_per_second: float | None = None
    loss: float | None = None
    epoch: int | None = None
    epochs: int | None = None


@dataclass
class StageRecord:
    """A record tagged with the stage that produced it. Executors that run stages concurrently (Ray) wrap records in
    it so that sinks such as the MLflow tracker need not guess which open stage a training record belongs to."""

    stage_key: str
    record: Any


__all__ = ["ProgressUpdate", "StageEvent", "StageRecord", "StageStatus"]

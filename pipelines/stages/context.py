"""What a stage function receives and returns: the :class:`StageContext` (its node with its typed inputs, the run
store, its committed parents' records, the progress ``emit``, the torch device and the run's how-not-what settings)
and the :class:`StageResult` (typed record + blobs the engine commits), plus the device a settings' ``device``
names."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from pipelines.graph.compile import Stage
from pipelines.records.stage_records import Record
from pipelines.stages.inputs import RunSettings
from pipelines.store.run_store import RunStore

Emit = Callable[[Any], None]


@dataclass
class StageResult:
    """A stage's typed record and the blobs (name -> bytes) committed with it."""

    record: Record
    blobs: dict[str, bytes] = field(default_factory=dict)


@dataclass
class StageContext:
    """Everything a stage function reads: its node (``stage.inputs``: what it computes from, all in its key), the run
    store, its committed parents' records (by key), where progress records go, the device it runs on and how it runs
    (``settings``: checkpoint cadence, input workers, the run's data guards; in no key)."""

    stage: Stage
    store: RunStore
    parents: dict[str, Record]
    emit: Emit
    device: torch.device
    settings: RunSettings

    @property
    def inputs(self) -> Any:
        return self.stage.inputs


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)

"""What a stage function receives and returns: the :class:`StageContext` (stage, config, run store, committed
parent records, the progress ``emit`` and the torch device) and the :class:`StageResult` (typed record + blobs the
engine commits), plus the device a config's ``device`` names."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from pipelines.config.schema import ScenarioConfig
from pipelines.graph.compile import Stage
from pipelines.records.stage_records import Record
from pipelines.store.run_store import RunStore

Emit = Callable[[Any], None]


@dataclass
class StageResult:
    """A stage's typed record and the blobs (name -> bytes) committed with it."""

    record: Record
    blobs: dict[str, bytes] = field(default_factory=dict)


@dataclass
class StageContext:
    """Everything a stage function reads: its node, the scenario, the run store, its committed parents' records
    (by key), where progress records go and the device it runs on."""

    stage: Stage
    config: ScenarioConfig
    store: RunStore
    parents: dict[str, Record]
    emit: Emit
    device: torch.device


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)

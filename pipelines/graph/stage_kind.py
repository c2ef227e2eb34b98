"""The kinds of stage node in a scenario graph, and the ``resources`` section of the config each kind runs under.

Members are strings (``StageKind.ENTRY == "entry"``), so stage keys, manifests and labels hold the same text as
before; compare kinds with the members, and ask a kind for its section instead of keeping a map of one's own.
"""
from __future__ import annotations

from enum import StrEnum


class StageKind(StrEnum):
    PRETRAIN = "pretrain"  # third-party / initial model trained before the sequence
    FINETUNE = "finetune"  # the model of task t trained from the model of task t - 1
    REPLACE = "replace"  # a replacement model entering at a task (trained like finetune)
    EXTRACT = "extract"  # features of one model on the query or gallery set
    ENTRY = "entry"  # one matrix entry C[t, k]
    EVALUATE = "evaluate"  # row t of the compatibility matrix from its entries
    ADAPT = "adapt"  # adapters fitted at a replacement, with their verdict

    @property
    def config_section(self) -> str:
        """Name of the ``resources.<section>`` this kind reserves and is configured under."""
        return _CONFIG_SECTION[self]

    @property
    def trains(self) -> bool:
        """Whether a stage of this kind trains a model (checkpoints, training records, data-parallel workers)."""
        return self in (StageKind.PRETRAIN, StageKind.FINETUNE, StageKind.REPLACE)


_CONFIG_SECTION = {
    StageKind.PRETRAIN: "pretrain",
    StageKind.FINETUNE: "finetune",
    StageKind.REPLACE: "finetune",
    StageKind.EXTRACT: "extract",
    StageKind.ENTRY: "evaluate",
    StageKind.EVALUATE: "evaluate",
    StageKind.ADAPT: "evaluate",
}

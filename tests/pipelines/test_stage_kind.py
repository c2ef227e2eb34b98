"""pipelines.graph.stage_kind: each kind's resources section and whether it trains (as docs/ARCHITECTURE.md and
the config's resources section describe them)."""
from __future__ import annotations

from pipelines.config.schema import ResourcesSpec, StageResources
from pipelines.graph.stage_kind import StageKind


def test_each_kind_runs_under_its_resources_section():
    expected = {"pretrain": "pretrain", "finetune": "finetune", "replace": "finetune", "extract": "extract",
                "entry": "evaluate", "evaluate": "evaluate", "adapt": "evaluate"}
    assert {kind.value: kind.config_section for kind in StageKind} == expected
    resources = ResourcesSpec(finetune=StageResources(num_cpus=3), extract=StageResources(num_cpus=2))
    assert resources.for_stage("replace").num_cpus == 3 and resources.for_stage("extract").num_cpus == 2


def test_only_model_stages_train_and_kinds_are_their_text():
    assert {kind for kind in StageKind if kind.trains} == {StageKind.PRETRAIN, StageKind.FINETUNE, StageKind.REPLACE}
    assert StageKind("entry") is StageKind.ENTRY and StageKind.ENTRY == "entry"

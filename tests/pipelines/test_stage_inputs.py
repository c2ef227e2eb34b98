"""Stage inputs and keys: a key depends only on the past (appending a task or a late replacement keeps every existing
key), every value a stage reads is in its inputs (so it changes its key), and how-not-what settings are in none."""
import copy
from pathlib import Path

import pytest
import tiny_scenario_helpers as tiny
import yaml

from pipelines.config.load import HOW_NOT_WHAT, apply_override, validate_config
from pipelines.graph.compile import compile_scenario
from pipelines.graph.stage_kind import StageKind
from pipelines.stages.inputs import RunSettings, TrainRecipe
from pipelines.training.settings import TrainConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DEMOS = ("demo-dsimplex-hoc.yaml", "demo-er.yaml")


def _demo(name: str = "demo-dsimplex-hoc.yaml") -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


def _tiny() -> dict:
    tiny.register()
    document = tiny.scenario("dsimplex-hoc")
    document["model"]["num_slots"] = 12  # room for a fourth task of two classes (4 pre-training slots + 8)
    return document


def _keys(document: dict) -> dict[str, str]:
    """Stage label -> key of the compiled document."""
    return {stage.label: stage.key for stage in compile_scenario(validate_config(document), version="v1")}


def _assert_grown_keeps_keys(short: dict, long: dict) -> None:
    before, after = _keys(short), _keys(long)
    assert len(after) > len(before)
    assert {label: after.get(label) for label in before} == before


@pytest.mark.parametrize("name", DEMOS)
def test_appending_a_task_keeps_every_key_of_the_demo(name):
    short = _demo(name)
    long = copy.deepcopy(short)
    long["tasks"]["spec"] = "10+7x15"  # one more task of 15 classes
    _assert_grown_keeps_keys(short, long)


def test_appending_a_task_keeps_every_key_of_the_tiny_scenario():
    short = _tiny()
    long = copy.deepcopy(short)
    long["tasks"]["spec"] = "2+3x2"
    _assert_grown_keeps_keys(short, long)


def test_appending_a_late_replacement_keeps_every_key():
    """A new third-party model and a replacement at the appended task: the first tasks, their extracts and matrix
    entries, and the other third-party models keep their keys."""
    short = _demo()
    long = copy.deepcopy(short)
    long["tasks"]["spec"] = "10+7x15"
    long["pretrain"].append({**copy.deepcopy(short["pretrain"][2]), "name": "p4"})
    long["replacements"].append({"at_task": 8, "source": "pretrain:p4"})
    _assert_grown_keeps_keys(short, long)


# override -> the stage kinds whose inputs change (on the d-Simplex-HOC demo, whose pretrain entries set their own
# epochs, optimizer and schedule and fall back to the training section for the rest)
TRAINED = {StageKind.FINETUNE, StageKind.REPLACE}
READERS = [
    ("training.optimizer.lr=0.01", TRAINED),
    ("training.epochs=5", TRAINED),
    ("training.batch_size=64", TRAINED | {StageKind.PRETRAIN}),
    ("training.warmup_epochs=1", TRAINED | {StageKind.PRETRAIN}),
    ("training.steps_per_epoch=3", TRAINED | {StageKind.PRETRAIN}),
    ("training.augment=false", TRAINED | {StageKind.PRETRAIN}),
    ("training.log_every_steps=5", TRAINED | {StageKind.PRETRAIN}),
    ("training.autocast=bf16", TRAINED | {StageKind.PRETRAIN, StageKind.EXTRACT}),
    ("training.replay_sampling=mixed", TRAINED),
    ("training.model_selection=compatibility", TRAINED),
    ("replay.per_class=10", TRAINED),
    ("replay.strategy=herding", TRAINED),
    ("replay.epoch_length=task", TRAINED),
    ("evaluation.batch_size=64", TRAINED | {StageKind.EXTRACT}),
    ("evaluation.feature_dtype=float32", {StageKind.EXTRACT}),
    ("evaluation.features=direct", {StageKind.EXTRACT}),
    ("evaluation.query_set.per_class=5", {StageKind.EXTRACT}),
    ("evaluation.metric=map", {StageKind.ENTRY, StageKind.EVALUATE}),
    ("evaluation.gallery=instances", {StageKind.ENTRY, StageKind.EVALUATE}),
    ("evaluation.label_level=fine", {StageKind.ENTRY, StageKind.EVALUATE}),
    ("evaluation.verification_pairs=100", {StageKind.ENTRY, StageKind.EVALUATE}),
    ("method.params.rho=5.0", TRAINED | {StageKind.EXTRACT, StageKind.ENTRY}),
    ("seed=1", TRAINED | {StageKind.PRETRAIN, StageKind.ENTRY}),
    ("tasks.seed=3", TRAINED),
    ("data.per_class=50", TRAINED),
    ("model.num_slots=2000", TRAINED | {StageKind.PRETRAIN}),
    ("model.backbone_config.width=32", TRAINED | {StageKind.PRETRAIN}),
    ("pretrain.0.epochs=3", {StageKind.PRETRAIN}),
    ("pretrain.0.seed=5", {StageKind.PRETRAIN}),
    ("replacements.0.anchor=replaced", {StageKind.REPLACE}),
    ("resources.pretrain.num_cpus=2", {StageKind.PRETRAIN}),
    ("resources.finetune.num_cpus=2", TRAINED),
    ("resources.extract.num_cpus=2", {StageKind.EXTRACT}),
    ("resources.evaluate.num_cpus=2", {StageKind.ENTRY}),
]
# settings that change how stages run, never what they compute (and metadata): in no stage's inputs
HOW = [f"training.{name}={value}" for name, value in zip(HOW_NOT_WHAT, (2, 3, 1, 4))] + [
    "evaluation.strict=false", "device=cpu", "output.dir=/elsewhere", "output.shared_store=/shared",
    "description=other", "resources.finetune.memory=1000000", "resources.extract.num_gpus=1",
    "resources.pretrain.own_process=true", "resources.autoscaling=true", "resources.evaluation_actors=2",
]


def _inputs_by_label(overrides: list[str]) -> dict[str, tuple]:
    document = _demo()
    for assignment in overrides:
        apply_override(document, assignment)
    graph = compile_scenario(validate_config(document), version="v1")
    return {stage.label: (stage.kind, stage.inputs.model_dump(mode="json"), stage.key) for stage in graph}


@pytest.fixture(scope="module")
def demo_inputs():
    return _inputs_by_label([])


@pytest.mark.parametrize("override,kinds", READERS, ids=[override for override, _ in READERS])
def test_a_value_a_stage_reads_is_in_its_inputs_and_key(demo_inputs, override, kinds):
    varied = _inputs_by_label([override])
    changed = {kind for label, (kind, inputs, _) in demo_inputs.items() if varied[label][1] != inputs}
    assert changed == kinds
    for label, (_, inputs, key) in demo_inputs.items():
        if varied[label][1] != inputs:
            assert varied[label][2] != key, label  # the key hashes the inputs


@pytest.mark.parametrize("override", HOW)
def test_how_not_what_settings_change_no_key(demo_inputs, override):
    assert _inputs_by_label([override]) == demo_inputs


def test_the_training_settings_are_split_once_into_what_and_how():
    """Every TrainConfig field is either in a training stage's recipe (what it computes), a run setting (how it
    runs: HOW_NOT_WHAT) or the device: a new field has to be placed in one of them."""
    how = set(RunSettings.model_fields) - {"device", "guards"}
    assert how == set(HOW_NOT_WHAT)
    assert set(TrainRecipe.model_fields) | how | {"device"} == set(TrainConfig.model_fields)
    assert not set(TrainRecipe.model_fields) & how


def test_run_settings_give_the_training_loop_the_configs_values():
    document = _demo()
    for assignment in ("training.input_workers=2", "training.checkpoint_every_epochs=3"):
        apply_override(document, assignment)
    config = validate_config(document)
    graph = compile_scenario(config, version="v1")
    inputs = graph[graph.model_stages[1]].inputs
    train_config = inputs.training.train_config("cpu", graph.settings)
    assert train_config == config.train_config(config.seed * 1000 + 1, "cpu")  # the section as written
    assert (train_config.input_workers, train_config.checkpoint_every_epochs) == (2, 3)


def test_a_weights_file_is_keyed_by_its_bytes_not_its_location(tmp_path):
    """The same bytes at another path give the same key; other bytes at the same path another key."""
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    first.write_bytes(b"weights one")
    second.write_bytes(b"weights one")
    keys = []
    for path in (first, second):
        document = _tiny()
        document["replacements"][0]["source"] = str(path)
        keys.append(_keys(document)["replace[t=2]"])
    assert keys[0] == keys[1]
    third = tmp_path / "c.safetensors"
    third.write_bytes(b"weights two")
    document = _tiny()
    document["replacements"][0]["source"] = str(third)
    assert _keys(document)["replace[t=2]"] != keys[0]

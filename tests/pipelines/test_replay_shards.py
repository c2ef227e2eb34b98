"""Replay memory as shards: a task reads its own data, the previous replay shard and the previous model only."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import pipelines.stages as stages
import tiny_scenario_helpers as tiny
from compat_core.data.registry import DATASETS
from pipelines.config import validate_config
from pipelines.executor import LocalExecutor
from pipelines.graph import compile_scenario
from pipelines.store import RunStore

GUARD: dict = {"task_of_class": {}}


class ForgettingSource:
    """The fine-tuning pool as if each task's source files were deleted once a later task has started reading:
    reading a sample of an older task than the newest one read so far raises FileNotFoundError."""

    def __init__(self, source) -> None:
        self.source = source
        self.newest = -1
        for name in ("name", "labels", "class_names", "coarse_labels", "image_shape", "mean", "std", "hflip"):
            setattr(self, name, getattr(source, name))

    def __len__(self) -> int:
        return len(self.source)

    @property
    def num_classes(self) -> int:
        return self.source.num_classes

    def read(self, indices):
        tasks = [GUARD["task_of_class"][int(c)] for c in self.labels[np.asarray(indices, dtype=np.int64)]]
        if tasks and min(tasks) < self.newest:
            raise FileNotFoundError(f"source files of task {min(tasks)} were deleted (task {self.newest} started)")
        self.newest = max([self.newest, *tasks])
        return self.source.read(indices)


def forgetting(split: str = "finetune", root=None):
    source = tiny.make_source(split)
    return ForgettingSource(source) if split == "finetune" else source


def _run(scenario: dict, run_dir: Path, monkeypatch) -> list:
    monkeypatch.setattr(stages, "_POOL_CACHE", {})
    config = validate_config(scenario)
    LocalExecutor(progress=False).run(compile_scenario(config), RunStore(run_dir))
    return json.loads((run_dir / "matrix.json").read_text())["values"]


def _scenario(dataset: str, output: Path, strategy: str = "random") -> dict:
    scenario = tiny.scenario("er", output=str(output))
    scenario["data"]["dataset"] = dataset
    scenario["replay"]["strategy"] = strategy
    return scenario


@pytest.fixture()
def registered(monkeypatch):
    tiny.register()
    if "tiny-forgetting" not in DATASETS:
        DATASETS.register("tiny-forgetting", forgetting)
    config = validate_config(_scenario("tiny-synth", Path("unused")))
    GUARD["task_of_class"] = {int(c): t for t, classes in enumerate(stages.task_classes(config)) for c in classes}
    torch.set_num_threads(1)


def _index_replay(monkeypatch):
    """The behaviour before replay shards: memory images read from the source by index, no shard written."""
    monkeypatch.setattr(stages, "_memory_images_from_record", lambda store, record, memory: None)
    monkeypatch.setattr(stages, "_write_memory_shard", lambda *args: None)


@pytest.mark.parametrize("strategy", ["random", "herding"])
def test_old_tasks_source_is_never_read_and_the_matrix_is_unchanged(registered, tmp_path, monkeypatch, strategy):
    with monkeypatch.context() as patch:
        _index_replay(patch)
        before = _run(_scenario("tiny-synth", tmp_path / "before", strategy), tmp_path / "before", patch)
        with pytest.raises(FileNotFoundError, match="were deleted"):  # the guard bites the index-based replay
            _run(_scenario("tiny-forgetting", tmp_path / "guarded-old", strategy), tmp_path / "guarded-old", patch)
    after = _run(_scenario("tiny-forgetting", tmp_path / "after", strategy), tmp_path / "after", monkeypatch)
    assert after == before
    shards = sorted((tmp_path / "after" / "replay").glob("*/shards/replay/*.manifest.json"))
    assert len(shards) == 3 and all(json.loads(p.read_text())["rows"] > 0 for p in shards)


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_corrupt_or_missing_replay_shard_is_refused_before_training(registered, tmp_path, monkeypatch, damage):
    import pipelines.training as training
    from compat_core.data.replay_shards import CorruptShardError
    from pipelines.store import CorruptArtifactError

    run_dir = tmp_path / "run"
    _run(_scenario("tiny-synth", run_dir), run_dir, monkeypatch)
    store = RunStore(run_dir)
    first = next(key for key in store.stage_keys() if key.startswith("finetune-t000"))
    shard = store.load_record(first)["memory"]["shard"]
    parquet = run_dir / shard["folder"] / "shards" / "replay" / "task-000.parquet"
    if damage == "missing":
        parquet.unlink()
    else:
        data = bytearray(parquet.read_bytes())
        data[len(data) // 2] ^= 0xFF
        parquet.write_bytes(bytes(data))
    for key in store.stage_keys():  # forget every stage after the first task, so the run redoes task 2
        if not key.startswith(("finetune-t000", "pretrain")):
            (run_dir / "manifests" / f"{key}.json").unlink()
    monkeypatch.setattr(training, "train_task", lambda *a, **k: pytest.fail("training started"))
    with pytest.raises(Exception) as info:
        _run(_scenario("tiny-synth", run_dir), run_dir, monkeypatch)
    chain, error = [], info.value
    while error is not None:
        chain.append(error)
        error = error.__cause__ or error.__context__
    shard_errors = [e for e in chain if isinstance(e, CorruptShardError)]
    assert shard_errors, info.value
    assert str(parquet) in str(shard_errors[0]) and shard["sha256"] in str(shard_errors[0])
    # the CLI turns this into "recompute that stage with --recompute <the stage that wrote the shard>"
    assert any(isinstance(e, CorruptArtifactError) and e.stage_key == first for e in chain)

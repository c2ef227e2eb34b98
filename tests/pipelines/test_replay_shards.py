"""Replay memory as shards: a task reads its own data, the previous replay shard and the previous model only."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tiny_scenario_helpers as tiny
import torch

import pipelines.stages.pools as pools
import pipelines.stages.training_stages as train_stages
from compat_core.data.datasets import DATASETS
from pipelines.config.load import validate_config
from pipelines.engine.runner import LocalExecutor
from pipelines.graph.compile import compile_scenario
from pipelines.store.run_store import RunStore

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

    def _guard(self, indices) -> None:
        tasks = [GUARD["task_of_class"][int(c)] for c in self.labels[np.asarray(indices, dtype=np.int64)]]
        if tasks and min(tasks) < self.newest:
            raise FileNotFoundError(f"source files of task {min(tasks)} were deleted (task {self.newest} started)")
        self.newest = max([self.newest, *tasks])

    def read(self, indices):
        self._guard(indices)
        return self.source.read(indices)

    def encoded_images(self, indices):
        """The encoded files of an encoded source (the replay shard stores them): old tasks' files are gone too."""
        self._guard(indices)
        return getattr(self.source, "encoded_images", lambda _: None)(indices)


def forgetting(split: str = "finetune", root=None):
    source = tiny.make_source(split)
    return ForgettingSource(source) if split == "finetune" else source


JPEG_FILES: dict[str, bytes] = {}


def jpeg_source(split: str = "finetune", root=None):
    """The tiny pool as published JPEG files (RGB, 16 px), read through EncodedImageSource like CelebA's."""
    import io

    from PIL import Image

    from compat_core.data.formats._shared import EncodedImageSource

    source = tiny.make_source(split)
    names = []
    for i, image in enumerate(source.images):
        name = f"{split}/{i:04d}.jpg"
        if name not in JPEG_FILES:
            buffer = io.BytesIO()
            Image.fromarray(np.repeat(image, 3, axis=2)).save(buffer, format="JPEG", quality=90)
            JPEG_FILES[name] = buffer.getvalue()
        names.append(name)
    return EncodedImageSource(f"tiny-jpeg/{split}", names, source.labels, source.class_names, image_size=16,
                              hflip=False, fetch=JPEG_FILES.__getitem__, cache_size=0)


def forgetting_jpeg(split: str = "finetune", root=None):
    source = jpeg_source(split)
    return ForgettingSource(source) if split == "finetune" else source


def _run(scenario: dict, run_dir: Path, monkeypatch) -> list:
    monkeypatch.setattr(pools, "_POOL_CACHE", {})
    config = validate_config(scenario)
    LocalExecutor(progress=False).run(compile_scenario(config), RunStore(run_dir))
    return json.loads((run_dir / "matrix.json").read_text())["values"]


def _scenario(dataset: str, output: Path, strategy: str = "random") -> dict:
    scenario = tiny.scenario("er", output=str(output))
    scenario["data"]["dataset"] = dataset
    scenario["replay"]["strategy"] = strategy
    if "jpeg" in dataset:  # every pool from the JPEG files, RGB
        scenario["model"]["backbone_config"]["in_chans"] = 3
        for pool in [scenario["pretrain"][0]["pool"], scenario["evaluation"]["query_set"],
                     scenario["evaluation"]["gallery_set"]]:
            pool["dataset"] = "tiny-jpeg"
    return scenario


@pytest.fixture()
def registered(monkeypatch):
    tiny.register()
    for name, factory in (("tiny-forgetting", forgetting), ("tiny-jpeg", jpeg_source),
                          ("tiny-forgetting-jpeg", forgetting_jpeg)):
        if name not in DATASETS:
            DATASETS.register(name, factory)
    config = validate_config(_scenario("tiny-synth", Path("unused")))
    GUARD["task_of_class"] = {int(c): t for t, classes in enumerate(pools.scenario_task_classes(config)) for c in classes}
    torch.set_num_threads(1)


def _index_replay(monkeypatch):
    """The behaviour before replay shards: memory images read from the source by index, no shard written."""
    monkeypatch.setattr(train_stages, "memory_images_from_record", lambda store, record, memory: None)
    monkeypatch.setattr(train_stages, "write_task_memory_shard", lambda *args: None)


@pytest.mark.parametrize("strategy,images", [("random", "arrays"), ("herding", "arrays"), ("random", "jpeg")])
def test_old_tasks_source_is_never_read_and_the_matrix_is_unchanged(registered, tmp_path, monkeypatch, strategy,
                                                                     images):
    plain, guarded = ("tiny-synth", "tiny-forgetting") if images == "arrays" else ("tiny-jpeg", "tiny-forgetting-jpeg")
    with monkeypatch.context() as patch:
        _index_replay(patch)
        before = _run(_scenario(plain, tmp_path / "before", strategy), tmp_path / "before", patch)
        with pytest.raises(FileNotFoundError, match="were deleted"):  # the guard bites the index-based replay
            _run(_scenario(guarded, tmp_path / "guarded-old", strategy), tmp_path / "guarded-old", patch)
    after = _run(_scenario(guarded, tmp_path / "after", strategy), tmp_path / "after", monkeypatch)
    assert after == before
    shards = sorted((tmp_path / "after" / "replay").glob("*/shards/replay/*.manifest.json"))
    assert len(shards) == 3 and all(json.loads(p.read_text())["rows"] > 0 for p in shards)
    manifests = [json.loads(p.read_text()) for p in shards]
    assert {m["image_encoding"] for m in manifests} == {"raw-uint8-hwc" if images == "arrays" else "encoded/pil"}
    if images == "jpeg":  # the shard rows are the published files' bytes, not decoded pixels
        import pyarrow.parquet as pq

        table = pq.read_table(shards[-1].with_name(shards[-1].name.replace(".manifest.json", ".parquet")))
        stored = table.column("image").to_pylist()
        files = set(JPEG_FILES.values())
        assert stored and all(blob[:2] == b"\xff\xd8" and blob in files for blob in stored)


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_corrupt_or_missing_replay_shard_is_refused_before_training(registered, tmp_path, monkeypatch, damage):
    from compat_core.integrity import IntegrityError

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
    monkeypatch.setattr(train_stages, "train_task", lambda *a, **k: pytest.fail("training started"))
    with pytest.raises(Exception) as info:
        _run(_scenario("tiny-synth", run_dir), run_dir, monkeypatch)
    chain, error = [], info.value
    while error is not None:
        chain.append(error)
        error = error.__cause__ or error.__context__
    shard_errors = [e for e in chain if isinstance(e, IntegrityError)]
    assert shard_errors, info.value
    assert str(parquet) in str(shard_errors[0]) and shard["sha256"] in str(shard_errors[0])
    # the CLI turns this into "recompute that stage with --recompute <the stage that wrote the shard>"
    assert shard_errors[0].stage_key == first

"""`compat ingest`: a registered split -> verified Parquet parts; read back identical; resumable; corrupt -> error."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))
import tiny_scenario_helpers as tiny  # noqa: E402

from cluster.storage.ingest import ingest  # noqa: E402
from compat_core.data.datasets import DATASETS, load_dataset  # noqa: E402
from compat_core.integrity import IntegrityError  # noqa: E402

SPLITS = ("finetune", "pretrain", "query", "gallery")


@pytest.fixture()
def shards_root(tmp_path):
    tiny.register()
    root = tmp_path / "shards"
    for split in SPLITS:
        ingest("tiny-synth", None, split, str(root), rows_per_part=7, workers=0, progress=None)
    return root


def test_ingested_split_reads_back_identical_and_manifest_hashes_the_files(shards_root):
    original = load_dataset("tiny-synth", split="finetune")
    shards = load_dataset("shards", root=str(shards_root), split="finetune")
    assert len(shards) == len(original) == 60
    np.testing.assert_array_equal(shards.labels, original.labels)
    np.testing.assert_array_equal(shards.read(np.arange(60)[::-1]), original.read(np.arange(60)[::-1]))
    assert shards.class_names == original.class_names and shards.hflip == original.hflip
    assert shards.mean == pytest.approx(original.mean) and shards.std == pytest.approx(original.std)
    manifest = json.loads((shards_root / "finetune" / "manifest.json").read_text())
    assert [p["rows"] for p in manifest["parts"]] == [7] * 8 + [4]
    for part in manifest["parts"]:  # sha256 and size recomputed here from the bytes on disk
        data = (shards_root / "finetune" / part["name"]).read_bytes()
        assert part["sha256"] == hashlib.sha256(data).hexdigest() and part["size"] == len(data)


def test_ingest_resumes_per_part(shards_root):
    folder = shards_root / "finetune"
    (folder / "part-00003.parquet").unlink()
    before = {p.name: p.stat().st_mtime_ns for p in folder.glob("part-*.parquet")}
    lines = []
    ingest("tiny-synth", None, "finetune", str(shards_root), rows_per_part=7, workers=0, progress=lines.append)
    assert sum("(kept)" in line for line in lines) == 8 and sum("(written)" in line for line in lines) == 1
    after = {p.name: p.stat().st_mtime_ns for p in folder.glob("part-*.parquet")}
    assert all(after[name] == stamp for name, stamp in before.items())  # kept parts were not rewritten
    np.testing.assert_array_equal(load_dataset("shards", root=str(shards_root), split="finetune").read(np.arange(60)),
                                  load_dataset("tiny-synth", split="finetune").read(np.arange(60)))


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_corrupt_or_missing_part_names_key_and_expected_sha256(shards_root, damage):
    folder = shards_root / "query"
    manifest = json.loads((folder / "manifest.json").read_text())
    part = folder / manifest["parts"][1]["name"]
    if damage == "missing":
        part.unlink()
    else:
        data = bytearray(part.read_bytes())
        data[len(data) // 2] ^= 0xFF
        part.write_bytes(bytes(data))
    with pytest.raises(IntegrityError) as info:
        load_dataset("shards", root=str(shards_root), split="query")
    message = str(info.value)
    assert str(part) in message and manifest["parts"][1]["sha256"] in message


def test_ingest_with_ray_tasks(tmp_path, ray_local):
    out = str(tmp_path / "ingested")
    # a built-in dataset, so that the Ray tasks can open it themselves
    ingest("glyphs", str(tmp_path / "glyphs-cache"), "test", out, rows_per_part=500, workers=2, progress=None)
    original = load_dataset("glyphs", root=str(tmp_path / "glyphs-cache"), split="test")
    shards = load_dataset("shards", root=out, split="test")
    picks = np.random.default_rng(0).choice(len(original), size=50, replace=False)
    np.testing.assert_array_equal(shards.labels, original.labels)
    np.testing.assert_array_equal(shards.read(picks), original.read(picks))


def test_ingest_to_s3_and_corrupt_object_names_bucket_and_key(s3_bucket):
    import boto3

    tiny.register()
    uri = f"s3://{s3_bucket}/ingested"
    manifest = ingest("tiny-synth", None, "query", uri, rows_per_part=11, workers=0, progress=None)
    original = load_dataset("tiny-synth", split="query")
    shards = load_dataset("shards", root=uri, split="query")
    np.testing.assert_array_equal(shards.read(np.arange(len(original))), original.read(np.arange(len(original))))
    client = boto3.client("s3")
    client.put_object(Bucket=s3_bucket, Key="ingested/query/part-00001.parquet", Body=b"not the stored part")
    with pytest.raises(IntegrityError) as info:
        load_dataset("shards", root=uri, split="query")
    assert info.value.bucket == s3_bucket and info.value.key == "ingested/query/part-00001.parquet"
    assert manifest.parts[1].sha256 in str(info.value) and s3_bucket in str(info.value)


def _run_matrix(scenario: dict, run_dir: Path) -> list:
    from pipelines.config.load import validate_config
    from pipelines.engine.runner import LocalExecutor
    from pipelines.graph.compile import compile_scenario
    from pipelines.store.run_store import RunStore

    config = validate_config(scenario)
    LocalExecutor(progress=False).run(compile_scenario(config), RunStore(run_dir))
    return json.loads((run_dir / "matrix.json").read_text())["values"]


def _point_pools_at(node, root: str):
    """Every pool {dataset: tiny-synth, split: S} of a scenario -> {dataset: shards, root, split: S}."""
    if isinstance(node, dict):
        if node.get("dataset") == "tiny-synth":
            return {**node, "dataset": "shards", "root": root}
        return {key: _point_pools_at(value, root) for key, value in node.items()}
    if isinstance(node, list):
        return [_point_pools_at(value, root) for value in node]
    return node


def test_run_on_ingested_shards_without_the_source_gives_the_same_matrix(shards_root, tmp_path, monkeypatch):
    import pipelines.stages.pools as pools

    torch.set_num_threads(1)
    direct = _run_matrix(tiny.scenario("dsimplex-hoc", output=str(tmp_path / "direct")), tmp_path / "direct")
    # the source is gone: only the ingested shards remain readable
    monkeypatch.delitem(DATASETS._entries, "tiny-synth")
    monkeypatch.setattr(pools, "_POOL_CACHE", {})
    scenario = _point_pools_at(tiny.scenario("dsimplex-hoc", output=str(tmp_path / "sharded")), str(shards_root))
    assert "tiny-synth" not in json.dumps(scenario)
    scenario["training"]["input_workers"] = 2  # streamed training and extraction: the same matrix
    sharded = _run_matrix(scenario, tmp_path / "sharded")
    assert sharded == direct and len(direct) == 3


def test_published_jpegs_keep_their_bytes_and_both_decoders_agree(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compat_core" / "data"))
    from fixtures_published import write_celeba

    rng = np.random.default_rng(1)
    yy, xx = np.mgrid[0:218, 0:178]
    rows = []
    for i in range(6):  # smooth 178x218 faces-sized images, the published aligned size
        pixels = np.stack([(xx * (i + 1) + yy * c) % 256 for c in (1, 2, 3)], axis=-1).astype(np.uint8)
        rows.append((f"{i + 1:06d}.jpg", i // 2 + 1, 0, np.clip(pixels + rng.normal(0, 3, pixels.shape), 0, 255)
                     .astype(np.uint8)))
    root = write_celeba(tmp_path / "celeba", rows)
    ingest("celeba", str(root), "train", str(tmp_path / "shards"), options={"image_size": 64}, workers=0,
           progress=None)
    published = load_dataset("celeba", root=str(root), split="train", image_size=64)
    shards = load_dataset("shards", root=str(tmp_path / "shards"), split="train")
    assert shards.encoded_rows([3])[0] == (root / "img_align_celeba" / "000004.jpg").read_bytes()
    np.testing.assert_array_equal(shards.read(np.arange(6)), published.read(np.arange(6)))
    fast = load_dataset("shards", root=str(tmp_path / "shards"), split="train", decoder="torchvision")
    difference = np.abs(fast.read(np.arange(6)).astype(float) - published.read(np.arange(6)).astype(float))
    assert fast.read(np.arange(6)).shape == (6, 64, 64, 3) and difference.mean() < 4.0


def test_kept_rows_read_from_memory_in_any_order_through_task_views(shards_root):
    """keep_rows (called by train_task before its epochs) reads a task's rows once; shuffled batches then never go
    back to the files: the parts are deleted and the reads still equal the source's, through the views a training
    task uses (a filtered pool, the pool followed by replay images)."""
    from compat_core.data.stream import keep_rows
    from pipelines.stages.pools import SubsetSource
    from pipelines.stages.replay_store import WithMemory

    original = load_dataset("tiny-synth", split="finetune")
    shards = load_dataset("shards", root=str(shards_root), split="finetune")
    pool = SubsetSource(shards, np.arange(7, 60))                  # parts 1..8 (rows of 7)
    replay = original.read(np.array([0, 1, 2]))
    task = WithMemory(pool, replay, original.labels[:3])
    task_rows = np.array([30, 2, 5, 16, 40, 11, 52])               # pool positions -> samples 37, 9, 12, 23, 47, 18, 59
    keep_rows(task, np.concatenate([task_rows, task.memory_indices()]))
    for part in shards_root.glob("finetune/part-*.parquet"):
        part.unlink()
    order = np.random.default_rng(0).permutation(np.concatenate([task_rows, task.memory_indices()]))
    expected = np.concatenate([original.read(7 + task_rows), replay])
    position = {int(p): i for i, p in enumerate(np.concatenate([task_rows, task.memory_indices()]))}
    np.testing.assert_array_equal(task.read(order), expected[[position[int(p)] for p in order]])
    with pytest.raises(OSError):                                  # a row not kept needs its (deleted) file
        pool.read(np.array([0]))
    shards.keep_rows(np.array([], dtype=np.int64))                # the next task's call replaces the kept rows
    with pytest.raises(OSError):
        task.read(task_rows[:1])

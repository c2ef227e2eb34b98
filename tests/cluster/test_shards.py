"""Replay shards on a local folder: round trip, manifest-last commit, and every kind of corruption the reader catches.

The same functions run against the real S3 server in test_storage_s3.py.
"""
from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from compat_core import io as cio
from compat_core.data import replay_parquet as shards
from compat_core.data.source import ArraySource
from compat_core.data.replay import ReplayMemory
from compat_core.data.replay_parquet import read_replay_shard, shard_uris, write_replay_shard
from compat_core.integrity import IntegrityError
from pipelines.store.run_store import RunStore


def _memory_and_images(rows: int = 5, shape=(4, 3, 3), seed: int = 0):
    rng = np.random.default_rng(seed)
    memory = ReplayMemory(
        indices=np.arange(rows) * 7 + 2,
        labels=np.arange(rows) % 3 + 10,
        slots=np.arange(rows) % 3,
        source_task=np.arange(rows) // 3,
    )
    images = rng.integers(0, 256, size=(rows, *shape), dtype=np.uint8)
    return memory, images


def test_round_trip_matches_memory_images_and_independent_digests(tmp_path):
    memory, images = _memory_and_images()
    manifest = write_replay_shard(str(tmp_path), 1, memory, images)
    parquet_path = tmp_path / "shards" / "replay" / "task-001.parquet"
    manifest_path = tmp_path / "shards" / "replay" / "task-001.manifest.json"
    raw = parquet_path.read_bytes()
    assert manifest.sha256 == hashlib.sha256(raw).hexdigest()
    assert manifest.size == len(raw)
    assert manifest.rows == 5
    assert manifest.image_shape == (4, 3, 3)
    assert manifest.schema == str(pq.read_schema(parquet_path))
    assert json.loads(manifest_path.read_text())["sha256"] == manifest.sha256

    shard = read_replay_shard(str(tmp_path), 1)
    for name in ("indices", "labels", "slots", "source_task"):
        np.testing.assert_array_equal(getattr(shard.memory, name), getattr(memory, name))
    np.testing.assert_array_equal(shard.images, images)
    assert shard.images.dtype == np.uint8
    assert shard.manifest == manifest


def test_row_content_hash_is_sha256_of_packed_fields_and_pixels(tmp_path):
    memory, images = _memory_and_images(rows=2, shape=(2, 2, 1))
    write_replay_shard(str(tmp_path), 0, memory, images)
    shard = read_replay_shard(str(tmp_path), 0)
    # row 1: index 9, label 11, slot 1, source task 0, image 2x2x1
    header = struct.pack("<qqqqiii", 9, 11, 1, 0, 2, 2, 1)
    assert shard.content_hashes[1] == hashlib.sha256(header + images[1].tobytes()).hexdigest()
    table = pq.read_table(tmp_path / "shards" / "replay" / "task-000.parquet")
    assert table.column_names == ["index", "label", "slot", "source_task", "height", "width", "channels",
                                  "image", "content_hash"]
    assert table.column("image")[0].as_py() == images[0].tobytes()


def test_images_come_from_an_image_source_by_memory_indices(tmp_path):
    rng = np.random.default_rng(3)
    pool = rng.integers(0, 256, size=(40, 5, 5, 3), dtype=np.uint8)
    source = ArraySource(name="pool", images=pool, labels=np.arange(40) % 4,
                         class_names=[f"c{i}" for i in range(4)])
    memory = ReplayMemory(indices=[31, 4, 17], labels=[3, 0, 1], slots=[0, 1, 2], source_task=[2, 2, 2])
    write_replay_shard(RunStore(tmp_path / "run"), 2, memory, source)
    assert (tmp_path / "run" / "shards" / "replay" / "task-002.manifest.json").is_file()
    shard = read_replay_shard(RunStore(tmp_path / "run"), 2)
    np.testing.assert_array_equal(shard.images, pool[[31, 4, 17]])


def test_empty_memory_keeps_the_image_shape(tmp_path):
    source = ArraySource(name="pool", images=np.zeros((3, 6, 7, 1), np.uint8), labels=np.zeros(3, np.int64),
                         class_names=["a"])
    write_replay_shard(str(tmp_path), 0, ReplayMemory.empty(), source)
    shard = read_replay_shard(str(tmp_path), 0)
    assert len(shard.memory) == 0 and shard.images.shape == (0, 6, 7, 1)


def test_manifest_is_written_last_and_a_crash_before_it_leaves_no_shard(tmp_path, monkeypatch):
    memory, images = _memory_and_images()

    def crash(uri, data):
        raise RuntimeError("simulated crash before the manifest")

    monkeypatch.setattr(shards.cio, "write_bytes", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        write_replay_shard(str(tmp_path), 3, memory, images)
    monkeypatch.undo()
    parquet_uri, manifest_uri = shard_uris(str(tmp_path), 3)
    assert (tmp_path / "shards" / "replay" / "task-003.parquet").is_file()  # the orphan exists...
    assert not cio.exists(manifest_uri)  # ...but the shard is not committed (no manifest)
    with pytest.raises(FileNotFoundError, match=r"task 3 is not committed.*task-003\.manifest\.json"):
        read_replay_shard(str(tmp_path), 3)
    write_replay_shard(str(tmp_path), 3, memory, images)  # a rerun replaces the orphan
    assert cio.exists(manifest_uri)
    np.testing.assert_array_equal(read_replay_shard(str(tmp_path), 3).images, images)


def test_flipped_byte_is_reported_with_key_expected_and_actual_sha(tmp_path):
    memory, images = _memory_and_images()
    manifest = write_replay_shard(str(tmp_path), 0, memory, images)
    path = tmp_path / "shards" / "replay" / "task-000.parquet"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    actual = hashlib.sha256(bytes(data)).hexdigest()
    with pytest.raises(IntegrityError) as caught:
        read_replay_shard(str(tmp_path), 0)
    error = caught.value
    assert (error.field, error.expected, error.actual) == ("sha256", manifest.sha256, actual)
    assert error.bucket is None and error.key == str(path)
    assert manifest.sha256 in str(error) and actual in str(error) and str(path) in str(error)


def test_truncated_and_missing_files_are_size_errors(tmp_path):
    memory, images = _memory_and_images()
    manifest = write_replay_shard(str(tmp_path), 0, memory, images)
    path = tmp_path / "shards" / "replay" / "task-000.parquet"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(IntegrityError, match=rf"size expected {manifest.size} bytes, actual 100 bytes"):
        read_replay_shard(str(tmp_path), 0)
    path.unlink()
    with pytest.raises(IntegrityError, match="actual file missing"):
        read_replay_shard(str(tmp_path), 0)


def test_row_count_and_schema_are_checked_against_the_manifest(tmp_path):
    memory, images = _memory_and_images()
    write_replay_shard(str(tmp_path), 0, memory, images)
    manifest_path = tmp_path / "shards" / "replay" / "task-000.manifest.json"
    original = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**original, "rows": 6}))
    with pytest.raises(IntegrityError, match="row count expected 6, actual 5") as caught:
        read_replay_shard(str(tmp_path), 0)
    assert (caught.value.expected, caught.value.actual) == (6, 5)
    manifest_path.write_text(json.dumps({**original, "schema": "index: int32"}))
    with pytest.raises(IntegrityError, match="schema expected 'index: int32'"):
        read_replay_shard(str(tmp_path), 0)
    manifest_path.write_text("{not json")
    with pytest.raises(IntegrityError, match="manifest JSON"):
        read_replay_shard(str(tmp_path), 0)


def test_row_content_hash_catches_a_consistently_rewritten_file(tmp_path):
    # a writer bug that changes pixels but rewrites file and manifest consistently: only the row hash notices
    memory, images = _memory_and_images()
    write_replay_shard(str(tmp_path), 0, memory, images)
    path = tmp_path / "shards" / "replay" / "task-000.parquet"
    table = pq.read_table(path)
    tampered = images.copy()
    tampered[2, 0, 0, 0] ^= 1
    column = table.schema.get_field_index("image")
    table = table.set_column(column, table.schema.field(column),
                             pa.array([row.tobytes() for row in tampered], pa.large_binary()))
    pq.write_table(table, path)
    manifest_path = tmp_path / "shards" / "replay" / "task-000.manifest.json"
    raw = path.read_bytes()
    manifest = json.loads(manifest_path.read_text())
    manifest.update(sha256=hashlib.sha256(raw).hexdigest(), size=len(raw))
    manifest_path.write_text(json.dumps(manifest))
    stored_hash = pq.read_table(path).column("content_hash")[2].as_py()
    header = struct.pack("<qqqqiii", 16, 12, 2, 0, 4, 3, 3)  # row 2: index 2*7+2, label 2%3+10, slot 2, task 0
    recomputed = hashlib.sha256(header + tampered[2].tobytes()).hexdigest()
    with pytest.raises(IntegrityError, match="content hash of row 2") as caught:
        read_replay_shard(str(tmp_path), 0)
    assert (caught.value.expected, caught.value.actual) == (stored_hash, recomputed)


def test_input_validation_names_the_problem(tmp_path):
    memory, images = _memory_and_images()
    with pytest.raises(ValueError, match="has 4 images but the memory has 5 rows"):
        write_replay_shard(str(tmp_path), 0, memory, images[:4])
    with pytest.raises(ValueError, match="uint8"):
        write_replay_shard(str(tmp_path), 0, memory, images.astype(np.float32))
    with pytest.raises(ValueError, match="0-based"):
        write_replay_shard(str(tmp_path), -1, memory, images)
    with pytest.raises(TypeError, match="ReplayMemory"):
        write_replay_shard(str(tmp_path), 0, memory.to_dict(), images)
    with pytest.raises(TypeError, match="RunStore or a root"):
        write_replay_shard(3, 0, memory, images)


def test_encoded_source_stores_its_files_and_decodes_them_on_read(tmp_path):
    """A source with encoded files (JPEG here) gets its bytes stored as they are; reading decodes them like the
    source's own reader (identical pixels), row by row when indexed."""
    import io

    from PIL import Image

    from compat_core.data.formats._shared import EncodedImageSource

    rng = np.random.default_rng(3)
    files = {}
    for i in range(6):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, size=(12, 20, 3), dtype=np.uint8)).save(buffer, format="JPEG")
        files[f"{i}.jpg"] = buffer.getvalue()
    source = EncodedImageSource("jpegs", sorted(files), np.arange(6) % 2, ["a", "b"], image_size=8,
                                fetch=files.__getitem__, cache_size=0)
    memory = ReplayMemory(indices=np.array([4, 1, 5]), labels=np.array([0, 1, 1]), slots=np.array([9, 8, 8]),
                          source_task=np.array([0, 0, 1]))
    manifest = write_replay_shard(str(tmp_path), 1, memory, source)
    assert manifest.image_encoding == "encoded/pil" and manifest.image_shape == (8, 8, 3)
    parquet, _ = shard_uris(str(tmp_path), 1)
    assert pq.read_table(parquet).column("image").to_pylist() == [files[f"{i}.jpg"] for i in (4, 1, 5)]
    shard = read_replay_shard(str(tmp_path), 1)
    assert isinstance(shard.images, shards.EncodedImages) and shard.images.shape == (3, 8, 8, 3)
    np.testing.assert_array_equal(shard.images[np.array([2, 0])], source.read(np.array([5, 4])))
    np.testing.assert_array_equal(np.asarray(shard.images), source.read(memory.indices))
    # the row hash covers the stored (encoded) bytes: the same exemplar hashes alike in every shard
    header = struct.pack("<qqqqiii", 1, 1, 8, 0, 8, 8, 3)
    assert shard.content_hashes[1] == hashlib.sha256(header + files["1.jpg"]).hexdigest()

"""RunStore: blobs first, manifest last; a crash in between leaves the stage not done; corruption is detected."""
import json

import numpy as np
import pytest

from pipelines.stages.feature_store import read_features
from compat_core.integrity import IntegrityError
from pipelines.store.run_store import RunStore, feature_blobs, sha256_bytes


def test_commit_then_read_roundtrip(tmp_path):
    store = RunStore(tmp_path / "run")
    assert not store.has("stage-a")
    manifest = store.commit("stage-a", {"value": 1.5}, {"w.bin": b"abc"}, code_version="v1")
    assert store.has("stage-a")
    # sha256 of b"abc" is a published test vector (FIPS 180-2)
    assert manifest["blobs"]["w.bin"] == {
        "sha256": "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad", "size": 3}
    assert store.load_record("stage-a") == {"value": 1.5}
    assert store.read_blob("stage-a", "w.bin") == b"abc"
    assert store.stage_keys() == ["stage-a"]


def test_crash_between_blobs_and_manifest_leaves_stage_not_done(tmp_path, monkeypatch):
    store = RunStore(tmp_path / "run")
    original = store._write

    def crash_on_manifest(path, data):
        if "/manifests/" in path:
            raise KeyboardInterrupt("simulated kill before the manifest")
        original(path, data)

    monkeypatch.setattr(store, "_write", crash_on_manifest)
    with pytest.raises(KeyboardInterrupt):
        store.commit("stage-b", {"x": 1}, {"a.npy": b"1", "b.npy": b"2"})
    assert (tmp_path / "run" / "artifacts" / "stage-b" / "a.npy").exists()  # blobs were written ...
    assert not store.has("stage-b")  # ... but the stage is not done
    with pytest.raises(FileNotFoundError, match="stage-b has no committed manifest"):
        store.load_record("stage-b")
    monkeypatch.setattr(store, "_write", original)
    store.commit("stage-b", {"x": 2}, {"a.npy": b"1"})
    assert store.load_record("stage-b") == {"x": 2}
    leftovers = [p.name for p in (tmp_path / "run").rglob(".tmp-*")]
    assert leftovers == []


def test_corrupted_blob_names_path_expected_and_actual(tmp_path):
    store = RunStore(tmp_path / "run")
    store.commit("s", {}, {"f.npy": b"good bytes"})
    blob = tmp_path / "run" / "artifacts" / "s" / "f.npy"
    blob.write_bytes(b"bad bytes!")
    with pytest.raises(IntegrityError) as error:
        store.read_blob("s", "f.npy")
    message = str(error.value)
    assert str(blob) in message
    assert sha256_bytes(b"good bytes") in message and sha256_bytes(b"bad bytes!") in message


def test_features_stored_fp16_with_labels(tmp_path):
    store = RunStore(tmp_path / "run")
    rng = np.random.default_rng(0)
    features = rng.standard_normal((10, 7)).astype(np.float32)
    labels = np.arange(10) % 3
    blobs, layout = feature_blobs(features, labels, dtype="float16", shard_rows=4)
    assert layout.shards == ["features-00000.npy", "features-00001.npy", "features-00002.npy"]
    store.commit("extract-x", {"layout": layout}, blobs)
    stored, stored_labels, coarse = read_features(store, "extract-x")
    assert stored.dtype == np.float16 and stored.shape == (10, 7)
    np.testing.assert_array_equal(stored, features.astype(np.float16))
    np.testing.assert_array_equal(stored_labels, labels)
    assert coarse is None
    manifest = json.loads((tmp_path / "run" / "manifests" / "extract-x.json").read_text())
    assert manifest["blobs"]["labels.npy"]["size"] == len(blobs["labels.npy"])


def test_keys_with_slash_are_refused(tmp_path):
    with pytest.raises(ValueError, match="stage key"):
        RunStore(tmp_path).has("a/b")

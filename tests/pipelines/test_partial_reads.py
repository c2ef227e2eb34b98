"""Reading one tensor of a stored safetensors blob: only the header and that tensor's bytes are read, each verified
against the per-tensor sha256 the manifest recorded at commit; corruption of the used bytes is refused."""
import numpy as np
import pytest
import torch
from safetensors.torch import load, save

from compat_core import io as cio
from pipelines.records.payloads import JunctionRef
from pipelines.stages import feature_store
from compat_core.integrity import IntegrityError
from pipelines.store.run_store import RunStore

KEY = "finetune-t000-0123456789abcdef"


def _weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"backbone.big": torch.randn(512, 256, generator=generator),             # 512 KiB, never needed
            "junction.weight": torch.randn(39, 32, generator=generator),
            "backbone.half": torch.randn(7, 5, generator=generator).to(torch.bfloat16),
            "scalar": torch.tensor(3, dtype=torch.int64)}


@pytest.fixture
def counted(monkeypatch):
    """Bytes returned by every ranged read and every whole-blob read (what the store fetches)."""
    reads = {"range": 0, "whole": 0}
    real_range, real_blob = cio.read_range, RunStore.read_blob

    def read_range(uri, offset, length):
        data = real_range(uri, offset, length)
        reads["range"] += len(data)
        return data

    def read_blob(self, stage_key, name, manifest=None):
        data = real_blob(self, stage_key, name, manifest)
        reads["whole"] += len(data)
        return data

    monkeypatch.setattr(cio, "read_range", read_range)
    monkeypatch.setattr(RunStore, "read_blob", read_blob)
    return reads


def _check_partial_read(store: RunStore, counted: dict) -> None:
    weights = _weights()
    data = save(weights)
    store.commit(KEY, {"kind": "test"}, {"model.safetensors": data, "other.npy": b"x"})
    index = store.load_manifest(KEY)["blobs"]["model.safetensors"]["index"]
    assert set(index["tensors"]) == set(weights)
    got = store.read_tensors(KEY, "model.safetensors", ["junction.weight", "backbone.half"])
    expected = load(data)
    from compat_core.safetensors_index import tensor_from_bytes

    for name in ("junction.weight", "backbone.half"):
        raw, dtype, shape = got[name]
        assert torch.equal(tensor_from_bytes(raw, dtype, shape, name), expected[name])
    used = weights["junction.weight"].numel() * 4 + weights["backbone.half"].numel() * 2
    # header (8 + JSON) + exactly the two tensors' bytes; the 512 KiB tensor is never read
    assert counted == {"range": index["header_bytes"] + used, "whole": 0}
    assert counted["range"] < 0.02 * len(data)


def test_one_tensor_is_read_by_ranges_and_verified(tmp_path, counted):
    _check_partial_read(RunStore(tmp_path / "run"), counted)


def test_one_tensor_from_s3_by_ranged_gets(s3_bucket, counted):
    _check_partial_read(RunStore(f"s3://{s3_bucket}/run"), counted)


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))


def test_corrupt_bytes_in_the_read_ranges_are_refused(tmp_path):
    store = RunStore(tmp_path / "run")
    store.commit(KEY, {"kind": "test"}, {"model.safetensors": save(_weights())})
    index = store.load_manifest(KEY)["blobs"]["model.safetensors"]["index"]
    path = store.blob_path(KEY, "model.safetensors")
    big, junction = index["tensors"]["backbone.big"], index["tensors"]["junction.weight"]
    _flip(path, big["offset"] + 100)  # a tensor this reader does not use: not read, so not a reason to fail
    raw, _, _ = store.read_tensors(KEY, "model.safetensors", ["junction.weight"])["junction.weight"]
    assert len(raw) == junction["length"]
    _flip(path, junction["offset"] + 3)
    with pytest.raises(IntegrityError, match="junction.weight .*sha256 expected") as error:
        store.read_tensors(KEY, "model.safetensors", ["junction.weight"])
    assert error.value.stage_key == KEY
    _flip(path, 20)  # inside the JSON header: the offsets themselves are not trusted
    with pytest.raises(IntegrityError, match="header"):
        store.read_tensors(KEY, "model.safetensors", ["junction.weight"])


def test_a_missing_tensor_is_named(tmp_path):
    store = RunStore(tmp_path / "run")
    store.commit(KEY, {"kind": "test"}, {"model.safetensors": save(_weights())})
    with pytest.raises(KeyError, match=r"no tensor\(s\) \['missing'\]"):
        store.read_tensors(KEY, "model.safetensors", ["missing"])


def test_blob_committed_without_an_index_is_read_whole_and_verified(tmp_path, counted):
    store = RunStore(tmp_path / "run")
    data = save(_weights())
    manifest = store.commit(KEY, {"kind": "test"}, {"model.safetensors": data})
    del manifest["blobs"]["model.safetensors"]["index"]  # a manifest written before per-tensor digests
    raw, dtype, shape = store.read_tensors(KEY, "model.safetensors", ["junction.weight"], manifest)["junction.weight"]
    assert (dtype, shape) == ("F32", [39, 32])
    assert np.array_equal(np.frombuffer(raw, np.float32).reshape(shape), load(data)["junction.weight"].numpy())
    assert counted == {"range": 0, "whole": len(data)}


def test_bridge_head_reads_only_the_junction(tmp_path, counted):
    store = RunStore(tmp_path / "run")
    weights = _weights()
    store.commit(KEY, {"kind": "test"}, {"model.safetensors": save(weights)})
    feature_store._HEADS.clear()
    head = feature_store.junction_head(store, JunctionRef(KEY, "model.safetensors", "junction.weight"))
    assert torch.equal(head, weights["junction.weight"])
    header = store.load_manifest(KEY)["blobs"]["model.safetensors"]["index"]["header_bytes"]
    assert counted == {"range": header + 39 * 32 * 4, "whole": 0}

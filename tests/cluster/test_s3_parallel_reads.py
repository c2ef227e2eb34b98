"""Published JPEG folders on ``s3://`` (a REAL SeaweedFS server) are read with many GETs in flight per process,
and give the same pixels as the local copy."""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from cluster.storage.s3 import configure_object_storage
from compat_core import io as cio
from compat_core.data import load_dataset
from compat_core.data.formats import _shared

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compat_core" / "data"))
import fixtures_published as fx  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture
def object_store(s3_env, s3_bucket, monkeypatch, tmp_path, fresh_object_storage):
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    configure_object_storage()  # undone after the test (fresh_object_storage)
    yield s3_bucket


def _celeba(tmp_path: Path, bucket: str, images: int = 24) -> tuple[str, Path]:
    rng = np.random.default_rng(0)
    rows = [(f"{n + 1:06d}.jpg", 100 + n % 6, 0, rng.integers(0, 256, (12, 10, 3), dtype=np.uint8))
            for n in range(images)]
    local = fx.write_celeba(tmp_path / "local", rows)
    uri = f"s3://{bucket}/datasets/celeba"
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        cio.write_bytes(cio.join(uri, path.relative_to(local).as_posix()), path.read_bytes())
    return uri, local


def test_a_batch_from_s3_has_many_gets_in_flight(object_store, tmp_path, monkeypatch):
    uri, local_root = _celeba(tmp_path, object_store)
    remote = load_dataset("celeba", root=uri, image_size=8, cache_size=0)
    local = load_dataset("celeba", root=str(local_root), image_size=8, cache_size=0)
    assert remote.fetch_threads == _shared.REMOTE_FETCHES_IN_FLIGHT and local.fetch_threads == 1

    # the first 4 GETs of the batch wait for each other: a reader with fewer than 4 in flight breaks the barrier
    together = threading.Barrier(4, timeout=20)
    lock, state = threading.Lock(), {"in_flight": 0, "peak": 0, "calls": 0}
    real_read = cio.read_bytes

    def read_bytes(location):
        with lock:
            state["in_flight"] += 1
            state["calls"] += 1
            state["peak"] = max(state["peak"], state["in_flight"])
            first = state["calls"] <= 4
        try:
            if first:
                together.wait()
            return real_read(location)
        finally:
            with lock:
                state["in_flight"] -= 1

    monkeypatch.setattr(cio, "read_bytes", read_bytes)
    order = np.array([5, 0, 23, 7, 7, 12, 3, 19, 1, 2, 4, 6, 8, 9, 10, 11])
    pixels = remote.read(order)
    assert state["calls"] == 15  # one GET per distinct image (7 twice)
    assert 4 <= state["peak"] <= _shared.REMOTE_FETCHES_IN_FLIGHT
    monkeypatch.setattr(cio, "read_bytes", real_read)
    np.testing.assert_array_equal(pixels, local.read(order))
    # the replay shard's encoded bytes come through the same pool, in memory order
    encoded = remote.encoded_images(order[:4])
    assert [bytes(b) for b in encoded.blobs] == [(local_root / "img_align_celeba" / f"{i + 1:06d}.jpg").read_bytes()
                                                 for i in order[:4]]

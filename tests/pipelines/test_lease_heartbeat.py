"""The one lease heartbeat (pipelines.store.lease._hold) of the local (fcntl) and the object-store lease: both beat
while the block runs, and both check the lease again after the block, so a holder that lost it meanwhile (another
driver took it over while this one was paused) raises LeaseLostError instead of finishing as if it still held it."""
from __future__ import annotations

import json
import os
import threading
import time
import uuid

import pytest

from pipelines.store import lease as leases
from pipelines.store.lease import LeaseLostError, PreconditionFailed, check_fence, run_lease


class MemoryObjects:
    """Conditional single-object reads and writes in memory, with S3's semantics (If-None-Match: * to create,
    If-Match: ETag to replace; HTTP 412 as PreconditionFailed)."""

    def __init__(self) -> None:
        self.objects: dict[str, tuple[bytes, str]] = {}
        self.lock = threading.Lock()

    def read(self, uri: str):
        with self.lock:
            return self.objects.get(uri)

    def etag(self, uri: str):
        with self.lock:
            found = self.objects.get(uri)
            return found[1] if found else None

    def write(self, uri: str, data: bytes, if_match: str | None = None, create: bool = False) -> str:
        with self.lock:
            current = self.objects.get(uri)
            if (create and current is not None) or (if_match is not None and (current is None
                                                                              or current[1] != if_match)):
                raise PreconditionFailed(uri)
            etag = uuid.uuid4().hex
            self.objects[uri] = (bytes(data), etag)
            return etag


def _wait_for(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.01)


def test_local_lease_beats_and_reports_a_takeover_after_its_block(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPAT_LEASE_HEARTBEAT_S", "0.05")
    lock_file = tmp_path / leases.LEASE_FILE
    with pytest.raises(LeaseLostError, match="lost its lease"):
        with run_lease(str(tmp_path)):
            first = json.loads(lock_file.read_text())["heartbeat"]
            _wait_for(lambda: json.loads(lock_file.read_text() or "{}").get("heartbeat", 0) > first, "a heartbeat")
            # another process found no heartbeat for the stale time and moved the lock file aside: taken over
            os.replace(lock_file, tmp_path / "moved-aside")
    assert not (tmp_path / leases.LEASE_FILE).exists()
    assert json.loads((tmp_path / "moved-aside").read_text())["heartbeat"] > 0  # a lost lease is not "released"
    with run_lease(str(tmp_path)):  # the folder can be taken again at once
        check_fence(str(tmp_path))


def test_local_lease_kept_to_the_end_is_released(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPAT_LEASE_HEARTBEAT_S", "0.05")
    with run_lease(str(tmp_path)):
        check_fence(str(tmp_path))
    assert json.loads((tmp_path / leases.LEASE_FILE).read_text())["heartbeat"] == 0.0


def test_object_lease_beats_and_reports_a_takeover_after_its_block(monkeypatch):
    monkeypatch.setenv("COMPAT_LEASE_HEARTBEAT_S", "0.05")
    objects = MemoryObjects()
    previous = leases.set_conditional_objects(objects)
    root = "s3://bucket/runs/r1"
    uri = f"{root}/{leases.LEASE_FILE}.json"
    try:
        with pytest.raises(LeaseLostError, match="lost its lease to another driver"):
            with run_lease(root):
                first = objects.etag(uri)
                _wait_for(lambda: objects.etag(uri) != first, "a heartbeat")
                # another driver took the stale lease over (its own conditional write over the last ETag)
                objects.write(uri, json.dumps({"token": "other", "heartbeat": time.time()}).encode(),
                              if_match=objects.etag(uri))
                time.sleep(0.02)  # no heartbeat noticed it yet, and no write happened: only the check after the block
        assert json.loads(objects.read(uri)[0])["token"] == "other"  # the successor's lease is left alone
    finally:
        leases.set_conditional_objects(previous)


def test_object_lease_kept_to_the_end_is_released():
    objects = MemoryObjects()
    previous = leases.set_conditional_objects(objects)
    try:
        with run_lease("s3://bucket/runs/r2"):
            check_fence("s3://bucket/runs/r2")
        assert json.loads(objects.read(f"s3://bucket/runs/r2/{leases.LEASE_FILE}.json")[0])["heartbeat"] == 0.0
    finally:
        leases.set_conditional_objects(previous)

"""A local shared-store claim whose holder process is paused (SIGSTOP): the waiting run says what it waits for, takes
the claim over once the holder's heartbeat is stale, and the resumed holder finds its claim lost."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HOLDER = """
import sys, time
from pipelines.store.lease import check_fence
from pipelines.store.shared_store import CLAIMS, SharedStore
shared = SharedStore(sys.argv[1])
assert shared.claim("pretrain-p1-0123456789abcdef")
print("claimed", flush=True)
root = shared.store.uri(CLAIMS, "pretrain-p1-0123456789abcdef")
while True:
    time.sleep(0.1)
    check_fence(root)
"""


def test_waiter_reports_and_takes_over_a_paused_holders_claim(tmp_path, monkeypatch, caplog):
    from pipelines.store.shared_store import SharedStore

    monkeypatch.setenv("COMPAT_LEASE_STALE_S", "2")
    monkeypatch.setenv("COMPAT_LEASE_HEARTBEAT_S", "0.3")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "shared")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "claimed"
        os.kill(holder.pid, signal.SIGSTOP)
        waiter = SharedStore(str(tmp_path / "shared"))
        with caplog.at_level(logging.WARNING, logger="pipelines.store.shared_store"):
            assert not waiter.claim("pretrain-p1-0123456789abcdef")  # its heartbeat is fresh: wait
        assert f"waiting for stage pretrain-p1-0123456789abcdef" in caplog.text and f"pid {holder.pid}" in caplog.text
        assert "last heartbeat" in caplog.text and "adopts that model once it is published" in caplog.text
        assert "--output" not in caplog.text  # the run folder's advice does not apply to a claim it waits for
        deadline = time.monotonic() + 30
        while not waiter.claim("pretrain-p1-0123456789abcdef"):  # taken over once no heartbeat for 2 s
            assert time.monotonic() < deadline, "a paused holder's claim was never taken over"
            time.sleep(0.5)
        os.kill(holder.pid, signal.SIGCONT)
        _, err = holder.communicate(timeout=30)
        assert holder.returncode != 0 and "LeaseLostError" in err and "lost its lease" in err
        waiter.close()
    finally:
        if holder.poll() is None:
            os.kill(holder.pid, signal.SIGCONT)
            holder.kill()
            holder.wait(timeout=30)

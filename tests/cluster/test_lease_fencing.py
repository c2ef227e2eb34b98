"""The S3 run-folder lease is fenced by conditional writes on the real SeaweedFS server: a holder process paused
(SIGSTOP) past the stale time and resumed (SIGCONT) can neither commit, heartbeat over nor release the lease of the
driver that took over meanwhile."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HOLDER = """
import sys, time
from cluster.storage.s3 import configure_object_storage
from pipelines.store.lease import run_lease
from pipelines.store.run_store import RunStore
configure_object_storage()
root, name = sys.argv[1], sys.argv[2]
with run_lease(root):
    store = RunStore(root)
    for i in range(int(sys.argv[3])):
        store.commit(f"stage-{name}-{i:03d}", {"writer": name, "i": i})
        print("committed", name, i, flush=True)
        time.sleep(0.2)
print("done", name, flush=True)
"""


def _start(root: str, name: str, count: int, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HOLDER, root, name, str(count)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for_line(process: subprocess.Popen, text: str, timeout: float = 60) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout
    for line in process.stdout:
        lines.append(line)
        if text in line:
            return lines
        assert time.monotonic() < deadline, f"no {text!r} in time"
    raise AssertionError(f"process ended before {text!r}: {process.wait()} {process.stderr.read()[-2000:]}")


def test_paused_holder_is_fenced_out_after_a_takeover(s3_env, s3_bucket):
    from cluster.storage.s3 import object_storage
    from compat_core import io as cio

    root = f"s3://{s3_bucket}/runs/fenced"
    env = {**os.environ, **s3_env, "PYTHONPATH": str(ROOT), "COMPAT_LEASE_STALE_S": "3",
           "COMPAT_LEASE_HEARTBEAT_S": "0.5", "PYTHONUNBUFFERED": "1"}
    first = _start(root, "a", 1000, env)
    second = None
    try:
        _wait_for_line(first, "committed a 2")
        os.kill(first.pid, signal.SIGSTOP)  # paused mid-run: no heartbeat, no writes
        time.sleep(5)  # past the stale time
        second = _start(root, "b", 40, env)  # takes the stale lease over
        _wait_for_line(second, "committed b 3")
        with object_storage():
            lease = json.loads(cio.read_bytes(f"{root}/.compat-lease.json"))
            a_commits = [k for k in cio.list_dir(f"{root}/manifests") if k.startswith("stage-a-")]
        os.kill(first.pid, signal.SIGCONT)  # wakes up: its next commit, heartbeat and release are refused
        out, err = first.communicate(timeout=60)
        assert first.returncode != 0 and "LeaseLostError" in err and "lost its lease" in err, err[-2000:]
        # Lines of commits made before the pause may still sit unread in the pipe (a busy machine delays the
        # SIGSTOP past "committed a 2"); every commit the output reports must already have been in storage then.
        printed = {f"stage-a-{int(line.split()[2]):03d}" for line in out.splitlines() if line.startswith("committed a")}
        assert printed <= {key.split(".")[0] for key in a_commits}, (sorted(printed), a_commits)
        with object_storage():
            assert [k for k in cio.list_dir(f"{root}/manifests") if k.startswith("stage-a-")] == a_commits
            now = json.loads(cio.read_bytes(f"{root}/.compat-lease.json"))
        assert now["token"] == lease["token"] and now["heartbeat"] > 0  # B still holds it: A released nothing
        out, err = second.communicate(timeout=120)
        assert second.returncode == 0 and "done b" in out, err[-2000:]
        with object_storage():
            released = json.loads(cio.read_bytes(f"{root}/.compat-lease.json"))
        assert released["token"] == lease["token"] and released["heartbeat"] == 0.0  # B released its own lease
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
                process.kill()
                process.wait(timeout=30)

"""The embedded Ray instance of `compat run --executor ray` listens on loopback addresses only: every TCP/UDP
socket of the driver and of every process it spawned (GCS, raylet, agents, workers, metrics exporters) is listed
with `ss` and checked."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = r"""
import json, os, re, subprocess, time
from cluster.ray.task_backend import connect
connect(num_cpus=1)
import ray

@ray.remote
def work():
    return 1

assert ray.get(work.remote()) == 1
time.sleep(2)  # agents and exporters open their ports shortly after start


def descendants(root):
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
                parents[int(entry)] = int(fields[1])
            except (OSError, IndexError):
                pass
    found, frontier = {root}, [root]
    while frontier:
        current = frontier.pop()
        for pid, parent in parents.items():
            if parent == current and pid not in found:
                found.add(pid)
                frontier.append(pid)
    return found


pids = descendants(os.getpid())
listening = []
for line in subprocess.run(["ss", "-ltunpH"], capture_output=True, text=True).stdout.splitlines():
    owners = [int(re.match(r"\d+", part).group()) for part in line.split("pid=")[1:]]
    if any(p in pids for p in owners):
        listening.append(line.split()[4])
print(json.dumps({"pids": len(pids), "listening": listening}))
ray.shutdown()
"""


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    return host.startswith("127.") or host in ("::1", "localhost") or host.startswith("::ffff:127.")


def test_embedded_ray_listens_on_loopback_only():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # the product must set what it needs itself
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["pids"] >= 4 and len(report["listening"]) >= 4  # GCS, raylet, agents, a worker at least
    outside = [address for address in report["listening"] if not _is_loopback(address)]
    assert not outside, f"Ray sockets listening beyond loopback: {outside}"

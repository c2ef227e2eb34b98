"""Ray workers commit only under the run folder's fence: the driver holds the lease of a local run folder and runs
the tiny scenario on the session's real Ray; while a worker is about to commit a fine-tuning stage, a second driver
(a real process) takes the lease over (the first one's heartbeat stopped, as a paused driver's does). The worker's
commit is refused with LeaseLostError naming the run folder, and every stage committed before stays intact."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))
import tiny_scenario_helpers as tiny  # noqa: E402

from pipelines.config.load import validate_config  # noqa: E402
from pipelines.graph.compile import compile_scenario  # noqa: E402
from pipelines.store.lease import LEASE_FILE, LeaseLostError, hold_fence, lease_fence, run_lease  # noqa: E402
from pipelines.store.run_store import RunStore  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

TAKER = """
import contextlib, os, sys, time
from pipelines.store.lease import RunFolderBusyError, run_lease
root, reached, taken, release = sys.argv[1:5]
deadline = time.monotonic() + 300
while not os.path.exists(reached):
    if time.monotonic() > deadline:
        sys.exit("the worker never reached the commit")
    time.sleep(0.1)
with contextlib.ExitStack() as held:
    # warm workers can reach the commit before the first driver's heartbeat is stale: a second driver waits it out,
    # then takes the lease over
    while True:
        try:
            held.enter_context(run_lease(root))
            break
        except RunFolderBusyError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    committed = sorted(n[:-5] for n in os.listdir(os.path.join(root, "manifests")) if n.endswith(".json")
                       and not n.startswith("."))
    with open(taken + ".tmp", "w") as handle:
        handle.write("\\n".join(committed))
    os.replace(taken + ".tmp", taken)
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.1)
print("released", flush=True)
"""


def _hold_commit_setup(root: str, stage_key: str, reached: str, taken: str):
    """Worker setup: the commit of ``stage_key`` into ``root`` announces itself (``reached``) and waits until the
    lease has been taken over (``taken``) before it writes anything."""
    def setup():
        import os as _os
        import time as _time

        import pipelines.store.run_store as store_module

        tiny.register()
        original = store_module.RunStore.commit
        if getattr(original, "_holding", False):
            return

        def commit(self, key, *args, **kwargs):
            if key == stage_key and str(self.root) == root:
                open(reached, "w").close()
                deadline = _time.monotonic() + 300
                while not _os.path.exists(taken) and _time.monotonic() < deadline:
                    _time.sleep(0.1)
            return original(self, key, *args, **kwargs)

        commit._holding = True
        store_module.RunStore.commit = commit
    return setup


def test_a_worker_whose_driver_lost_the_lease_commits_nothing(ray_local, tmp_path, monkeypatch):
    import ray

    from cluster.ray.task_backend import NodeFailed, RayExecutor

    tiny.register()
    ray.cloudpickle.register_pickle_by_value(tiny)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    torch.set_num_threads(1)
    root = tmp_path / "run"
    graph = compile_scenario(validate_config(tiny.scenario("dsimplex-hoc", output=str(root))))
    target = next(stage for stage in graph if stage.kind == "finetune" and stage.task == 1)
    reached, taken, release = (str(tmp_path / name) for name in ("reached", "taken", "release"))
    monkeypatch.setenv("COMPAT_LEASE_HEARTBEAT_S", "3600")  # this driver never renews its lease, as if paused
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COMPAT_LEASE_STALE_S": "1", "PYTHONUNBUFFERED": "1"}
    taker = subprocess.Popen([sys.executable, "-c", TAKER, str(root), reached, taken, release], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        executor = RayExecutor(progress=False, max_retries=0,
                               setup=_hold_commit_setup(str(root), target.key, reached, taken))
        with pytest.raises(NodeFailed) as caught:
            with run_lease(str(root)):
                executor.run(graph, RunStore(root))
        message = str(caught.value)
        assert "LeaseLostError" in message and f"run folder {root}:" in message, message[-3000:]
        assert "no longer holds the run folder's lease" in message and "commits nothing" in message
        store = RunStore(root)
        assert not store.has(target.key)
        assert store.list_files(f"{RunStore.ARTIFACTS}/{target.key}") == []  # not one blob of it either
        before = Path(taken).read_text().split()
        assert before and set(before) <= set(store.stage_keys())  # nothing committed before the takeover is lost
        for key in store.stage_keys():  # and every committed stage still reads back, verified
            manifest = store.load_manifest(key)
            for name in manifest["blobs"]:
                store.read_blob(key, name, manifest)
        holder = json.loads((root / LEASE_FILE).read_text())
        assert holder["pid"] == taker.pid  # the new driver's lease is untouched
        Path(release).touch()
        out, err = taker.communicate(timeout=60)
        assert taker.returncode == 0 and "released" in out, err[-2000:]
    finally:
        if taker.poll() is None:
            taker.kill()
            taker.wait(timeout=30)


S3_TAKER = """
import sys, time
from cluster.storage.s3 import configure_object_storage
from pipelines.store.lease import run_lease
configure_object_storage()
time.sleep(1)  # past the stale time of the first driver's lease
with run_lease(sys.argv[1]):
    print("taken", flush=True)
"""


def test_the_fence_of_an_s3_lease_refuses_writes_once_another_driver_took_it(s3_env, s3_bucket, monkeypatch):
    """The fence a driver hands its workers on an ``s3://`` run folder (the lease object's owner token), checked
    through the real SeaweedFS server: writes pass while the driver holds the lease and are refused, naming the run
    folder, once another driver has taken it over."""
    import pickle

    from cluster.storage.s3 import object_storage
    root = f"s3://{s3_bucket}/runs/fenced-workers"
    monkeypatch.setenv("COMPAT_LEASE_HEARTBEAT_S", "3600")  # this driver never renews its lease, as if paused
    env = {**os.environ, **s3_env, "PYTHONPATH": str(ROOT), "COMPAT_LEASE_STALE_S": "0.5"}
    with object_storage(), pytest.raises(LeaseLostError, match="lost its lease"):  # the driver learns it too
        with run_lease(root):
            fence = pickle.loads(pickle.dumps(lease_fence(root)))  # it travels to the workers pickled
            store = RunStore(root)
            with hold_fence(root, fence):
                store.commit("before", {"i": 0})
            taker = subprocess.run([sys.executable, "-c", S3_TAKER, root], env=env, capture_output=True, text=True,
                                   timeout=120)
            assert taker.returncode == 0 and "taken" in taker.stdout, taker.stderr[-2000:]
            with pytest.raises(LeaseLostError, match=f"run folder {root}: .*no longer holds.*commits nothing"):
                with hold_fence(root, fence):
                    store.commit("after", {"i": 1})
            with pytest.raises(LeaseLostError, match="commits nothing"):  # a new task is refused before any work
                with hold_fence(root, fence):
                    pass
            assert store.has("before") and not store.has("after")


def test_the_fence_of_a_local_lease_fails_once_released_and_once_another_driver_holds_it(tmp_path):
    """A worker that outlives its driver: the lock file keeps its inode across a normal release and a new
    acquisition, so the fence also checks the owner token and the released marker the holder writes into it."""
    from pipelines.store.lease import LeaseLostError, hold_fence, lease_fence

    root = str(tmp_path / "run")
    with run_lease(root):
        fence = lease_fence(root)
        assert fence is not None and fence.held()
        owner = json.loads(Path(root, LEASE_FILE).read_text())
        assert owner["token"] == fence.token and owner["heartbeat"] > 0
    assert json.loads(Path(root, LEASE_FILE).read_text())["heartbeat"] == 0.0  # released
    assert not fence.held()
    with run_lease(root):  # a second driver: same lock file (same inode), its own token
        assert os.stat(Path(root, LEASE_FILE)).st_ino == fence.inode
        assert not fence.held()
        with pytest.raises(LeaseLostError, match=f"run folder {root}"):
            with hold_fence(root, fence):
                pass
        assert lease_fence(root).held()

"""`compat index build --shards 3` and `compat serve` of that sharded index as a process (real Ray Serve, a real
MLflow registry, HTTP on 127.0.0.1): every socket of the command's processes is on loopback, and an alias swap
under load reaches every shard with no failed request, no answer mixing model versions and every answer equal to
fp64 brute force over the whole gallery."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
import ray  # noqa: F401 - Ray ships psutil: importing ray first puts it on the path
import psutil  # noqa: I001
import serving_helpers as helpers
from local_services import free_port
from user_shell import PYTHON, user_env

from app.cli import main

pytestmark = pytest.mark.integration
NAME = "serve-shards-cli-test"
LOOPBACK_ADDRESSES = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


def _listening(processes: list) -> dict:
    sockets = {}
    for process in processes:
        try:
            for connection in process.net_connections(kind="inet"):
                if connection.status == psutil.CONN_LISTEN:
                    sockets[(connection.laddr.ip, connection.laddr.port)] = process.name()
        except psutil.NoSuchProcess:
            continue
    return sockets


def test_a_sharded_index_served_by_the_command_follows_an_alias_swap_under_load(mlflow_server, tmp_path, capsys):
    from mlflow import MlflowClient

    from cluster.serving.index_store import load_index
    from cluster.serving.shards import part_root, read_shard_set

    client = MlflowClient(mlflow_server.tracking_uri)
    v1 = helpers.register_random_model(client, NAME, 0, tmp_path)
    v2 = helpers.register_random_model(client, NAME, 0, tmp_path, rotation_seed=5)
    client.set_registered_model_alias(NAME, "champion", v1)
    config, root = helpers.write_config(tmp_path), str(tmp_path / "index")
    tracking = ["--tracking-uri", mlflow_server.tracking_uri]
    assert main(["index", "build", root, "--config", str(config), "--model", f"models:/{NAME}@champion",
                 "--shards", "3", "--kind", "hnsw", "--sample", "30"] + tracking) == 0
    capsys.readouterr()
    assert main(["index", "show", root]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [(p["offset"], p["rows"]) for p in shown["parts"]] == [(0, 10), (10, 10), (20, 10)]
    _, document = read_shard_set(root)
    gallery = np.vstack([load_index(part_root(root, part)).embeddings for part in document["parts"]])

    port, log = free_port(), tmp_path / "serve.log"
    home = tmp_path / "home"
    home.mkdir()
    env = user_env(home, MLFLOW_TRACKING_URI=mlflow_server.tracking_uri, XDG_CACHE_HOME=str(tmp_path / "cache"))
    with log.open("w") as handle:
        process = subprocess.Popen([PYTHON, "-m", "app.cli", "serve", root, "--model", f"models:/{NAME}@champion",
                                    "--port", str(port), "--num-cpus", "0", "--poll-s", "0.3"], env=env,
                                   stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while "serving " not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        status, health = helpers.call(url, "/healthz")
        assert status == 200 and health["model_version"] == v1 and len(health["shards"]) == 3, health
        assert all(shard["search"]["kind"] == "hnsw" for shard in health["shards"])
        tree = [psutil.Process(process.pid)] + psutil.Process(process.pid).children(recursive=True)
        listening = _listening(tree)
        assert ("127.0.0.1", port) in listening
        assert sum("ServeReplica" in name for name in listening.values()) >= 4, listening   # 3 shards + router
        exposed = {address: name for address, name in listening.items() if address[0] not in LOOPBACK_ADDRESSES}
        assert not exposed, f"listening beyond loopback: {exposed}"

        rng = np.random.default_rng(0)
        queries = rng.standard_normal((20, gallery.shape[1])).astype(np.float32)
        expected = [helpers.brute_rows(q, gallery, 5) for q in queries]
        outcomes, stop = [], threading.Event()

        def load(worker: int) -> None:
            number = worker
            while not stop.is_set():
                i = number % len(queries)
                status, answer = helpers.call(url, "/search", {"embedding": queries[i].tolist(), "k": 5}, timeout=120)
                versions = {r["item_version"] for r in answer.get("results", [])} if status == 200 else set()
                outcomes.append((status, answer.get("model_version") if status == 200 else answer,
                                 status == 200 and [r["position"] for r in answer["results"]] == expected[i]
                                 and versions == {v1}))
                number += 2

        threads = [threading.Thread(target=load, args=(w,)) for w in range(2)]
        for thread in threads:
            thread.start()
        try:
            time.sleep(2.0)
            client.set_registered_model_alias(NAME, "champion", v2)
            deadline = time.monotonic() + 120
            while not any(version == v2 for _, version, _ in outcomes[-5:]):
                assert time.monotonic() < deadline, f"no answer by {v2} within 120 s: {outcomes[-3:]}"
                time.sleep(0.3)
            time.sleep(2.0)
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=180)
        failed = [(status, body) for status, body, _ in outcomes if status != 200]
        assert not failed, failed[:3]
        assert all(right for _, _, right in outcomes), [o for o in outcomes if not o[2]][:3]
        versions = [version for _, version, _ in outcomes]
        assert set(versions) == {v1, v2} and versions.index(v2) > 0
        status, health = helpers.call(url, "/healthz")
        assert health["model_version"] == v2 and {s["model_version"] for s in health["shards"]} == {v2}

        os.kill(process.pid, signal.SIGTERM)
        assert process.wait(timeout=180) == 128 + signal.SIGTERM, log.read_text()[-3000:]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)

"""The search service run the way a user runs it, every command its own process: `compat cluster up` (a Ray head
with token authentication; the token generated into ~/.ray/auth_token of the test's HOME), `compat serve` joining
it, the alias moved, then `compat index backfill` from "another shell" re-embedding the gallery on that head while
the service answers. Real MLflow server, real Ray, HTTP on 127.0.0.1; no mocks."""
from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import serving_helpers as helpers
import torch
from local_services import free_port
from user_shell import PYTHON, glyph_scenario, user_env
from user_shell import compat as run_compat

pytestmark = pytest.mark.integration
NAME = "serve-processes-test"
GLYPHS = glyph_scenario("serve-glyphs", num_slots=10, feature_dtype="float32")


def _shell(home: Path, cache: Path, tracking: str, **extra: str) -> dict:
    """A user's shell with its own caches and the test's MLflow server."""
    return user_env(home, XDG_CACHE_HOME=str(cache), MLFLOW_TRACKING_URI=tracking, **extra)


compat = functools.partial(run_compat, timeout=400)


def _wait_healthz(url: str, process: subprocess.Popen, log: Path, until, timeout_s: float = 300) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, f"compat serve exited {process.returncode}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"not {until.__doc__} after {timeout_s} s:\n{log.read_text()[-3000:]}"
        try:
            status, health = helpers.call(url, "/healthz", timeout=10)
        except OSError:
            status, health = None, None
        if status == 200 and until(health):
            return health
        time.sleep(0.5)


def test_serve_and_backfill_from_separate_shells_on_a_token_head(mlflow_server, tmp_path):
    from mlflow import MlflowClient

    from cluster.ray.local_head import read_state
    from cluster.serving.index_store import load_index
    from compat_core.data.glyphs.dataset import default_cache_dir

    client = MlflowClient(mlflow_server.tracking_uri)
    v1, v2 = (helpers.register_random_model(client, NAME, seed, tmp_path) for seed in (0, 1))
    client.set_registered_model_alias(NAME, "champion", v1)
    home, cache = tmp_path / "home", tmp_path / "cache"
    home.mkdir()
    (cache / "compat").mkdir(parents=True)
    default_cache_dir().mkdir(parents=True, exist_ok=True)
    (cache / "compat" / "glyphs").symlink_to(default_cache_dir())  # the rendered glyphs, shared with other tests
    config = tmp_path / "glyphs.yaml"
    config.write_text(GLYPHS)
    root = str(tmp_path / "index")
    shell = _shell(home, cache, mlflow_server.tracking_uri)
    built = compat("index", "build", root, "--config", str(config), "--model", f"models:/{NAME}@champion",
                   "--shard-rows", "32", env=shell)
    assert built.returncode == 0, built.stderr[-3000:]
    serve_log = tmp_path / "serve.log"
    serving = None
    try:
        up = compat("cluster", "up", "--num-cpus", "2", "--object-store-memory", "200000000", env=shell, timeout=600)
        assert up.returncode == 0, up.stdout + up.stderr
        head = read_state("local", cache / "compat" / "cluster")
        assert head.auth == "token" and (home / ".ray" / "auth_token").is_file()
        token = (home / ".ray" / "auth_token").read_text().strip()
        # shell 1: the job server address `compat cluster up` suggests exporting
        port = free_port()
        with serve_log.open("w") as log:
            serving = subprocess.Popen(
                [PYTHON, "-m", "app.cli", "serve", root, "--model", f"models:/{NAME}@champion", "--port", str(port),
                 "--num-cpus", "0", "--poll-s", "0.5"], env=dict(shell, RAY_ADDRESS=head.address), stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        health = _wait_healthz(url, serving, serve_log, lambda h: h["model_version"] == v1)
        assert health["items_by_version"] == {v1: 97}
        while "Ray cluster" not in serve_log.read_text():
            assert serving.poll() is None, serve_log.read_text()[-3000:]
            time.sleep(0.2)
        assert f"Ray cluster {head.gcs_address}" in serve_log.read_text()  # the service runs on the head
        # the head `compat cluster up` started has Serve's proxy refuse a body over the default 4 MiB unread
        status, answer = helpers.refused_before_the_body(url, 1 << 30)
        assert status == 413 and "refused by the HTTP proxy before the body was read" in answer["error"]["message"]

        client.set_registered_model_alias(NAME, "champion", v2)  # what `compat gate` does on a promotion
        _wait_healthz(url, serving, serve_log, lambda h: h["model_version"] == v2)

        # shell 2, without the token: refused before any work, saying how to fix it
        refused = compat("index", "backfill", root, "--config", str(config), "--model", f"models:/{NAME}@champion",
                         "--ray-address", head.address, env=_shell(tmp_path / "empty-home", cache,
                                                                   mlflow_server.tracking_uri))
        assert refused.returncode != 0
        assert "requires token authentication" in refused.stderr and "--ray-token-file" in refused.stderr
        assert load_index(root).manifest_sha == health["index_manifest"]  # nothing written

        # shell 2 as the user runs it: the GCS address `compat serve` printed, the token in ~/.ray/auth_token
        backfill = compat("index", "backfill", root, "--config", str(config), "--model",
                          f"models:/{NAME}@champion", "--chunk-rows", "40", "--ray-address", head.gcs_address,
                          env=shell)
        assert backfill.returncode == 0, backfill.stdout[-3000:] + backfill.stderr[-3000:]
        summary = json.loads(backfill.stdout[backfill.stdout.index("{\n"):])
        assert summary["done"] and summary["chunks"] == 3 and summary["fraction"][-1] == 1.0  # 97 rows, 40 a chunk
        health = _wait_healthz(url, serving, serve_log, lambda h: h["items_by_version"] == {v2: 97})
        # answers from the backfilled index: scores equal the fp64 cosine with the stored v2 rows
        index = load_index(root)
        assert health["index_manifest"] == index.manifest_sha == summary["manifest"]
        gallery = index.embeddings.astype(np.float64)
        gallery /= np.linalg.norm(gallery, axis=1, keepdims=True)
        for row in (0, 50, 96):
            status, answer = helpers.call(url, "/search", {"embedding": index.embeddings[row].tolist(), "k": 3})
            assert status == 200, answer
            scores = gallery @ gallery[row]
            expected = np.argsort(-scores, kind="stable")[:3]
            assert [r["position"] for r in answer["results"]] == expected.tolist()
            np.testing.assert_allclose([r["score"] for r in answer["results"]], scores[expected], atol=1e-6)
            assert {r["item_version"] for r in answer["results"]} == {v2}
        assert f"on Ray cluster {head.gcs_address}" in backfill.stdout  # the chunks ran on the head
        # the probe scores the evaluation's protocol (coarse labels here): at 100 % it is the self-test M(v2, v2)
        from cluster.model_registry.versions import MlflowModelResolver
        from cluster.serving.models import load_served_model
        from pipelines.config.model_uri import ModelUri
        from pipelines.config.load import load_config
        from pipelines.stages.entry_metrics import compute_entry
        from pipelines.stages.extraction import extract_pool_features
        from pipelines.stages.pools import load_pool

        scenario = load_config(str(config))
        query_pool, gallery_pool = (load_pool(scenario.evaluation.query_set),
                                    load_pool(scenario.evaluation.gallery_set))
        assert index.labels.tolist() == np.asarray(gallery_pool.coarse_labels).tolist()
        model = load_served_model(MlflowModelResolver(mlflow_server.tracking_uri, cache_dir=str(tmp_path / "models")),
                                  ModelUri(NAME, v2))
        queries = extract_pool_features(model, query_pool, scenario, torch.device("cpu"))
        protocol = {"metric": "recall_at_1", "gallery": "instances", "label_level": "coarse"}
        self_test = compute_entry((queries, query_pool.labels, query_pool.coarse_labels),
                                  (index.embeddings, gallery_pool.labels, gallery_pool.coarse_labels), protocol,
                                  scenario)
        assert summary["probe_recall_at_1"][-1] == pytest.approx(self_test, abs=1e-12)
        outputs = up.stdout + up.stderr + backfill.stdout + backfill.stderr + refused.stderr + serve_log.read_text()
        assert token not in outputs
        assert re.search(r"backfill: 100\.0% embedded by v" + v2, backfill.stdout)

        # Ctrl-C: on a cluster it joined, `compat serve` removes its application and leaves the head running
        os.killpg(serving.pid, signal.SIGINT)
        assert serving.wait(120) == 130, serve_log.read_text()[-3000:]
        try:
            status = helpers.call(url, "/healthz", timeout=10)[0]
        except OSError:
            status = None
        assert status != 200
        os.kill(head.pid, 0)   # the head is still there (ProcessLookupError otherwise)
        assert compat("cluster", "status", env=shell).returncode == 0
    finally:
        if serving is not None and serving.poll() is None:
            os.killpg(serving.pid, signal.SIGINT)  # Ctrl-C: `compat serve` shuts Serve down and exits
            try:
                serving.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(serving.pid, signal.SIGKILL)
        down = compat("cluster", "down", env=shell)
        assert down.returncode == 0, down.stderr

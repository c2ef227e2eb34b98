"""`compat index build` + `compat serve` against a real Serve instance over HTTP on 127.0.0.1, a real MLflow
registry and randomly initialised registered models (no mocks): answers equal the fp64 brute force and the
evaluation's Recall@1, bad requests are 4xx naming the field, a gate move is swapped in under load."""
from __future__ import annotations

import base64
import re
import time

import numpy as np
import pytest
import serving_helpers as helpers
import torch
from local_services import free_port

from app.cli import main

pytestmark = pytest.mark.integration
NAME = "serve-test"


@pytest.fixture(scope="module")
def service(mlflow_server, ray_local, tmp_path_factory):
    """Two versions registered (@champion = the first), the tiny gallery indexed by it, Serve with 2 replicas."""
    from mlflow import MlflowClient
    from ray import serve

    from cluster.serving.app import start

    folder = tmp_path_factory.mktemp("serve")
    client = MlflowClient(mlflow_server.tracking_uri)
    versions = [helpers.register_random_model(client, NAME, seed, folder) for seed in (0, 1)]
    client.set_registered_model_alias(NAME, "champion", versions[0])
    config = helpers.write_config(folder)
    root = str(folder / "index")
    assert main(["index", "build", root, "--config", str(config), "--model", f"models:/{NAME}@champion",
                 "--shard-rows", "8", "--tracking-uri", mlflow_server.tracking_uri]) == 0
    settings = {"index": root, "model": f"models:/{NAME}@champion", "tracking_uri": mlflow_server.tracking_uri,
                "poll_s": 0.3, "precision": "auto", "cache_dir": str(folder / "cache"),
                "limits": {"max_k": 20, "max_body_bytes": 64 << 10}}
    url = start(settings, "127.0.0.1", free_port(), num_replicas=2, num_cpus=0, max_ongoing_requests=8)
    # both replicas loaded, not just the first to answer (on a busy machine the second one was still "loading",
    # 503, when the first test asked)
    loaded, deadline = set(), time.monotonic() + 120
    while len(loaded) < 2 and time.monotonic() < deadline:
        status, health = helpers.call(url, "/healthz")
        if status == 200:
            loaded.add(health["replica"])
        else:
            time.sleep(0.2)
    assert len(loaded) == 2, f"{len(loaded)} of 2 replicas loaded within 120 s"
    yield {"url": url, "client": client, "versions": versions, "config": config, "root": root, "folder": folder,
           "tracking": mlflow_server.tracking_uri}
    serve.shutdown()


def _features(service, version: str, pool: str) -> np.ndarray:
    from cluster.model_registry.versions import MlflowModelResolver
    from cluster.serving.models import load_served_model
    from pipelines.config.model_uri import ModelUri
    from pipelines.config.load import load_config
    from pipelines.stages.extraction import extract_pool_features
    from pipelines.stages.pools import load_pool

    config = load_config(str(service["config"]))
    spec = config.evaluation.query_set if pool == "query" else config.evaluation.gallery_set
    resolver = MlflowModelResolver(service["tracking"], cache_dir=str(service["folder"] / "cache"))
    model = load_served_model(resolver, ModelUri(NAME, version))
    return extract_pool_features(model, load_pool(spec), config, torch.device("cpu"))


def _brute(query: np.ndarray, gallery: np.ndarray, k: int):
    q = query.astype(np.float64) / np.linalg.norm(query.astype(np.float64))
    g = gallery.astype(np.float64) / np.linalg.norm(gallery.astype(np.float64), axis=1, keepdims=True)
    scores = np.einsum("d,gd->g", q, g, optimize=False)
    order = np.argsort(-scores, kind="stable")[:k]
    return order, scores[order]


def test_healthz_metrics_and_search_by_embedding_equal_brute_force(service):
    status, health = helpers.call(service["url"], "/healthz")
    assert status == 200 and health["model_version"] == service["versions"][0]
    assert health["items"] == 30 and health["items_by_version"] == {service["versions"][0]: 30}
    gallery = _features(service, service["versions"][0], "gallery")
    queries = _features(service, service["versions"][0], "query")
    for row in (0, 7, 19):
        status, answer = helpers.call(service["url"], "/search", {"embedding": queries[row].tolist(), "k": 5})
        assert status == 200, answer
        order, scores = _brute(queries[row], gallery, 5)
        assert [r["position"] for r in answer["results"]] == order.tolist()
        np.testing.assert_allclose([r["score"] for r in answer["results"]], scores, rtol=0, atol=1e-6)
        assert {r["item_version"] for r in answer["results"]} == {service["versions"][0]}
    status, text = helpers.call(service["url"], "/metrics")
    assert status == 200 and "compat_search_requests_total" in text
    assert f'version="{service["versions"][0]}"' in text and "compat_search_latency_seconds_bucket" in text


def test_recall_at_1_equals_the_evaluation(service):
    """The service's top-1 labels over the query pool (images sent as PNG) give the evaluation's Recall@1."""
    from cluster.serving.index_store import load_index
    from pipelines.config.load import load_config
    from pipelines.stages.entry_metrics import compute_entry
    from pipelines.stages.pools import load_pool

    config = load_config(str(service["config"]))
    query_pool, gallery_pool = load_pool(config.evaluation.query_set), load_pool(config.evaluation.gallery_set)
    version = service["versions"][0]
    q, g = _features(service, version, "query"), _features(service, version, "gallery")
    protocol = {"metric": "recall_at_1", "gallery": "instances", "label_level": "fine"}
    expected = compute_entry((q, query_pool.labels, None), (g, gallery_pool.labels, None), protocol, config)
    labels = load_index(service["root"]).labels
    hits_embedding, hits_image = [], []
    images = query_pool.read(np.arange(len(query_pool)))
    for row in range(len(query_pool)):
        _, by_embedding = helpers.call(service["url"], "/search", {"embedding": q[row].tolist(), "k": 1})
        _, by_image = helpers.call(service["url"], "/search", {"image": helpers.png_base64(images[row]), "k": 1})
        hits_embedding.append(labels[by_embedding["results"][0]["position"]] == query_pool.labels[row])
        hits_image.append(labels[by_image["results"][0]["position"]] == query_pool.labels[row])
    assert np.mean(hits_embedding) == expected
    assert np.mean(hits_image) == expected


def _tiny_png(width: int, height: int, mode: str = "L") -> str:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new(mode, (width, height)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


BAD_REQUESTS = [  # (what, body or raw bytes, content type, expected status, field named)
    ("wrong embedding width", {"embedding": [0.1] * 8}, None, 400, "embedding"),
    ("embedding not a list", {"embedding": "0.1,0.2"}, None, 400, "embedding"),
    ("embedding item not a number", {"embedding": [0.1] * 8 + ["x"]}, None, 400, "embedding"),
    ("embedding all zeros", {"embedding": [0.0] * 9}, None, 400, "embedding"),
    ("embedding NaN", b'{"embedding": [NaN, 1, 1, 1, 1, 1, 1, 1, 1]}', None, 400, "body"),
    ("k out of range", {"embedding": [0.1] * 9, "k": 0}, None, 400, "k"),
    ("k above the gallery size", {"embedding": [0.1] * 9, "k": 21}, None, 400, "k"),
    ("k not an integer", {"embedding": [0.1] * 9, "k": "5"}, None, 400, "k"),
    ("k a boolean", {"embedding": [0.1] * 9, "k": True}, None, 400, "k"),
    ("missing query", {"k": 3}, None, 400, "embedding"),
    ("both queries", {"embedding": [0.1] * 9, "image": _tiny_png(16, 16)}, None, 400, "image"),
    ("unknown field", {"embedding": [0.1] * 9, "top": 3}, None, 400, "top"),
    ("unknown version", {"embedding": [0.1] * 9, "model_version": "999"}, None, 400, "model_version"),
    ("model_version wrong type", {"embedding": [0.1] * 9, "model_version": [1]}, None, 400, "model_version"),
    ("include_payload wrong type", {"embedding": [0.1] * 9, "include_payload": "yes"}, None, 400, "include_payload"),
    ("image not base64", {"image": "***"}, None, 400, "image"),
    ("image not a string", {"image": 12}, None, 400, "image"),
    ("undecodable image", {"image": base64.b64encode(b"GIF89a not an image").decode()}, None, 415, "image"),
    ("truncated PNG", {"image": _tiny_png(16, 16)[:60]}, None, 400, "image"),
    ("image too many pixels", {"image": _tiny_png(4100, 4100)}, None, 413, "image"),
    ("not JSON", b"embedding=1", None, 400, "body"),
    ("JSON not an object", b"[1, 2]", None, 400, "body"),
    ("empty body", b"", None, 400, "body"),
    ("wrong content type", b"{}", "text/plain", 415, "content-type"),
    ("body too large", {"embedding": [0.1] * 9, "pad": "x" * (70 << 10)}, None, 413, "body"),
    ("400-digit integer", b'{"embedding": [' + b"7" * 400 + b', 1, 1, 1, 1, 1, 1, 1, 1]}', None, 400, "embedding"),
    ("5000-digit integer", b'{"embedding": [0.1, 1, 1, 1, 1, 1, 1, 1, 1], "k": ' + b"7" * 5000 + b"}", None, 400,
     "body"),
    ("norm underflows", {"embedding": [1e-300] * 9}, None, 400, "embedding"),
    ("30k-deep nesting (60 KB, under the body limit)", b'{"embedding": ' + b"[" * 30_000 + b"]" * 30_000 + b"}",
     None, 400, "body"),
]


@pytest.mark.parametrize("what,body,content_type,status,field", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_are_4xx_naming_the_field(service, what, body, content_type, status, field):
    raw = body if isinstance(body, bytes) else None
    got, answer = helpers.call(service["url"], "/search", None if raw is not None else body, method="POST",
                               raw=raw, content_type=content_type or "application/json")
    assert got == status, (what, answer)
    assert answer["error"]["field"] == field, (what, answer)


def test_a_chunked_body_over_the_limit_is_refused_without_reading_it_whole(service):
    """128 MiB sent chunked (no Content-Length) to a service with a 64 KiB limit: 413 naming the body, the
    replica stopped reading within one message of the limit and its memory did not take the body in (Serve's HTTP
    proxy itself queues what the client sends until the answer is out)."""
    import psutil

    limit, chunk, chunks = 64 << 10, b"x" * (256 << 10), 512
    replicas = set()
    while len(replicas) < 2:
        replicas.add(int(helpers.call(service["url"], "/healthz")[1]["replica"]))
    before = {pid: psutil.Process(pid).memory_info().rss for pid in replicas}
    _, status, answer = helpers.send_chunked(service["url"], "/search", chunk, chunks)
    assert status == 413 and answer["error"]["field"] == "body", answer
    read = int(re.search(r"stopped reading after (\d+) bytes", answer["error"]["message"]).group(1))
    assert limit < read <= limit + len(chunk) + (64 << 10), answer
    growth = max(psutil.Process(pid).memory_info().rss - before[pid] for pid in replicas)
    assert growth < len(chunk) * chunks // 4, f"a replica grew by {growth} bytes"
    assert helpers.call(service["url"], "/search", {"embedding": [0.1] * 9, "k": 1})[0] == 200


def test_routes_and_methods(service):
    assert helpers.call(service["url"], "/search")[0] == 405
    assert helpers.call(service["url"], "/nowhere")[0] == 404
    status, answer = helpers.call(service["url"], "/search", {"embedding": [0.1] * 9, "k": 2,
                                                              "model_version": service["versions"][1]})
    assert status == 400 and answer["error"]["field"] == "model_version"   # version 2 embedded nothing here yet


Load = helpers.Load


def _wait_for_version(url: str, version: str, timeout_s: float = 60.0) -> None:
    """Until several consecutive answers (both replicas, by Serve's routing) come from ``version``."""
    deadline, streak = time.monotonic() + timeout_s, 0
    while streak < 8:
        assert time.monotonic() < deadline, f"version {version} not served after {timeout_s} s"
        status, health = helpers.call(url, "/healthz")
        streak = streak + 1 if status == 200 and health["model_version"] == version else 0
        time.sleep(0.05)


def test_gate_move_and_rollback_swap_live_under_load(service):
    """`compat gate rollback --to V2` moves @champion under load, then a plain rollback moves it back: no failed
    request, and each answer's scores equal the cosine of that answer's model version's query embedding with the
    stored gallery embeddings (recomputed here), never the other version's."""
    from cluster.model_registry.versions import MlflowModelResolver
    from cluster.serving.index_store import load_index
    from cluster.serving.models import embed_images, load_served_model
    from pipelines.config.model_uri import ModelUri
    from pipelines.config.load import load_config
    from pipelines.stages.pools import load_pool

    v1, v2 = service["versions"]
    config = load_config(str(service["config"]))
    pool = load_pool(config.evaluation.query_set)
    images = pool.read(np.arange(12))
    tracking = ["--tracking-uri", service["tracking"]]
    with Load(service["url"], images) as load:
        time.sleep(1.5)
        assert main(["gate", "rollback", NAME, "--to", v2, "--force", "--reason", "serve test"] + tracking) == 0
        _wait_for_version(service["url"], v2)
        time.sleep(1.0)
        assert main(["gate", "rollback", NAME] + tracking) == 0
        _wait_for_version(service["url"], v1)
        time.sleep(1.0)
    statuses = [a[2] for a in load.answers]
    assert statuses and set(statuses) == {200}, f"{len([s for s in statuses if s != 200])} failed requests"
    served = {a[3]["model_version"] for a in load.answers}
    assert served == {v1, v2}
    index = load_index(service["root"])
    gallery = index.embeddings.astype(np.float64)
    gallery /= np.linalg.norm(gallery, axis=1, keepdims=True)
    resolver = MlflowModelResolver(service["tracking"], cache_dir=str(service["folder"] / "cache"))
    image = index.manifest["image"]
    embedded = {}
    for version in (v1, v2):
        model = load_served_model(resolver, ModelUri(NAME, version))
        rows = embed_images(model, images, image["mean"], image["std"]).double().numpy()
        embedded[version] = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    for _, row, _, doc, _ in load.answers:
        positions = [r["position"] for r in doc["results"]]
        got = np.asarray([r["score"] for r in doc["results"]])
        claimed = doc["model_version"]
        other = v2 if claimed == v1 else v1
        np.testing.assert_allclose(got, gallery[positions] @ embedded[claimed][row], atol=1e-5)
        assert not np.allclose(got, gallery[positions] @ embedded[other][row], atol=1e-3)


def test_replica_killed_under_load_keeps_answering(service):
    """SIGKILL one replica's process while clients query (one retry per request): every request is answered,
    Serve restarts the replica, and later answers still equal the stored index."""
    import os
    import signal

    from pipelines.config.load import load_config
    from pipelines.stages.pools import load_pool

    config = load_config(str(service["config"]))
    images = load_pool(config.evaluation.query_set).read(np.arange(6))
    replicas = set()
    while len(replicas) < 2:
        replicas.add(helpers.call(service["url"], "/healthz")[1]["replica"])
    victim = int(sorted(replicas)[0])
    with Load(service["url"], images, retries=1) as load:
        time.sleep(1.0)
        os.kill(victim, signal.SIGKILL)
        time.sleep(3.0)
    statuses = [a[2] for a in load.answers]
    assert statuses.count(200) == len(statuses), f"unanswered after a retry: {[s for s in statuses if s != 200]}"
    deadline, seen = time.monotonic() + 90, set()
    while not (len(seen) >= 2 and str(victim) not in seen):
        assert time.monotonic() < deadline, "Serve did not bring a second replica back"
        status, health = helpers.call(service["url"], "/healthz")
        if status == 200:
            seen.add(health["replica"])
        seen.discard(str(victim))
        time.sleep(0.1)
    test_healthz_metrics_and_search_by_embedding_equal_brute_force(service)


def test_backfill_while_serving_flips_chunks_and_logs_the_probe_curve(service):
    """@champion moves to v2, then `compat index backfill` re-embeds the gallery in chunks of 8 as Ray tasks while
    clients query: no failed request; the probe Recall@1 logged to MLflow starts at the cross-test M(v2, v1) and
    ends at the self-test M(v2, v2) (the evaluation's numbers); the index ends all v2, verified."""
    from cluster.serving.backfill_job import EXPERIMENT
    from cluster.serving.index_store import load_index
    from pipelines.config.load import load_config
    from pipelines.stages.entry_metrics import compute_entry
    from pipelines.stages.pools import load_pool

    v1, v2 = service["versions"]
    tracking = ["--tracking-uri", service["tracking"]]
    config = load_config(str(service["config"]))
    query_pool = load_pool(config.evaluation.query_set)
    assert main(["gate", "rollback", NAME, "--to", v2, "--force", "--reason", "backfill test"] + tracking) == 0
    _wait_for_version(service["url"], v2)
    with Load(service["url"], query_pool.read(np.arange(6)), clients=2) as load:
        assert main(["index", "backfill", service["root"], "--config", str(service["config"]), "--model",
                     f"models:/{NAME}@champion", "--chunk-rows", "8"] + tracking) == 0
        deadline = time.monotonic() + 60
        while helpers.call(service["url"], "/healthz")[1]["items_by_version"] != {v2: 30}:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    statuses = [a[2] for a in load.answers]
    assert statuses and set(statuses) == {200}
    index = load_index(service["root"])
    assert set(index.versions.tolist()) == {v2} and len(index.manifest["shards"]) == 4 + 4
    protocol = {"metric": "recall_at_1", "gallery": "instances", "label_level": "fine"}
    gallery_pool = load_pool(config.evaluation.gallery_set)
    q2 = _features(service, v2, "query")
    g1, g2 = _features(service, v1, "gallery"), _features(service, v2, "gallery")
    cross = compute_entry((q2, query_pool.labels, None), (g1, gallery_pool.labels, None), protocol, config)
    self_new = compute_entry((q2, query_pool.labels, None), (g2, gallery_pool.labels, None), protocol, config)
    client = service["client"]
    run = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id],
                             f"tags.target_version = '{v2}'")[0]
    curve = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "probe/recall_at_1"))
    steps = [step for step, _ in curve]   # chunks of 8, 8, 8, 6 items flip in the order their tasks finish
    assert len(steps) == 5 and steps[0] == 0 and steps[-1] == 1000 and steps == sorted(set(steps))
    assert all(round(1000 * done / 30) in steps for done in (8, 16))
    assert curve[0][1] == cross and curve[-1][1] == self_new
    np.testing.assert_allclose(index.embeddings, g2, rtol=0, atol=1e-5)   # chunked batches vs whole-pool batches


@pytest.fixture(scope="module")
def adapter_service(mlflow_server, ray_local, tmp_path_factory, service):
    """A second registered model whose v2 is v1's network with a rotated junction; v1's gallery indexed and served
    (a second Serve application on the same proxy)."""
    from ray import serve

    from cluster.serving.app import deployment

    folder = tmp_path_factory.mktemp("serve-adapter")
    client, name = service["client"], "serve-test-rotated"
    v1 = helpers.register_random_model(client, name, 0, folder)
    v2 = helpers.register_random_model(client, name, 0, folder, rotation_seed=5)
    tracking = ["--tracking-uri", service["tracking"]]
    assert main(["gate", name, "--candidate", v1, "--config", str(service["config"])] + tracking) == 0
    root = str(folder / "index")
    assert main(["index", "build", root, "--config", str(service["config"]), "--model", f"models:/{name}@champion"]
                + tracking) == 0
    settings = {"index": root, "model": f"models:/{name}@champion", "tracking_uri": service["tracking"],
                "poll_s": 0.3, "cache_dir": str(folder / "cache")}
    serve.run(deployment(num_replicas=1, num_cpus=0).options(name="rotated").bind(settings), name="rotated",
              route_prefix="/rotated")
    yield {"url": service["url"] + "/rotated", "name": name, "versions": (v1, v2), "tracking": tracking,
           "root": root}
    serve.delete("rotated")


def test_gate_adapter_is_applied_to_the_old_group(service, adapter_service):
    """`compat gate --adapter procrustes --non-strict` promotes the rotated v2 (the adapter recovers the rotation,
    so M(v2+adapter, v1) = M(v1, v1)) and installs the adapter; the service then searches v1's gallery with the
    adapted v2 query: the same answers as under v1, and the answer names the adapter."""
    url, name, (v1, v2) = adapter_service["url"], adapter_service["name"], adapter_service["versions"]
    from pipelines.config.load import load_config
    from pipelines.stages.pools import load_pool

    config = load_config(str(service["config"]))
    images = load_pool(config.evaluation.query_set).read(np.arange(10))
    encoded = [helpers.png_base64(image) for image in images]

    def answers():
        return [helpers.call(url, "/search", {"image": image, "k": 3})[1] for image in encoded]

    before = answers()
    assert {a["model_version"] for a in before} == {v1}
    assert main(["gate", name, "--candidate", v2, "--config", str(service["config"]), "--adapter", "procrustes",
                 "--non-strict"] + adapter_service["tracking"]) == 0
    deadline = time.monotonic() + 60
    while helpers.call(url, "/healthz")[1]["model_version"] != v2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    health = helpers.call(url, "/healthz")[1]
    assert health["adapter"] == {"kind": "procrustes", "old_version": v1}
    after = answers()
    for old, new in zip(before, after):
        assert new["model_version"] == v2
        assert [r["position"] for r in new["results"]] == [r["position"] for r in old["results"]]
        np.testing.assert_allclose([r["score"] for r in new["results"]], [r["score"] for r in old["results"]],
                                   atol=1e-4)
        assert {r["adapter"] for r in new["results"]} == {"procrustes"}

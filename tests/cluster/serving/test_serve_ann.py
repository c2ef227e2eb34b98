"""`compat index build --kind hnsw` + `compat serve` over HTTP on 127.0.0.1 (real Serve, real MLflow registry, randomly
initialised registered models): the approximate index answers as the exact search does, a newer model (through the
adapter the gate installed) searches the old index unchanged, and a model of another width is refused before any
replica starts."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
import serving_helpers as helpers
import torch
from local_services import free_port

from app.cli import main

pytestmark = pytest.mark.integration
NAME = "serve-ann-test"


@pytest.fixture(scope="module")
def ann_service(mlflow_server, ray_local, tmp_path_factory):
    """v1 (@champion, by the gate) and v2 = v1's network with a rotated junction; v1's gallery indexed twice
    (flat and hnsw) and served by two Serve applications on one proxy."""
    from mlflow import MlflowClient
    from ray import serve

    from cluster.serving.app import deployment, start

    folder = tmp_path_factory.mktemp("serve-ann")
    client = MlflowClient(mlflow_server.tracking_uri)
    v1 = helpers.register_random_model(client, NAME, 0, folder)
    v2 = helpers.register_random_model(client, NAME, 0, folder, rotation_seed=5)
    config = helpers.write_config(folder)
    tracking = ["--tracking-uri", mlflow_server.tracking_uri]
    assert main(["gate", NAME, "--candidate", v1, "--config", str(config)] + tracking) == 0
    roots = {kind: str(folder / f"index-{kind}") for kind in ("flat", "hnsw", "ivf")}
    for kind, root in roots.items():
        assert main(["index", "build", root, "--config", str(config), "--model", f"models:/{NAME}@champion",
                     "--kind", kind, "--recall", "0.99", "--sample", "30", "--seed", "3"] + tracking) == 0

    def settings(kind):
        return {"index": roots[kind], "model": f"models:/{NAME}@champion", "tracking_uri": mlflow_server.tracking_uri,
                "poll_s": 0.3, "cache_dir": str(folder / "cache")}

    url = start(settings("hnsw"), "127.0.0.1", free_port(), num_replicas=1, num_cpus=0)
    serve.run(deployment(num_replicas=1, num_cpus=0).options(name="flat").bind(settings("flat")), name="flat",
              route_prefix="/flat")
    serve.run(deployment(num_replicas=1, num_cpus=0).options(name="ivf").bind(settings("ivf")), name="ivf",
              route_prefix="/ivf")
    for base in (url, url + "/flat", url + "/ivf"):
        deadline = time.monotonic() + 120
        while (health := helpers.call(base, "/healthz"))[0] != 200:
            assert time.monotonic() < deadline, f"{base} not loaded within 120 s: {health}"
            time.sleep(0.2)
    yield {"url": url, "flat": url + "/flat", "ivf": url + "/ivf", "client": client, "versions": (v1, v2), "config": config,
           "roots": roots, "folder": folder, "tracking": tracking, "tracking_uri": mlflow_server.tracking_uri}
    serve.shutdown()


def _features(ann_service, version: str, pool: str) -> np.ndarray:
    from cluster.model_registry.versions import MlflowModelResolver
    from cluster.serving.models import load_served_model
    from pipelines.config.load import load_config
    from pipelines.config.model_uri import ModelUri
    from pipelines.stages.extraction import extract_pool_features
    from pipelines.stages.pools import load_pool

    config = load_config(str(ann_service["config"]))
    spec = config.evaluation.query_set if pool == "query" else config.evaluation.gallery_set
    resolver = MlflowModelResolver(ann_service["tracking_uri"], cache_dir=str(ann_service["folder"] / "cache"))
    model = load_served_model(resolver, ModelUri(NAME, version))
    return extract_pool_features(model, load_pool(spec), config, torch.device("cpu"))


def _brute(query: np.ndarray, gallery: np.ndarray, k: int):
    q = query.astype(np.float64) / np.linalg.norm(query.astype(np.float64))
    g = gallery.astype(np.float64) / np.linalg.norm(gallery.astype(np.float64), axis=1, keepdims=True)
    scores = g @ q
    order = np.lexsort((np.arange(g.shape[0]), -scores))[:k]
    return order, scores[order]


def test_hnsw_index_answers_equal_the_exact_search(ann_service, capsys):
    v1 = ann_service["versions"][0]
    status, health = helpers.call(ann_service["url"], "/healthz")
    assert status == 200 and health["model_version"] == v1
    search = health["search"]
    assert search["kind"] == "hnsw" and search["approximate_groups"] == [v1] and search["model_version"] == v1
    assert search["rerank"] == "structure"     # the replica holds the rows once, in the structure
    assert search["recall"] >= search["recall_target"] == 0.99 and search["sample"] == {"pool": "query", "size": 30,
                                                                                          "seed": 3}
    assert helpers.call(ann_service["flat"], "/healthz")[1]["search"] == {"kind": "flat", "approximate_groups": []}
    assert main(["index", "show", ann_service["roots"]["hnsw"]]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["search"]["kind"] == "hnsw" and shown["search"]["effort"] == search["effort"]
    gallery, queries = _features(ann_service, v1, "gallery"), _features(ann_service, v1, "query")
    for row in range(queries.shape[0]):
        body = {"embedding": queries[row].tolist(), "k": 5}
        status, answer = helpers.call(ann_service["url"], "/search", body)
        assert status == 200, answer
        order, scores = _brute(queries[row], gallery, 5)
        assert [r["position"] for r in answer["results"]] == order.tolist()
        np.testing.assert_allclose([r["score"] for r in answer["results"]], scores, rtol=0, atol=1e-6)
        flat = helpers.call(ann_service["flat"], "/search", body)[1]
        assert [r["position"] for r in answer["results"]] == [r["position"] for r in flat["results"]]
        np.testing.assert_allclose([r["score"] for r in answer["results"]], [r["score"] for r in flat["results"]],
                                   rtol=0, atol=1e-6)


def test_ivf_replica_answers_exactly_over_its_stored_fp16_rows(ann_service):
    """An IVF replica keeps no copy of the gallery but the structure's fp16 lists: every answer is the fp64 brute
    force over those stored rows (read back from the index file), in its order (lowest row first on ties); a
    stored row as the query finds itself first."""
    from cluster.serving.index_store import load_index
    from compat_core.retrieval.mixed_gallery import unit_rows

    v1 = ann_service["versions"][0]
    health = helpers.call(ann_service["ivf"], "/healthz")[1]
    assert health["search"]["kind"] == "ivf" and health["search"]["rerank"] == "structure"
    assert health["search"]["approximate_groups"] == [v1]
    index = load_index(ann_service["roots"]["ivf"])
    stored = index.ann.stored_rows(0, index.size).astype(np.float64)
    np.testing.assert_array_equal(stored, stored.astype(np.float16).astype(np.float64))   # fp16 rows, as stored
    assert load_index(ann_service["roots"]["ivf"], lean=True).embeddings is None
    queries = _features(ann_service, v1, "query")
    for query in list(queries) + [stored[3]]:
        status, answer = helpers.call(ann_service["ivf"], "/search", {"embedding": query.tolist(), "k": 5})
        assert status == 200, answer
        # the service takes a query as the evaluation does (L2-normalised in fp32), then scores in fp64
        order, scores = _brute(unit_rows(np.asarray(query, dtype=np.float32)[None])[0].double().numpy(), stored, 5)
        assert [r["position"] for r in answer["results"]] == order.tolist()
        np.testing.assert_allclose([r["score"] for r in answer["results"]], scores, rtol=0, atol=1e-12)


def test_a_newer_model_searches_the_old_index_unchanged(ann_service):
    """The gate promotes the rotated v2 with a procrustes adapter; both services switch to v2 + adapter, the hnsw
    index (built by v1, same manifest) still answers v1's group approximately, and the answers equal the flat
    service's and those before the upgrade."""
    from pipelines.config.load import load_config
    from pipelines.stages.pools import load_pool

    v1, v2 = ann_service["versions"]
    url, flat = ann_service["url"], ann_service["flat"]
    config = load_config(str(ann_service["config"]))
    images = [helpers.png_base64(image) for image in load_pool(config.evaluation.query_set).read(np.arange(12))]
    manifest = helpers.call(url, "/healthz")[1]["index_manifest"]
    before = [helpers.call(url, "/search", {"image": image, "k": 3})[1] for image in images]
    assert main(["gate", NAME, "--candidate", v2, "--config", str(ann_service["config"]), "--adapter", "procrustes",
                 "--non-strict"] + ann_service["tracking"]) == 0
    for base in (url, flat):
        deadline = time.monotonic() + 60
        while helpers.call(base, "/healthz")[1]["model_version"] != v2:
            assert time.monotonic() < deadline, f"{base} did not switch to {v2} within 60 s"
            time.sleep(0.1)
    health = helpers.call(url, "/healthz")[1]
    assert health["adapter"] == {"kind": "procrustes", "old_version": v1} and health["index_manifest"] == manifest
    assert health["search"]["kind"] == "hnsw" and health["search"]["approximate_groups"] == [v1]
    for image, old in zip(images, before):
        new = helpers.call(url, "/search", {"image": image, "k": 3})[1]
        exact = helpers.call(flat, "/search", {"image": image, "k": 3})[1]
        assert new["model_version"] == v2 and {r["adapter"] for r in new["results"]} == {"procrustes"}
        assert [r["position"] for r in new["results"]] == [r["position"] for r in exact["results"]]
        assert [r["score"] for r in new["results"]] == [r["score"] for r in exact["results"]]
        assert [r["position"] for r in new["results"]] == [r["position"] for r in old["results"]]


def _recall_at_1(query: np.ndarray, query_labels, gallery: np.ndarray, labels) -> float:
    q = query.astype(np.float64) / np.linalg.norm(query.astype(np.float64), axis=1, keepdims=True)
    g = gallery.astype(np.float64) / np.linalg.norm(gallery.astype(np.float64), axis=1, keepdims=True)
    top = [np.lexsort((np.arange(g.shape[0]), -row))[0] for row in q @ g.T]
    return float(np.mean(np.asarray(labels)[top] == np.asarray(query_labels)))


def test_backfill_into_the_mixed_gallery_under_load(ann_service):
    """After the upgrade to v2 (+ procrustes adapter), `compat index backfill` re-embeds the hnsw index's gallery in
    chunks of 8 while clients query it: no failed request; every answer equals the fp64 brute force over the
    gallery of the manifest it names (v1 rows scored with the adapted query, v2 rows with the v2 query); every
    manifest of the backfill carries an hnsw structure over exactly the re-embedded rows beside v1's, the last one
    v2's alone; the probe curve stays >= min(M(v2, v1), M(v1, v1)) and ends at M(v2, v2) (fp64 brute force)."""
    from cluster.serving.backfill_job import EXPERIMENT
    from cluster.serving.index_build import evaluation_labels
    from cluster.serving.index_store import load_index, read_manifest
    from cluster.serving.models import installed_adapter, resolve_model_ref
    from cluster.serving.state import build_state
    from pipelines.config.load import load_config
    from pipelines.config.model_uri import ModelUri
    from pipelines.stages.pools import load_pool

    v1, v2 = ann_service["versions"]
    root, url, client = ann_service["roots"]["hnsw"], ann_service["url"], ann_service["client"]
    if helpers.call(url, "/healthz")[1]["model_version"] != v2:
        test_a_newer_model_searches_the_old_index_unchanged(ann_service)
    config = load_config(str(ann_service["config"]))
    query_pool = load_pool(config.evaluation.query_set)
    start_head, _ = read_manifest(root)
    with helpers.Load(url, query_pool.read(np.arange(8)), clients=2) as load:
        assert main(["index", "backfill", root, "--config", str(ann_service["config"]), "--model",
                     f"models:/{NAME}@champion", "--chunk-rows", "8"] + ann_service["tracking"]) == 0
        deadline = time.monotonic() + 60
        while helpers.call(url, "/healthz")[1]["items_by_version"] != {v2: 30}:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(0.5)
    statuses = [answer[2] for answer in load.answers]
    assert statuses and set(statuses) == {200}, f"{statuses.count(200)} of {len(statuses)} answered 200"

    # the manifests of the backfill, newest first: v1's structure plus one over the re-embedded rows, then v2's alone
    chain, head = [], read_manifest(root)[0]
    while head != start_head:
        chain.append(read_manifest(root, head)[1])
        head = chain[-1]["parent"]
    assert len(chain) == 4
    assert chain[0]["search"]["kind"] == "hnsw" and chain[0]["search"]["model_version"] == v2
    assert chain[0]["search"]["rows"] == 30 and "search_backfill" not in chain[0]
    for manifest in chain[1:]:
        assert manifest["search"]["model_version"] == v1 and manifest["search"]["rows"] == 30
        assert manifest["search_backfill"]["kind"] == "hnsw" and manifest["search_backfill"]["model_version"] == v2
        assert manifest["search_backfill"]["rows"] == manifest["backfill"]["done"]
        assert manifest["search_backfill"]["recall"] >= manifest["search"]["recall_target"]
    final = helpers.call(url, "/healthz")[1]["search"]
    assert final["approximate_groups"] == [v2] and final["model_version"] == v2 and "backfill" not in final

    # every answer equals the fp64 brute force over the gallery of the manifest it names
    adapter = installed_adapter(client, resolve_model_ref(client, f"models:/{NAME}@champion"))
    assert adapter[:2] == ("procrustes", v1)
    q2 = torch.from_numpy(_features(ann_service, v2, "query"))
    adapted = adapter[2].apply(q2).float().numpy()
    q2 = q2.numpy()
    indexes, manifests_seen = {}, set()
    for _, row, _, answer, _ in load.answers:
        sha = answer["index_manifest"]
        index = indexes.setdefault(sha, load_index(root, sha))
        manifests_seen.add(sha)
        g = index.embeddings.astype(np.float64) / np.linalg.norm(index.embeddings.astype(np.float64), axis=1,
                                                                  keepdims=True)
        scores = np.where(index.versions == v2, g @ (q2[row] / np.linalg.norm(q2[row])),
                          g @ (adapted[row] / np.linalg.norm(adapted[row])))
        order = np.lexsort((np.arange(g.shape[0]), -scores))[:3]
        assert [r["position"] for r in answer["results"]] == order.tolist()
        assert [r["item_version"] for r in answer["results"]] == index.versions[order].tolist()
        np.testing.assert_allclose([r["score"] for r in answer["results"]], scores[order], rtol=0, atol=1e-4)
    assert len(manifests_seen) >= 2   # answers came from the index mid-backfill, not only before or after it
    for index in indexes.values():     # each version group was searched through a structure, none exactly
        groups = build_state(ModelUri(NAME, v2), None, index, adapter, "auto").groups
        assert [g.version for g in groups if g.ann is not None] == sorted(set(index.versions.tolist()))

    # the probe curve against the M values by fp64 brute force
    labels = evaluation_labels(config, query_pool)
    g1, g2 = _features(ann_service, v1, "gallery"), _features(ann_service, v2, "gallery")
    q1 = _features(ann_service, v1, "query")
    m_new_old, m_old_old = _recall_at_1(adapted, labels, g1, index.labels), _recall_at_1(q1, labels, g1, index.labels)
    m_new_new = _recall_at_1(q2, labels, g2, index.labels)
    run = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id],
                             f"tags.target_version = '{v2}' and tags.index_root = '{root}'")[0]
    curve = [value for _, value in sorted((m.step, m.value) for m in
                                          client.get_metric_history(run.info.run_id, "probe/recall_at_1"))]
    print(f"probe curve {curve}; M(v2+adapter, v1) {m_new_old}, M(v1, v1) {m_old_old}, M(v2, v2) {m_new_new}; "
          f"{len(statuses)} requests, {sum(s != 200 for s in statuses)} failed, answered from "
          f"{len(manifests_seen)} manifests")
    assert len(curve) == 5 and curve[0] == m_new_old and curve[-1] == m_new_new
    assert min(curve) >= min(m_new_old, m_old_old)


def test_a_model_of_another_width_is_refused_before_serving(ann_service):
    from cluster.serving.app import preflight

    wide = helpers.register_random_model(ann_service["client"], NAME + "-wide", 0, ann_service["folder"],
                                         num_slots=12)
    root = ann_service["roots"]["hnsw"]
    settings = {"index": root, "model": f"models:/{NAME}-wide/{wide}", "tracking_uri": ann_service["tracking_uri"],
                "cache_dir": str(ann_service["folder"] / "cache")}
    with pytest.raises(ValueError, match=rf"model models:/{NAME}-wide/{wide} makes 11-d features, the index at "
                                         rf"{root} holds 9-d embeddings \(hnsw search\)"):
        preflight(settings)
    preflight({**settings, "model": f"models:/{NAME}/{ann_service['versions'][0]}"})

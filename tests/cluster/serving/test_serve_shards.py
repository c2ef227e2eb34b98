"""A gallery split by row range into shards, each served by its own Ray Serve deployment behind a router (real Serve,
HTTP on 127.0.0.1): answers equal fp64 brute force over the whole gallery (ties by the lowest global row); a shard
replica killed under load is restarted by Serve with no failed request and no wrong answer; every replica port is on
loopback."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import ray  # noqa: F401 - Ray ships psutil: importing ray first puts it on the path
import psutil  # noqa: I001
import serving_helpers as helpers
from local_services import free_port

pytestmark = pytest.mark.integration
ROWS, DIM, SHARDS, K = 3000, 16, 3, 5
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


def _gallery() -> np.ndarray:
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((30, DIM))
    rows = centres[rng.integers(0, 30, ROWS)] + 0.5 * rng.standard_normal((ROWS, DIM))
    rows[2500] = rows[10]     # duplicates in shards 2 and 0: tied scores, the lowest global row first
    return rows.astype(np.float32)


@pytest.fixture(scope="module")
def sharded(ray_local, tmp_path_factory):
    from ray import serve

    from cluster.serving.shard_router import start_sharded
    from cluster.serving.shards import write_sharded_index

    # the exact kernel on every shard: every answer must then equal brute force (the approximate structures are
    # checked against their measured recall elsewhere; here the shard path itself is under test)
    root = str(tmp_path_factory.mktemp("serve-shards") / "index")
    gallery = _gallery()
    digest, document = write_sharded_index(root, gallery, SHARDS, {"name": "shard-test", "version": "1"},
                                           shard_rows=400)
    url = start_sharded({"index": root, "poll_s": 0.3, "shard_retry_s": 60.0}, "127.0.0.1", free_port(),
                        num_replicas=1, num_cpus=0)
    deadline = time.monotonic() + 180
    while (health := helpers.call(url, "/healthz"))[0] != 200:
        assert time.monotonic() < deadline, f"not loaded within 180 s: {health}"
        time.sleep(0.3)
    yield {"url": url, "root": root, "gallery": gallery, "digest": digest, "document": document}
    serve.shutdown()


def _queries(count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    gallery = _gallery()
    return (gallery[rng.integers(0, ROWS, count)] + 0.3 * rng.standard_normal((count, DIM))).astype(np.float32)


def test_the_shard_set_tiles_the_gallery_and_each_part_has_its_structure(tmp_path):
    from cluster.serving.index_build import AnnSettings, build_search_entry
    from cluster.serving.index_store import commit_manifest, load_index, read_manifest
    from cluster.serving.shards import check_shard_set, part_root, read_shard_set, write_sharded_index
    from compat_core.integrity import IntegrityError

    root, gallery = str(tmp_path / "index"), _gallery()
    held_out, settings = gallery[::7] + 0.01, AnnSettings("ivf", 0.99, 200, 0)
    digest, _ = write_sharded_index(root, gallery, SHARDS, {"name": "shard-test", "version": "1"}, shard_rows=400,
                                    search=lambda where, rows: build_search_entry(where, rows, held_out, settings,
                                                                                  "1", "query", print))
    read_digest, document = read_shard_set(root)
    assert read_digest == digest and document["search"] == "ivf"
    assert [(p["offset"], p["rows"]) for p in document["parts"]] == [(0, 1000), (1000, 1000), (2000, 1000)]
    for part, manifest in zip(document["parts"], check_shard_set(root, document)):
        index = load_index(part_root(root, part))
        assert index.manifest_sha == part["manifest"] and index.ann is not None and index.search_kind == "ivf"
        assert index.ann.size == part["rows"] and manifest["search"]["recall"] >= 0.99
        assert manifest["shard"]["offset"] == part["offset"] and index.size == part["rows"]
        assert index.item_ids[0] == str(part["offset"])   # global ids, local positions
        np.testing.assert_array_equal(index.embeddings, gallery[part["offset"]:][:part["rows"]])
    with pytest.raises(ValueError, match="already holds a gallery index"):
        write_sharded_index(root, gallery, 2, {"name": "shard-test", "version": "1"})
    where = part_root(root, document["parts"][1])   # a part whose manifest says another offset is refused
    _, manifest = read_manifest(where)
    commit_manifest(where, {**manifest, "shard": {**manifest["shard"], "offset": 7}})
    with pytest.raises(IntegrityError, match="part-0001.*offset"):
        check_shard_set(root, document)


def test_answers_equal_brute_force_over_the_whole_gallery(sharded):
    gallery = sharded["gallery"]
    status, health = helpers.call(sharded["url"], "/healthz")
    assert status == 200 and health["status"] == "ok" and len(health["shards"]) == SHARDS
    assert health["items"] == ROWS and health["shard_set"] == sharded["digest"]
    tie = gallery[10] + 1e-4
    queries = np.vstack([tie[None], _queries(30, 1)])
    for query in queries:
        status, answer = helpers.call(sharded["url"], "/search", {"embedding": query.tolist(), "k": K})
        assert status == 200, answer
        assert [r["position"] for r in answer["results"]] == helpers.brute_rows(query, gallery, K)
        assert [r["id"] for r in answer["results"]] == [str(r["position"]) for r in answer["results"]]
        assert answer["index_manifest"] == sharded["digest"] and len(answer["shard_manifests"]) == SHARDS
    status, answer = helpers.call(sharded["url"], "/search", {"embedding": tie.tolist(), "k": 2})
    assert [r["position"] for r in answer["results"]] == [10, 2500]
    assert [r["shard"] for r in answer["results"]] == [0, 2]
    assert answer["results"][0]["score"] == answer["results"][1]["score"]
    status, refused = helpers.call(sharded["url"], "/search", {"embedding": [1.0] * (DIM + 1), "k": 1})
    assert status == 400 and refused["error"]["field"] == "embedding", refused


def test_every_replica_port_is_on_loopback(sharded):
    status, health = helpers.call(sharded["url"], "/healthz")
    pids = {shard["pid"] for shard in health["shards"]}
    assert len(pids) >= 1 and all(isinstance(pid, int) for pid in pids)
    listening = {}
    for pid in pids:
        for connection in psutil.Process(pid).net_connections(kind="inet"):
            if connection.status == psutil.CONN_LISTEN:
                listening[(connection.laddr.ip, connection.laddr.port)] = pid
    assert listening, "the shard replicas listen on no port (their gRPC server?)"
    assert {ip for ip, _ in listening} <= LOOPBACK, listening


def _metric(url: str, name: str) -> int:
    _, text = helpers.call(url, "/metrics")
    return int(next(line for line in text.splitlines() if line.startswith(name + " ")).split()[-1])


def test_concurrent_queries_go_to_each_shard_together_and_are_answered_each_exactly(sharded):
    from concurrent.futures import ThreadPoolExecutor

    gallery, url = sharded["gallery"], sharded["url"]
    queries = _queries(96, 4)
    calls, bodies = _metric(url, "compat_router_shard_calls_total"), _metric(url, "compat_router_shard_call_bodies_total")
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda q: helpers.call(url, "/search", {"embedding": q.tolist(), "k": K}), queries))
    for query, (status, answer) in zip(queries, answers):
        assert status == 200, answer
        assert [r["position"] for r in answer["results"]] == helpers.brute_rows(query, gallery, K)
    calls = _metric(url, "compat_router_shard_calls_total") - calls
    bodies = _metric(url, "compat_router_shard_call_bodies_total") - bodies
    assert bodies == SHARDS * len(queries) and calls < bodies, (calls, bodies)   # some calls carried several


def test_the_sharded_service_serves_the_api_reference_of_one_replica(sharded):
    from ray import serve

    from cluster.serving.app import APP_NAME
    from cluster.serving.shard_router import shard_deployment_name

    url = sharded["url"]
    status, document = helpers.call(url, "/openapi.json")
    assert status == 200 and document["openapi"] == "3.1.0", document
    assert set(document["paths"]) == {"/search", "/healthz", "/metrics", "/openapi.json", "/docs"}
    one_replica = serve.get_deployment_handle(shard_deployment_name(0), APP_NAME).api_document.remote().result()
    description = document["info"].pop("description")
    assert description.startswith(one_replica["info"].pop("description"))
    assert f"Sharded: {SHARDS} shards of {ROWS} items" in description
    assert document == one_replica
    example = document["paths"]["/search"]["post"]["requestBody"]["content"]["application/json"]["examples"]
    status, answer = helpers.call(url, "/search", example["embedding"]["value"])
    assert status == 200 and len(answer["results"]) == example["embedding"]["value"]["k"], answer
    status, page = helpers.call(url, "/docs")
    assert status == 200 and isinstance(page, str) and "<html" in page.lower()
    for route in document["paths"]:
        assert route in page, route


@pytest.mark.parametrize("how", ["ray.kill", "SIGKILL"])
def test_a_killed_shard_replica_is_restarted_with_no_failed_request_and_no_wrong_answer(sharded, how):
    import os
    import signal

    import ray

    gallery, url = sharded["gallery"], sharded["url"]
    queries = _queries(64, 2)
    expected = [helpers.brute_rows(q, gallery, K) for q in queries]
    outcomes: list[tuple[int, bool]] = []
    stop = threading.Event()

    def load(worker: int) -> None:
        number = worker
        while not stop.is_set():
            i = number % len(queries)
            status, answer = helpers.call(url, "/search", {"embedding": queries[i].tolist(), "k": K}, timeout=120)
            right = status == 200 and [r["position"] for r in answer["results"]] == expected[i]
            outcomes.append((status, right))
            number += 3

    _, before = helpers.call(url, "/healthz")
    victim = before["shards"][1]
    assert victim["actor"] and victim["pid"], before
    threads = [threading.Thread(target=load, args=(w,)) for w in range(3)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(2.0)
        served_before_kill = len(outcomes)
        if how == "ray.kill":
            ray.kill(ray.get_actor(victim["actor"], namespace="serve"), no_restart=True)
        else:   # the replica's process dies as on a lost node or an OOM kill
            os.kill(victim["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 180
        while True:
            status, health = helpers.call(url, "/healthz")
            if status == 200 and health["shards"][1]["actor"] not in (None, victim["actor"]):
                break
            assert time.monotonic() < deadline, f"shard 1 not replaced within 180 s: {health}"
            time.sleep(0.3)
        replaced_at = len(outcomes)
        time.sleep(2.0)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=180)
    assert served_before_kill > 0 and len(outcomes) > replaced_at, (served_before_kill, replaced_at, len(outcomes))
    failed = [status for status, _ in outcomes if status != 200]
    wrong = sum(1 for status, right in outcomes if status == 200 and not right)
    _, metrics = helpers.call(url, "/metrics")
    retries = next(line for line in metrics.splitlines() if line.startswith("compat_router_shard_retries_total"))
    assert not failed and wrong == 0, (f"{len(failed)} failed ({failed[:5]}), {wrong} wrong of {len(outcomes)}; "
                                       f"{retries}")
    print(f"{how}: {len(outcomes)} answers, 0 failed, 0 wrong; {retries}")
    assert health["shards"][1]["pid"] != victim["pid"]

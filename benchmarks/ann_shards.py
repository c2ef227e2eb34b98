"""The shard path of ``benchmarks/serve_ann.py --shards N`` (a helper module of that script, not a test).

- :func:`shard_methods`: the gallery split by row range into N parts, each with its own exact kernel and its own
  ``kind`` structure (effort tuned on the same tuning queries, against that part's own exact top-1), searched one
  part after another in this process and merged exactly (``compat_core.retrieval.shard_merge``): the cost of
  fanning out and merging without any service.
- :func:`serve_rates`: the same gallery served over HTTP by Ray Serve on this machine, once unsharded (one
  replica, ``cluster.serving.app``) and as N shard deployments behind the router
  (``cluster.serving.shard_router``), the router sending each query to each shard as its own call
  (``shard_batch`` 1) and batching concurrent queries into one call per shard (the default), measured by the same
  client threads: queries per second, latency
  percentiles, failed requests, Recall@1 of exact, and the resident memory of each replica process.
"""
from __future__ import annotations

import json
import socket
import statistics
import tempfile
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import torch

from compat_core.retrieval.ann import ann_search, build_ann, tune_ann
from compat_core.retrieval.search import PreparedGallery, search_prepared
from compat_core.retrieval.shard_merge import merge_shard_topk, shard_ranges


def _ann_bytes(ann) -> int:
    return ann.bytes_in_memory() if ann is not None else 0


def shard_methods(gallery: torch.Tensor, tune_q: torch.Tensor, shards: int, kinds: list[str], recall: float,
                  prepared_bytes) -> dict:
    """Methods "<kind>, N shards" for kind "flat" (exact kernel per part) and each of ``kinds`` (structure + exact
    re-rank per part), in serve_ann's method format (search, build_s, bytes, effort)."""
    started = time.perf_counter()
    parts = [(start, PreparedGallery(gallery[start:stop].float(), "auto"))
             for start, stop in shard_ranges(gallery.shape[0], shards)]
    flat_seconds = time.perf_counter() - started
    flat_bytes = sum(prepared_bytes(prepared) for _, prepared in parts)

    def merged(search):
        def run(rows):
            answers = [(offset, *(t[:, 0].numpy() for t in search(rows, number, prepared)))
                       for number, (offset, prepared) in enumerate(parts)]
            return np.array([merge_shard_topk([(o, r[i:i + 1], s[i:i + 1]) for o, r, s in answers], 1)[0][0]
                             for i in range(rows.shape[0])])
        return run

    methods = {f"flat, {shards} shards": {
        "build_s": flat_seconds, "bytes": flat_bytes, "structure_bytes": 0, "effort": {},
        "search": merged(lambda rows, _, prepared: search_prepared(rows, prepared, 1))}}
    for kind in kinds:
        started = time.perf_counter()
        structures = [build_ann(prepared.gallery, kind, seed=0) for _, prepared in parts]
        built = time.perf_counter() - started
        efforts = [tune_ann(ann, prepared, tune_q, recall)["effort"] for ann, (_, prepared) in zip(structures, parts)]
        size = sum(_ann_bytes(ann) for ann in structures)
        methods[f"{kind} + exact re-rank, {shards} shards"] = {
            "build_s": built + flat_seconds, "bytes": size + flat_bytes, "structure_bytes": size,
            "effort": {"per_shard": efforts}, "kind": kind,
            "search": merged(lambda rows, number, prepared, s=structures: ann_search(rows, prepared, s[number], 1))}
        print(f"  built {shards} {kind} shards in {built:.1f} s; efforts {efforts}", flush=True)
    return methods


def _post(url: str, query: np.ndarray) -> tuple[int, int | None]:
    body = json.dumps({"embedding": [float(x) for x in query], "k": 1}).encode()
    request = urllib.request.Request(url + "/search", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, int(json.loads(response.read())["results"][0]["position"])
    except urllib.error.HTTPError as error:
        return error.code, None


def _drive(url: str, queries: np.ndarray, clients: int, seconds: float) -> dict:
    """Queries per second, latency percentiles and failures of ``clients`` threads posting ``queries`` for
    ``seconds``; top-1 rows by query number."""
    stop, lock = threading.Event(), threading.Lock()
    latencies, failures, top1 = [], [], {}

    def client(worker: int) -> None:
        number = worker
        while not stop.is_set():
            i = number % len(queries)
            started = time.perf_counter()
            status, row = _post(url, queries[i])
            with lock:
                latencies.append(time.perf_counter() - started)
                (failures.append(status) if status != 200 else top1.setdefault(i, row))
            number += clients

    threads = [threading.Thread(target=client, args=(w,)) for w in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(timeout=300)
    elapsed = time.perf_counter() - started
    ordered = sorted(latencies)
    return {"qps": len(latencies) / elapsed, "requests": len(latencies), "failed": len(failures),
            "p50_ms": 1000 * statistics.median(ordered), "p95_ms": 1000 * ordered[int(0.95 * (len(ordered) - 1))],
            "top1": top1}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_ok(url: str, timeout_s: float = 900.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=10) as response:
                if response.status == 200:
                    return json.loads(response.read())
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not loaded within {timeout_s} s")
        time.sleep(1.0)


def _rss_mib(pids) -> list[float]:
    import psutil

    return [round(psutil.Process(pid).memory_info().rss / 2 ** 20, 1) for pid in pids]


def serve_rates(gallery: torch.Tensor, tune_q: torch.Tensor, queries: torch.Tensor, exact: np.ndarray, shards: int,
                kind: str, recall: float, clients: int, seconds: float) -> list[dict]:
    """The HTTP rates of the gallery served unsharded and as ``shards`` shards (``kind`` structures), each measured
    by ``clients`` threads for ``seconds``; Recall@1 of exact from ``exact`` (top-1 rows of ``queries``)."""
    import ray
    from ray import serve

    from cluster.serving.app import start
    from cluster.serving.index_build import AnnSettings, build_search_entry
    from cluster.serving.index_store import commit_manifest, new_manifest, shard_table, write_shard
    from cluster.serving.shard_router import start_sharded
    from cluster.serving.shards import write_sharded_index

    features = gallery.float().numpy()
    settings = AnnSettings(kind, recall, tune_q.shape[0], 0)
    model = {"name": "benchmark", "version": "1"}
    rows = []
    with tempfile.TemporaryDirectory(prefix="serve-ann-shards-") as folder:
        single, sharded = f"{folder}/single", f"{folder}/sharded"
        entry = build_search_entry(single, features, tune_q.numpy(), settings, "1", "query", print)
        files = [write_shard(single, shard_table(np.arange(s, min(s + 65536, len(features))),
                                                 [str(i) for i in range(s, min(s + 65536, len(features)))],
                                                 features[s:s + 65536], "1"))
                 for s in range(0, len(features), 65536)]
        commit_manifest(single, new_manifest(features.shape[1], len(features), model, files, search=entry))
        write_sharded_index(
            sharded, features, shards, model, shard_rows=65536,
            search=lambda where, part: build_search_entry(where, part, tune_q.numpy(), settings, "1", "query", print))
        ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
                 configure_logging=False, log_to_driver=False)
        try:
            runs = ((f"serve {kind}, 1 replica", single, start, {}),
                    (f"serve {kind}, {shards} shards + router, 1 query a call", sharded, start_sharded,
                     {"shard_batch": 1}),
                    (f"serve {kind}, {shards} shards + router, batched calls", sharded, start_sharded, {}))
            for name, index, starter, extra in runs:
                url = starter({"index": index, "poll_s": 30.0, **extra}, "127.0.0.1", _free_port(), num_replicas=1,
                              num_cpus=0)
                health = _wait_ok(url)
                pids = [s["pid"] for s in health["shards"]] if "shards" in health else [int(health["replica"])]
                _drive(url, queries.numpy(), clients, min(5.0, seconds))   # warm-up
                measured = _drive(url, queries.numpy(), clients, seconds)
                top1 = measured.pop("top1")
                hits = [top1[i] == exact[i] for i in top1]
                rows.append({"method": name, **measured, "recall_of_exact": float(np.mean(hits)) if hits else None,
                             "answered_queries": len(top1),
                             "replica_rss_mib": _rss_mib(pids) if all(pids) else None})
                print(f"  {name}: {measured['qps']:.1f} q/s, p50 {measured['p50_ms']:.1f} ms, "
                      f"{measured['failed']} failed, RSS {rows[-1]['replica_rss_mib']} MiB", flush=True)
                serve.shutdown()
        finally:
            ray.shutdown()
    return rows

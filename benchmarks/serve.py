"""Search service benchmark (a script, not a test): ``python benchmarks/serve.py [--quick]``.

A synthetic clustered gallery (default 100,000 x 512: 1,000 cluster centres plus noise, unit rows) is written as a
gallery index and served by ``compat serve``'s Ray Serve application (one replica, embedding-only: the index's own
version), bound to 127.0.0.1. In one run, interleaved ``--repeats`` times (medians reported):

- kernel: the bare exact kernel in this process on the same prepared gallery (``search_prepared``, one query per
  call, k = 10, the replica's torch thread count), queries per second; also in batches of 16 queries per call
  (the replica batches concurrent requests, up to 16, with ``serve.batch``);
- service, max: ``--clients`` concurrent keep-alive HTTP clients sending one embedding query per request
  (``POST /search``, k = 10) as fast as answered, queries per second;
- service at half the max: an open-loop pacer sending at 50 % of the measured max rate; p50 and p99 latency.

Prints the CPU model, the load average before and after (the machine may be shared: other processes' load
lowers every number), the ratios service/kernel and p99/p50. Writes benchmarks/results/serve.json.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import threading
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def loadavg() -> str:
    try:
        return open("/proc/loadavg").read().split(" ")[:3].__str__()
    except OSError:
        return "unknown"


def clustered(count: int, dim: int, seed: int, centres: int = 1000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centre = rng.standard_normal((centres, dim)).astype(np.float32)
    rows = centre[rng.integers(centres, size=count)] + 0.35 * rng.standard_normal((count, dim)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def write_index(root: str, gallery: np.ndarray, shard_rows: int = 25_000) -> None:
    from cluster.serving.index_store import commit_manifest, new_manifest, shard_table, write_shard

    shards = []
    for start in range(0, gallery.shape[0], shard_rows):
        positions = np.arange(start, min(gallery.shape[0], start + shard_rows))
        shards.append(write_shard(root, shard_table(positions, [f"item-{i}" for i in positions], gallery[positions],
                                                    "1")))
    commit_manifest(root, new_manifest(gallery.shape[1], gallery.shape[0], {"name": "synthetic", "version": "1"},
                                       shards))


def kernel_rate(prepared, queries: np.ndarray, seconds: float, batch: int = 1) -> float:
    from compat_core.retrieval.search import search_prepared

    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        first = done % (len(queries) - batch)
        search_prepared(queries[first:first + batch], prepared, k=10)
        done += batch
    return done / (time.perf_counter() - started)


def _request(connection: http.client.HTTPConnection, body: bytes) -> float:
    started = time.perf_counter()
    connection.request("POST", "/search", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    payload = response.read()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {payload[:200]!r}")
    return time.perf_counter() - started


def service_max_rate(port: int, bodies: list[bytes], clients: int, seconds: float) -> float:
    counts = [0] * clients
    stop = time.perf_counter() + seconds

    def client(slot: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while time.perf_counter() < stop:
            _request(connection, bodies[(slot * 7919 + counts[slot]) % len(bodies)])
            counts[slot] += 1
        connection.close()

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / (time.perf_counter() - started)


def service_latency_at(port: int, bodies: list[bytes], rate: float, seconds: float, senders: int = 4) -> list[float]:
    """Open loop: request i is due at i / rate; each sender takes every senders-th request (its own connection)."""
    latencies: list[float] = []
    lock = threading.Lock()
    total = int(rate * seconds)
    start = time.perf_counter() + 0.2

    def sender(slot: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        for i in range(slot, total, senders):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            due = start + i / rate
            _request(connection, bodies[i % len(bodies)])
            with lock:
                latencies.append(time.perf_counter() - max(due, start))   # from the due time: queueing counts
        connection.close()

    threads = [threading.Thread(target=sender, args=(i,)) for i in range(senders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="20,000 x 512, shorter phases")
    parser.add_argument("--gallery", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the replica and of the kernel")
    parser.add_argument("--precision", default="auto")
    args = parser.parse_args()
    if args.quick:
        args.gallery, args.seconds, args.repeats = 20_000, 4.0, 2

    import ray
    from ray import serve

    from cluster.ray.loopback import LOOPBACK, prepare_loopback
    from cluster.serving.app import start
    from cluster.serving.index_store import load_index
    from compat_core.retrieval.search import PreparedGallery

    print(f"cpu: {cpu_model()}, {os.cpu_count()} logical CPUs; loadavg before: {loadavg()}", flush=True)
    gallery = clustered(args.gallery, args.dim, seed=0)
    queries = clustered(512, args.dim, seed=1)
    bodies = [json.dumps({"embedding": q.tolist(), "k": 10}).encode() for q in queries]
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="compat-serve-bench-") as folder:
        root = os.path.join(folder, "index")
        write_index(root, gallery)
        index = load_index(root)
        prepared = PreparedGallery(torch.nn.functional.normalize(torch.from_numpy(index.embeddings), dim=1),
                                   args.precision)
        prepare_loopback()
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, _node_ip_address=LOOPBACK,
                 configure_logging=False, log_to_driver=False, object_store_memory=200 << 20)
        import socket

        with socket.socket() as probe:
            probe.bind((LOOPBACK, 0))
            port = probe.getsockname()[1]
        start({"index": root, "model": None, "precision": args.precision, "threads": args.threads,
               "poll_s": 60.0}, LOOPBACK, port, num_replicas=1, num_cpus=0, max_ongoing_requests=32)
        connection = http.client.HTTPConnection(LOOPBACK, port, timeout=120)
        deadline = time.monotonic() + 300
        while True:   # first answers also warm the replica's kernel
            try:
                _request(connection, bodies[0])
                break
            except (RuntimeError, OSError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        kernel, kernel16, service, p50, p99, half_rates = [], [], [], [], [], []
        for repeat in range(args.repeats):
            kernel.append(kernel_rate(prepared, queries, args.seconds))
            kernel16.append(kernel_rate(prepared, queries, args.seconds, batch=16))
            service.append(service_max_rate(port, bodies, args.clients, args.seconds))
            half = 0.5 * service[-1]
            latencies = sorted(service_latency_at(port, bodies, half, args.seconds))
            half_rates.append(half)
            p50.append(latencies[len(latencies) // 2])
            p99.append(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))])
            print(f"repeat {repeat + 1}: kernel {kernel[-1]:.1f} q/s (batches of 16: {kernel16[-1]:.1f}), service max {service[-1]:.1f} q/s "
                  f"({service[-1] / kernel[-1]:.2f}x), at {half:.1f} q/s p50 {1000 * p50[-1]:.1f} ms "
                  f"p99 {1000 * p99[-1]:.1f} ms ({p99[-1] / p50[-1]:.2f}x); loadavg {loadavg()}", flush=True)
        serve.shutdown()
        ray.shutdown()
    result = {"gallery": [args.gallery, args.dim], "k": 10, "threads": args.threads, "clients": args.clients,
              "precision": args.precision, "cpu": cpu_model(), "loadavg_after": loadavg(),
              "kernel_qps_median": statistics.median(kernel), "kernel_batch16_qps_median": statistics.median(kernel16),
              "service_qps_median": statistics.median(service),
              "service_over_kernel_median": statistics.median(s / k for s, k in zip(service, kernel)),
              "p50_ms_median": 1000 * statistics.median(p50), "p99_ms_median": 1000 * statistics.median(p99),
              "p99_over_p50_median": statistics.median(b / a for a, b in zip(p50, p99)),
              "service_over_kernel_batch16_median": statistics.median(s / k for s, k in zip(service, kernel16)),
              "raw": {"kernel": kernel, "kernel_batch16": kernel16, "service": service, "half_rate": half_rates, "p50": p50, "p99": p99}}
    print(json.dumps({k: v for k, v in result.items() if k != "raw"}, indent=2))
    out = pathlib.Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    (out / "serve.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

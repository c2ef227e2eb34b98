"""Cluster benchmark (a script, not a test): ``python benchmarks/cluster.py [--quick] [--skip-demo] [--skip-matrix]``.

1. The demo scenario (configs/demo-dsimplex-hoc.yaml) run by the LocalExecutor and by the RayExecutor (embedded
   local Ray, started and stopped inside the timed region, as ``compat run --executor ray`` does), each into a fresh
   run directory. Target: Ray / local <= 1.25. For a like-for-like comparison every training / extraction stage of
   the Ray run reserves all the machine's CPUs (``--stage-cpus``, default os.cpu_count()) and uses that many torch
   threads, the thread count of the local run. ``--quick`` shortens the demo (1 epoch everywhere, 3 tasks).
2. A T=7 compatibility matrix (28 entries, 1:N Recall@1 on synthetic class-clustered fp16 features committed as
   extract stages of a temporary store) computed by 1 and by 2 evaluation actors with one torch thread each; actor
   start-up is excluded (pool warmed first). Target: time(1 actor) / time(2 actors) >= 1.7.

Prints the times and the ratios and writes them to benchmarks/results/cluster.json.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"


def demo_overrides(quick: bool, stage_cpus: int) -> tuple[list[str], list[str]]:
    """(overrides for both runs, extra overrides for the Ray run)."""
    common = []
    if quick:
        common = ["training.epochs=1", "pretrain.0.epochs=1", "pretrain.1.epochs=1", "pretrain.2.epochs=1",
                  "tasks.spec=10+2x15", "replacements=[{at_task: 3, source: 'pretrain:p2'}]"]
    ray_only = [f"resources.{kind}.num_cpus={stage_cpus}" for kind in ("pretrain", "finetune", "extract")]
    return common, ray_only


def run_demo(quick: bool, stage_cpus: int, workdir: pathlib.Path) -> dict:
    import torch

    from cluster.ray_executor import RayExecutor
    from pipelines.config import load_config
    from pipelines.executor import LocalExecutor
    from pipelines.graph import compile_scenario
    from pipelines.store import RunStore

    config_path = ROOT / "configs" / "demo-dsimplex-hoc.yaml"
    common, ray_only = demo_overrides(quick, stage_cpus)
    torch.set_num_threads(stage_cpus)
    # data preparation (glyph rendering into the cache) happens once, outside both timings
    from pipelines.stages import load_pool

    config = load_config(config_path, common)
    load_pool(config.data, "data")

    local_graph = compile_scenario(config)
    started = time.perf_counter()
    local = LocalExecutor(progress=False).run(local_graph, RunStore(workdir / "local"))
    local_s = time.perf_counter() - started

    ray_config = load_config(config_path, common + ray_only)
    ray_graph = compile_scenario(ray_config)
    started = time.perf_counter()
    executor = RayExecutor(progress=False)
    remote = executor.run(ray_graph, RunStore(workdir / "ray"))
    ray_s = time.perf_counter() - started
    same = json.loads((workdir / "local" / "matrix.json").read_text())["values"] == \
        json.loads((workdir / "ray" / "matrix.json").read_text())["values"]
    return {"quick": quick, "stages": len(local_graph), "local_s": local_s, "ray_s": ray_s,
            "ratio_ray_over_local": ray_s / local_s, "target": "<= 1.25", "same_matrix": same,
            "stage_cpus": stage_cpus, "overrides": common, "ray_overrides": ray_only,
            "ray_stats": executor.last_stats, "local_AA": local.metrics["AA"], "ray_AA": remote.metrics["AA"]}


def synthetic_matrix_store(root: pathlib.Path, T: int, rows: int, dim: int, classes: int, seed: int = 0):
    """Commit T query and T gallery feature sets (fp16, class-clustered) as extract stages; returns the entry specs."""
    from cluster.eval_actors import EntrySpec
    from pipelines.graph import entry_key
    from pipelines.store import RunStore, feature_blobs

    store = RunStore(root)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, size=rows)
    for t in range(T):
        centres = np.random.default_rng(1000 + t).normal(size=(classes, dim)) / np.sqrt(dim)
        for split in ("query", "gallery"):
            features = (centres[labels] + rng.normal(scale=1.5 / np.sqrt(dim), size=(rows, dim))).astype(np.float16)
            blobs, layout = feature_blobs(features, labels)
            store.commit(f"extract-t{t:03d}-{split}-bench", {"type": "features", "layout": layout,
                                                             "num_classes_model": 0}, blobs)
    protocol = {"metric": "recall_at_1", "gallery": "instances", "label_level": "fine", "far": 0.001,
                "verification_pairs": 1000}
    specs = []
    for row in range(T):
        for column in range(row + 1):
            query, gallery = f"extract-t{row:03d}-query-bench", f"extract-t{column:03d}-gallery-bench"
            specs.append(EntrySpec(entry_key(query, gallery, protocol, row, column), row, column, query, gallery,
                                   protocol))
    return store, specs


def run_matrix(quick: bool, workdir: pathlib.Path) -> dict:
    import ray

    from cluster.eval_actors import EvaluationPool
    from cluster.ray_executor import connect
    from pipelines.config import load_config

    T = 7
    rows, dim, classes = (3000, 255, 300) if quick else (6000, 511, 600)
    store, specs = synthetic_matrix_store(workdir / "matrix", T, rows, dim, classes)
    config = load_config(ROOT / "configs" / "demo-dsimplex-hoc.yaml")
    owns = connect(None, num_cpus=2)
    timings, values = {}, {}
    try:
        for size in (1, 2):
            for path in (workdir / "matrix" / "manifests").glob("entry-*.json"):
                path.unlink()  # every entry computed again by this pool
            pool = EvaluationPool(store.base, config, size=size, num_cpus=1)
            try:
                ray.get([actor.pid.remote() for actor in pool.actors])  # actors up before the clock starts
                started = time.perf_counter()
                results = pool.compute_all(specs)
                timings[size] = time.perf_counter() - started
            finally:
                pool.shutdown()
            values[size] = {r["key"]: r["value"] for r in results}
            assert all(r["computed"] for r in results) and len(results) == T * (T + 1) // 2
    finally:
        if owns:
            ray.shutdown()
    return {"T": T, "entries": len(specs), "rows": rows, "dim": dim, "one_actor_s": timings[1],
            "two_actors_s": timings[2], "speedup_2_over_1": timings[1] / timings[2], "target": ">= 1.7",
            "same_values": values[1] == values[2], "threads_per_actor": 1}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short demo (1 epoch, 3 tasks), smaller features")
    parser.add_argument("--skip-demo", action="store_true")
    parser.add_argument("--skip-matrix", action="store_true")
    parser.add_argument("--stage-cpus", type=int, default=os.cpu_count() or 1,
                        help="CPUs (= torch threads) per training/extraction stage of both runs")
    args = parser.parse_args()
    report = {"machine": platform.machine(), "cpus": os.cpu_count(),
              "load_average_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="compat-bench-cluster-") as folder:
        workdir = pathlib.Path(folder)
        if not args.skip_matrix:
            report["matrix"] = run_matrix(args.quick, workdir)
            m = report["matrix"]
            print(f"T=7 matrix ({m['entries']} entries, {m['rows']}x{m['dim']} fp16): "
                  f"1 actor {m['one_actor_s']:.2f} s, 2 actors {m['two_actors_s']:.2f} s -> speed-up {m['speedup_2_over_1']:.2f}x (target >= 1.7)")
        if not args.skip_demo:
            report["demo"] = run_demo(args.quick, args.stage_cpus, workdir)
            d = report["demo"]
            print(f"demo ({'quick' if args.quick else 'full'}, {d['stages']} stages): local {d['local_s']:.1f} s, "
                  f"ray {d['ray_s']:.1f} s -> ray/local {d['ratio_ray_over_local']:.2f} (target <= 1.25); "
                  f"same matrix: {d['same_matrix']}")
    report["load_average_after"] = os.getloadavg()
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "cluster-quick.json" if args.quick else "cluster.json"
    (RESULTS / name).write_text(json.dumps(report, indent=2))
    print(f"written {RESULTS / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

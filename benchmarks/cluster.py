"""Cluster benchmark (a script, not a test): ``python benchmarks/cluster.py [--quick] [--skip-demo] [--skip-matrix]``.

1. The demo scenario (configs/demo-dsimplex-hoc.yaml) run by the LocalExecutor and by the RayExecutor (embedded
   local Ray, started and stopped inside the timed region, as ``compat run --executor ray`` does), each into a fresh
   run directory. Target: Ray / local <= 1.25. For a like-for-like comparison every training / extraction stage of
   the Ray run reserves all the machine's CPUs (``--stage-cpus``, default os.cpu_count()) and uses that many torch
   threads, the thread count of the local run. ``--quick`` shortens the demo (1 epoch everywhere, 3 tasks).
2. A T=7 compatibility matrix (28 entry nodes, 1:N Recall@1 on synthetic class-clustered fp16 features committed as
   extract nodes of a temporary store) computed by the engine's Ray backend with at most 1 and at most 2 entry tasks
   at once, one torch thread each; Ray start-up is excluded. Target: time(1) / time(2) >= 1.7.

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

    from cluster.ray.task_backend import RayExecutor
    from pipelines.config.load import load_config
    from pipelines.engine.runner import LocalExecutor
    from pipelines.graph.compile import compile_scenario
    from pipelines.store.run_store import RunStore

    config_path = ROOT / "configs" / "demo-dsimplex-hoc.yaml"
    common, ray_only = demo_overrides(quick, stage_cpus)
    torch.set_num_threads(stage_cpus)
    # data preparation (glyph rendering into the cache) happens once, outside both timings
    from pipelines.stages.pools import load_pool

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


def synthetic_matrix_graph(root: pathlib.Path, config, T: int, rows: int, dim: int, classes: int, seed: int = 0):
    """Commit T query and T gallery feature sets (fp16, class-clustered) as extract nodes of a graph holding only
    them; the matrix's entry and row nodes are added by :func:`pipelines.graph.compile.add_evaluation`."""
    from pipelines.graph.build_inputs import extract_inputs
    from pipelines.graph.compile import Stage, StageGraph, add_evaluation
    from pipelines.graph.stage_kind import StageKind
    from pipelines.store.run_store import RunStore, feature_blobs

    store = RunStore(root)
    graph = StageGraph(config=config, code_version="bench")
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, size=rows)
    for t in range(T):
        centres = np.random.default_rng(1000 + t).normal(size=(classes, dim)) / np.sqrt(dim)
        graph.model_stages.append(f"model-t{t:03d}-bench")
        for split in ("query", "gallery"):
            features = (centres[labels] + rng.normal(scale=1.5 / np.sqrt(dim), size=(rows, dim))).astype(np.float16)
            blobs, layout = feature_blobs(features, labels)
            key = f"extract-t{t:03d}-{split}-bench"
            store.commit(key, {"type": "features", "layout": layout, "num_classes_model": 0}, blobs)
            graph.add(Stage(key, StageKind.EXTRACT, f"extract[t={t},{split}]", extract_inputs(config, t, split), (),
                            config.resources.extract, task=t, split=split))
            graph.extract_stages[(t, split)] = key
    graph.evaluate_stages = add_evaluation(graph, config.evaluation)
    return store, graph


def run_matrix(quick: bool, workdir: pathlib.Path) -> dict:
    """The engine's Ray backend computing the 28 entry nodes with at most 1, then 2, entry tasks at once
    (``resources.evaluation_actors``), one torch thread each, on one Ray instance whose workers are started (by an
    untimed first pass) before the clock."""
    import ray

    from cluster.ray.task_backend import RayExecutor, connect
    from pipelines.config.load import load_config

    T = 7
    rows, dim, classes = (3000, 255, 300) if quick else (6000, 511, 600)
    owns = connect(None, num_cpus=2)
    timings, values = {}, {}
    try:
        for run, size in enumerate((2, 1, 2)):  # the first pass (untimed) starts Ray's worker processes
            config = load_config(ROOT / "configs" / "demo-dsimplex-hoc.yaml",
                                 [f"resources.evaluation_actors={size}", "device=cpu",
                                  "evaluation.label_level=fine"])
            store, graph = synthetic_matrix_graph(workdir / f"matrix-{run}", config, T, rows, dim, classes)
            executor = RayExecutor(progress=False)
            started = time.perf_counter()
            executor.run(graph, store)
            timings[size] = time.perf_counter() - started
            values[size] = [store.load_record(key)["values"] for key in graph.evaluate_stages]
            assert executor.last_stats["computed"] == T * (T + 1) // 2 + T
    finally:
        if owns:
            ray.shutdown()
    specs = range(T * (T + 1) // 2)
    return {"T": T, "entries": len(specs), "rows": rows, "dim": dim, "one_task_s": timings[1],
            "two_tasks_s": timings[2], "speedup_2_over_1": timings[1] / timings[2], "target": ">= 1.7",
            "same_values": values[1] == values[2], "threads_per_task": 1}


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
                  f"1 task at once {m['one_task_s']:.2f} s, 2 at once {m['two_tasks_s']:.2f} s -> speed-up {m['speedup_2_over_1']:.2f}x (target >= 1.7)")
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

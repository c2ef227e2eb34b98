"""Retrieval kernel benchmark (a script, not a test): ``python benchmarks/retrieval.py [--quick]``.

Side by side in one run, on the same data, each method interleaved ``--repeats`` times (medians): the exact kernel
(``precision="auto"``: the candidate arithmetic this machine's calibration measured fastest), the kernel with its
int8 / bf16 / fp32 candidate stages forced, the plain chunked fp32 torch loop, faiss ``IndexFlatIP`` (the reference
code's kernel; optional: ``pip install -e '.[bench]'``, skipped with a message when absent) and scikit-learn brute
force. Prints the machine's calibration (``compat calibrate --show``), the load average before and after, seconds
per entry, the ratio of each method's time to the kernel's, and agreement of each top-1 with an fp64 brute force.

Shapes: CIFAR-like 1:N Recall@1 (Nq=50,000 queries, Ng=10,000 gallery, d=1023) and the CelebA-shaped exact bridge
(Nq=Ng=20,000 embeddings, m=768, heads d=21,999 x 768; its peak memory is measured in a child process). One
"entry" = one full Recall@1 evaluation (one cell of a compatibility matrix). Writes
benchmarks/results/retrieval.{json,csv}.

Data are synthetic. The CIFAR-shaped case is built like real retrieval features, as junction outputs
normalize(h @ A^T) of a bias-free linear junction A (1023 x 512, random) applied to 512-dim embeddings h of 10
classes (close class centres, spread in a 32-dim latent subspace plus isotropic noise; Recall@1 about 0.85, not
1.0), so the features have rank 512 < d and the kernel's exact low-rank path applies. A second case repeats the
shape with full-rank class-clustered features (the kernel's full-d path), so neither figure is mistaken for the
other. More cases: ``simplex`` (d-Simplex-like: unit rows at a set cosine to their class's prototype), ``random``
(unclustered full-rank rows) and, with ``--demo-run RUN --demo-tasks 0,6``, the features a finished run extracted
with each task's model (read with the product's reader; shapes as extracted, ``--demo-tile`` repeats the query
rows). Pruned exact search: "kernel auto" is ``nearest_neighbours`` (k-means groups where its estimate and cost
model say pruning pays), "whole-gallery kernel" the same kernel without pruning, "pruned k-means forced" pruning without
the probe; each case prints how many groups and gallery items a query must search with k-means and with class
groups (a count from the bounds, independent of the machine's load), the load average and the CPU model.
"""
from __future__ import annotations

import argparse
import csv
import json
import multiprocessing
import os
import pathlib
import platform
import resource
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from compat_core.hardware import calibration
from compat_core.retrieval import bridge as retrieval_bridge
from compat_core.retrieval import pruned as retrieval_pruned  # noqa: E402
from compat_core.retrieval import search as retrieval
from compat_core.simplex import dsimplex_rows  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def clustered(count: int, dim: int, classes: int, noise: float, seed: int, centres=None):
    gen = torch.Generator().manual_seed(seed)
    if centres is None:
        centres = torch.nn.functional.normalize(torch.randn(classes, dim, generator=gen), dim=1)
    labels = torch.randint(0, classes, (count,), generator=gen)
    feats = centres[labels] + noise * torch.randn(count, dim, generator=gen) / dim ** 0.5
    return feats.float().contiguous(), labels.numpy(), centres


def junction_clustered(count: int, dim: int, embed: int, seed: int, model_seed: int = 7):
    """Unit junction outputs normalize(h @ A^T), h (count, embed) from 10 close classes; labels (count,)."""
    model = torch.Generator().manual_seed(model_seed)
    centres = 0.4 * torch.randn(10, embed, generator=model) / embed ** 0.5
    latent = torch.randn(32, embed, generator=model) / embed ** 0.5
    head = torch.randn(dim, embed, generator=model) / embed ** 0.5
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (count,), generator=gen)
    h = (centres[labels] + torch.randn(count, 32, generator=gen) @ latent / 32 ** 0.5
         + 0.2 * torch.randn(count, embed, generator=gen) / embed ** 0.5)
    return torch.nn.functional.normalize(h @ head.t(), dim=1).contiguous(), labels.numpy()


def simplex_clustered(count: int, dim: int, classes: int, cosine: float, seed: int):
    """d-Simplex-like features: unit rows at cosine ``cosine`` to their class's d-Simplex prototype (K = dim + 1
    slots, pairwise prototype cosine -1/dim), the rest a random direction orthogonal to it; labels (count,)."""
    vertices = dsimplex_rows(dim + 1, range(classes)).double()
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (count,), generator=gen)
    centre = vertices[labels]
    noise = torch.randn(count, dim, generator=gen, dtype=torch.float64)
    noise -= (noise * centre).sum(dim=1, keepdim=True) * centre
    noise = torch.nn.functional.normalize(noise, dim=1)
    rows = cosine * centre + (1.0 - cosine ** 2) ** 0.5 * noise
    return rows.float().contiguous(), labels.numpy()


def unclustered(count: int, dim: int, seed: int):
    """Full-rank random rows (no cluster structure, nothing for a group bound to skip); random labels of 10."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(count, dim, generator=gen).contiguous(), torch.randint(0, 10, (count,), generator=gen).numpy()


def demo_features(run: str, task: int, side: str):
    """(features (N, D) float32, labels (N,)) of task ``task``'s model on the ``side`` ("query" / "gallery") set of
    a finished run directory, read with the product's reader (``pipelines.stages.feature_store.read_features``)."""
    from pipelines.stages.feature_store import read_features
    from pipelines.store.run_store import RunStore

    store = RunStore(run)
    prefix = f"extract-t{task:03d}-{side}-"
    keys = sorted(name[:-5] for name in os.listdir(os.path.join(run, RunStore.MANIFESTS)) if name.startswith(prefix))
    if len(keys) != 1:
        raise ValueError(f"{run}: expected one {prefix}* extract manifest, found {keys}")
    features, labels, _ = read_features(store, keys[0])
    return torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32)), np.asarray(labels)


def busy_processes(count: int, seconds: float) -> list:
    """``count`` processes that spin a CPU each (plain Python loops), ending by themselves after ``seconds``."""
    import subprocess
    code = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count)]


def timed(fn, repeats: int = 1):
    best = float("inf")
    value = None
    for _ in range(repeats):
        start = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - start)
    return best, value


def fp32_baseline_top1(query, gallery, chunk: int = 2048) -> np.ndarray:
    """Plain chunked fp32 cosine top-1 (max, first index), the obvious implementation."""
    q = torch.nn.functional.normalize(query, dim=1)
    g = torch.nn.functional.normalize(gallery, dim=1).t().contiguous()
    out = []
    for start in range(0, q.shape[0], chunk):
        out.append((q[start:start + chunk] @ g).max(dim=1).indices)
    return torch.cat(out).numpy()


def fp64_top1(query, gallery, chunk: int = 2048) -> np.ndarray:
    q = query.double()
    q = q / q.norm(dim=1, keepdim=True)
    g = gallery.double()
    g = (g / g.norm(dim=1, keepdim=True)).t().contiguous()
    out = []
    for start in range(0, q.shape[0], chunk):
        out.append(np.argmax((q[start:start + chunk] @ g).numpy(), axis=1))   # first index among ties
    return np.concatenate(out)


def sklearn_top1(query, gallery) -> np.ndarray:
    from sklearn.neighbors import NearestNeighbors
    model = NearestNeighbors(n_neighbors=1, metric="cosine", algorithm="brute").fit(gallery.numpy())
    return model.kneighbors(query.numpy(), return_distance=False)[:, 0]


def faiss_module():
    """faiss if installed (``pip install -e .[bench]``), else None."""
    try:
        import faiss
    except ImportError:
        return None
    return faiss


def faiss_top1(query, gallery) -> np.ndarray:
    """faiss ``IndexFlatIP`` (exact inner product; the reference code's kernel) on L2-normalised fp32 rows."""
    faiss = faiss_module()
    faiss.omp_set_num_threads(torch.get_num_threads())
    g = torch.nn.functional.normalize(gallery, dim=1).numpy()
    q = torch.nn.functional.normalize(query, dim=1).numpy()
    index = faiss.IndexFlatIP(g.shape[1])
    index.add(g)
    return index.search(q, 1)[1][:, 0]


AUTO_REPORTS: list = []


def _record_auto_reports() -> None:
    """Record the Report of every ``search_top1`` call (what ``nearest_neighbours``' "auto" decided)."""
    original = retrieval_pruned.search_top1

    def recorded(*args, **kwargs):
        index, score, report = original(*args, **kwargs)
        AUTO_REPORTS.append(report)
        return index, score, report
    retrieval_pruned.search_top1 = recorded


def whole_gallery_top1(query, gallery) -> np.ndarray:
    """The exact kernel over the whole gallery ("auto" stage, live check): ``nearest_neighbours`` before pruning."""
    index, _ = retrieval._whole_gallery(query, gallery, 1, None, "auto", False)
    return index[:, 0].numpy()


def pruned_kmeans_top1(query, gallery) -> np.ndarray:
    """The pruned search with k-means groups, forced (no estimate, no cost model): the pruning's own speed."""
    index, _, _ = retrieval_pruned.search_top1(query, gallery, retrieval._group_search(None), prune="always")
    return index.numpy()


def pruning_rates(query, gallery, labels=None) -> dict:
    """Groups and gallery items each query must search (means over all queries) with k-means groups (labels None)
    or class groups: a count from the proven bounds, independent of the machine's load."""
    with torch.inference_mode():
        groups = retrieval_pruned.group_gallery(gallery, labels)
        need = retrieval_pruned.needed_groups(query, groups).double()
    items = float((need * groups.sizes()).sum(dim=1).mean())
    return {"groups": groups.count, "groups_per_query": float(need.sum(dim=1).mean()), "items_per_query": items,
            "share": items / gallery.shape[0]}


KERNEL_AUTO_DECISIONS: list = []


def kernel_top1(precision: str):
    def run(query, gallery) -> np.ndarray:
        before = len(AUTO_REPORTS)
        index, _ = retrieval.nearest_neighbours(query, gallery, 1, precision=precision, return_scores=False)
        if precision == "auto":
            KERNEL_AUTO_DECISIONS.extend(AUTO_REPORTS[before:])
        return index[:, 0].numpy()
    return run


def recall_path(query, gallery, labels) -> np.ndarray:
    """What a Recall@1 matrix entry runs (``retrieval.recall_at_1``, precision auto): the kernel on the gallery's
    class groups that can hold each answer, or the whole gallery where the probe says pruning does not pay."""
    index, _, report = retrieval_pruned.search_top1(query, gallery, retrieval._group_search(None), labels=labels)
    PRUNE_REPORTS.append(report)
    return index.numpy()


PRUNE_REPORTS: list = []


def case_data(nq: int, ng: int, dim: int, kind: str, cosine: float = 0.85, classes: int = 100,
              demo_tile: int = 1):
    """(query, query labels, gallery, gallery labels, description) of one case. ``kind`` "demo:RUN:TASK": task
    TASK's model's features of run RUN (query rows repeated ``demo_tile`` times; the gallery never is)."""
    if kind.startswith("demo:"):
        _, run, task = kind.split(":")
        query, q_labels = demo_features(run, int(task), "query")
        gallery, g_labels = demo_features(run, int(task), "gallery")
        query, q_labels = query.repeat(demo_tile, 1), np.tile(q_labels, demo_tile)
        tiled = f", query rows repeated {demo_tile}x" if demo_tile > 1 else ""
        return query, q_labels, gallery, g_labels, f"demo features {run} task {task}{tiled}"
    if kind == "simplex":
        query, q_labels = simplex_clustered(nq, dim, classes, cosine, 0)
        gallery, g_labels = simplex_clustered(ng, dim, classes, cosine, 1)
    elif kind == "junction":
        query, q_labels = junction_clustered(nq, dim, 512, 0)
        gallery, g_labels = junction_clustered(ng, dim, 512, 1)
    elif kind == "random":
        query, q_labels = unclustered(nq, dim, 0)
        gallery, g_labels = unclustered(ng, dim, 1)
    else:
        query, q_labels, centres = clustered(nq, dim, 10, 1.0, 0)
        gallery, g_labels, _ = clustered(ng, dim, 10, 1.0, 1, centres)
    names = {"junction": "junction features of rank 512 (realistic)", "full": "full-rank features (10 classes)",
             "simplex": f"d-Simplex-like features ({classes} classes, cosine {cosine} to the prototype)",
             "random": "unclustered full-rank random features"}
    return query, q_labels, gallery, g_labels, names[kind]


def cifar_case(nq: int, ng: int, dim: int, kind: str, methods: dict, repeats: int, cosine: float = 0.85,
               classes: int = 100, demo_tile: int = 1) -> dict:
    """Every method on the same data, interleaved ``repeats`` times; median seconds, ratios to the kernel (auto);
    the pruning rates of k-means and class groups."""
    query, q_labels, gallery, g_labels, description = case_data(nq, ng, dim, kind, cosine, classes, demo_tile)
    nq, ng, dim = query.shape[0], gallery.shape[0], gallery.shape[1]
    rates = {"k-means groups": pruning_rates(query, gallery), "class groups": pruning_rates(query, gallery, g_labels)}
    if rates["k-means groups"]["share"] > 0.5:
        # the bounds leave most of the gallery: forced pruning would take minutes, teaching nothing
        methods = {name: method for name, method in methods.items() if method is not pruned_kmeans_top1}
    ref_index = fp64_top1(query, gallery) if methods else None
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    agree: dict[str, int] = {}
    recall: dict[str, float] = {}
    PRUNE_REPORTS.clear()
    KERNEL_AUTO_DECISIONS.clear()
    loads = [os.getloadavg()[0]]
    for _ in range(repeats):
        for name, method in methods.items():
            print(f"  ... {name} (load {os.getloadavg()[0]:.1f})", flush=True)
            start = time.perf_counter()
            index = method(query, gallery, g_labels) if method is recall_path else method(query, gallery)
            seconds[name].append(time.perf_counter() - start)
            agree[name] = int(np.sum(index == ref_index))
            recall[name] = float(np.mean(g_labels[index] == q_labels))
            loads.append(os.getloadavg()[0])
    medians = {name: float(np.median(values)) for name, values in seconds.items()}
    kernel = medians.get("kernel auto", 1.0)
    report = PRUNE_REPORTS[-1] if PRUNE_REPORTS else None
    return {
        "case": f"recall@1 Nq={nq} Ng={ng} d={dim} {description}",
        "load_1min": {"min": min(loads), "median": float(np.median(loads)), "max": max(loads)},
        "pruning_rates": rates,
        "auto_decisions": [{"pruned": r.pruned, "groups": r.groups, "estimated_share": r.estimated_share}
                           for r in KERNEL_AUTO_DECISIONS],
        "pruning": None if report is None else {
            "pruned": report.pruned, "groups": report.groups, "groups_per_query": report.groups_per_query,
            "items_per_query": report.items_per_query, "estimated_share": report.estimated_share},
        "queries": nq,
        "gflop_nominal": 2.0 * nq * ng * dim / 1e9,
        "recall_at_1_fp64": float(np.mean(g_labels[ref_index] == q_labels)) if methods else None,
        "methods": {name: {"median_s": medians[name], "runs_s": seconds[name], "top1_equal_fp64": agree[name],
                           "recall_at_1": recall[name], "kernel_speedup": medians[name] / kernel}
                    for name in methods},
    }


def bridge_case(nq: int, ng: int, dim: int, embed: int, check_queries: int) -> dict:
    gen = torch.Generator().manual_seed(2)
    classes = max(2, nq // 20)
    q_embed, q_labels, centres = clustered(nq, embed, classes, 1.0, 3)
    g_embed, g_labels, _ = clustered(ng, embed, classes, 1.0, 4, centres)
    head_t = torch.randn(dim, embed, generator=gen) / embed ** 0.5
    head_k = head_t + 0.3 * torch.randn(dim, embed, generator=gen) / embed ** 0.5
    rss_inputs = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds, recall = timed(lambda: retrieval_bridge.bridged_recall_at_1(q_embed, head_t, g_embed, head_k,
                                                                   q_labels, g_labels))
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    index, _ = retrieval_bridge.bridged_nearest_neighbours(q_embed, head_t, g_embed, head_k, 1, return_scores=False)
    # reference: fp64 bridged scores for a subset of queries (the d-dim direct product is what the bridge avoids)
    a_t, a_k = head_t.double(), head_k.double()
    q = q_embed[:check_queries].double()
    g = g_embed.double()
    numerator = (q @ (a_t.t() @ a_k)) @ g.t()
    g_norm = torch.sqrt(((g @ (a_k.t() @ a_k)) * g).sum(1))
    ref = np.argmax((numerator / g_norm).numpy(), axis=1)
    flops = 2.0 * nq * ng * embed
    return {
        "case": f"bridge recall@1 Nq={nq} Ng={ng} d={dim} m={embed}",
        "seconds_per_entry": seconds,
        "gflops": flops / seconds / 1e9,
        "recall_at_1": recall,
        "top1_equal_fp64": int(np.sum(index[:check_queries, 0].numpy() == ref)),
        "queries": check_queries,
        "peak_rss_gb": rss_after * 1024 / 1e9,            # whole process (own process: see main)
        "peak_rss_inputs_gb": rss_inputs * 1024 / 1e9,    # before the evaluation: inputs and interpreter
    }


def _bridge_in_child(args, queue) -> None:
    queue.put(bridge_case(*args))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes for development")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per method; medians reported")
    parser.add_argument("--no-sklearn", action="store_true", help="skip the scikit-learn comparison")
    parser.add_argument("--no-forced", action="store_true", help="skip the kernel with forced int8 / bf16 / fp32 stages")
    parser.add_argument("--no-bridge", action="store_true", help="skip the CelebA-shaped bridge case")
    parser.add_argument("--queries", type=int, default=None,
                        help="Nq of the CIFAR-shaped cases (default 50,000; fewer on a busy machine, same Ng and d)")
    parser.add_argument("--gallery", type=int, default=None, help="Ng of the CIFAR-shaped cases (default 10,000)")
    parser.add_argument("--cases", default="junction,full,simplex",
                        help="comma-separated CIFAR-shaped cases: junction, full, simplex (d-Simplex-like)")
    parser.add_argument("--simplex-cosine", type=float, default=0.85,
                        help="cosine of the d-Simplex-like features to their class prototype")
    parser.add_argument("--demo-run", action="append", default=[],
                        help="a finished run directory: its tasks' extracted features become cases (repeatable)")
    parser.add_argument("--demo-tasks", default="0",
                        help="comma-separated task numbers of --demo-run whose model's features are searched")
    parser.add_argument("--demo-tile", type=int, default=1,
                        help="repeat the demo query rows this many times (the gallery is never repeated)")
    parser.add_argument("--rates-only", action="store_true",
                        help="print the pruning rates of each case and time nothing")
    parser.add_argument("--tag", default="", help="appended to the results' file names")
    parser.add_argument("--no-pruned-forced", action="store_true", help="skip the forced k-means pruning")
    parser.add_argument("--no-recall-path", action="store_true", help="skip recall_at_1's class-group search")
    parser.add_argument("--load", type=int, default=0,
                        help="start this many busy processes (one spinning CPU each) for the whole run")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.quick:
        cifar, bridge = (8000, 4000, 1023), (3000, 3000, 4000, 768)
    else:
        cifar, bridge = (50_000, 10_000, 1023), (20_000, 20_000, 21_999, 768)
    if args.queries is not None:
        cifar = (args.queries, *cifar[1:])
    if args.gallery is not None:
        cifar = (cifar[0], args.gallery, cifar[2])
    busy = busy_processes(args.load, 3600.0)
    try:
        return _run(args, cifar, bridge)
    finally:
        for process in busy:
            process.kill()
            process.wait()


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else platform.processor()."""
    info = pathlib.Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                platform.processor())


def print_row(row: dict) -> None:
    """Print one case's results (as soon as the case is done: a long run keeps what it measured)."""
    print(f"\n{row['case']}")
    if "methods" in row:
        if row["recall_at_1_fp64"] is not None:
            print(f"  fp64 Recall@1 {row['recall_at_1_fp64']:.4f}; {row['gflop_nominal']:.0f} GFLOP nominal")
        print(f"  load average (1 min) during the case: min {row['load_1min']['min']:.1f} median "
              f"{row['load_1min']['median']:.1f} max {row['load_1min']['max']:.1f}; CPU {cpu_model()}")
        for grouping, rate in row["pruning_rates"].items():
            print(f"  {grouping}: {rate['groups']} groups, {rate['groups_per_query']:.2f} groups and "
                  f"{rate['items_per_query']:.0f} items searched per query ({100 * rate['share']:.1f} %)")
        decisions = sorted({(d["pruned"], round(d["estimated_share"], 3)) for d in row["auto_decisions"]})
        print(f"  kernel auto decided (pruned, estimated share): {decisions}")
        if row.get("pruning"):
            prune = row["pruning"]
            print(f"  recall path: pruned {prune['pruned']}, {prune['groups']} groups, "
                  f"{prune['groups_per_query']:.2f} groups and {prune['items_per_query']:.0f} items searched "
                  f"per query (estimate {prune['estimated_share']:.3f} of the gallery)")
        if not row["methods"]:
            return
        print(f"  {'method':20s} {'median s':>9s} {'runs s':>22s} {'x kernel':>9s} {'top1=fp64':>12s}")
        for name, result in row["methods"].items():
            runs = " ".join(f"{value:.2f}" for value in result["runs_s"])
            print(f"  {name:20s} {result['median_s']:9.2f} {runs:>22s} {result['kernel_speedup']:8.2f}x "
                  f"{result['top1_equal_fp64']:>6d}/{row['queries']}")
        medians = {name: result["median_s"] for name, result in row["methods"].items()}
        for name in (name for name in ("kernel auto", "pruned k-means forced") if name in medians):
            print(f"  {name}: " + ", ".join(f"{medians[other] / medians[name]:.2f}x {other}" for other in
                                             ("whole-gallery kernel", "faiss IndexFlatIP", "plain fp32 loop")
                                             if other in medians))
    else:
        for key, value in row.items():
            if key != "case":
                print(f"  {key:32s} {value:.4g}" if isinstance(value, float) else f"  {key:32s} {value}")


def _run(args, cifar, bridge) -> int:
    load_before = os.getloadavg()
    rates = calibration.gemm_rates("cpu")       # measured now when this machine has no cached calibration
    print(calibration.format_calibration(calibration.load("cpu"), calibration.cache_path("cpu")))
    print(f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f} "
          f"({os.cpu_count()} CPUs); torch threads {torch.get_num_threads()}")
    _record_auto_reports()
    methods = {"kernel auto": kernel_top1("auto"), "whole-gallery kernel": whole_gallery_top1}
    if not args.no_pruned_forced:
        methods["pruned k-means forced"] = pruned_kmeans_top1
    if not args.no_recall_path:
        methods["recall path (pruned)"] = recall_path
    if not args.no_forced:
        methods.update({"kernel int8": kernel_top1("int8"), "kernel bf16": kernel_top1("bf16"),
                        "kernel fp32": kernel_top1("fp32")})
    methods["plain fp32 loop"] = fp32_baseline_top1
    if faiss_module() is not None:
        methods["faiss IndexFlatIP"] = faiss_top1
    else:
        print("faiss not installed: skipping faiss IndexFlatIP (pip install -e '.[bench]')")
    if not args.no_sklearn:
        methods["sklearn brute"] = sklearn_top1
    if args.rates_only:
        methods = {}
    kinds = [kind for kind in args.cases.split(",") if kind]
    kinds += [f"demo:{run}:{task}" for run in args.demo_run for task in args.demo_tasks.split(",")]
    rows = []
    for kind in kinds:
        rows.append(cifar_case(*cifar, kind=kind, methods=methods, repeats=args.repeats, cosine=args.simplex_cosine,
                               demo_tile=args.demo_tile))
        print_row(rows[-1])
    if not args.no_bridge:
        # the bridge runs in its own process so that its peak resident memory is its own
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        child = context.Process(target=_bridge_in_child, args=((*bridge, 2000 if not args.quick else 500), queue))
        child.start()
        rows.append(queue.get())
        child.join()
        print_row(rows[-1])
    load_after = os.getloadavg()
    meta = {"threads": torch.get_num_threads(), "torch": torch.__version__, "machine": cpu_model(),
            "calibration_key": calibration.machine_key("cpu"), "gemm_gops": rates,
            "auto_candidate_pass": calibration.fastest_matmul("cpu"), "quick": args.quick,
            "repeats": args.repeats, "load_before": load_before, "load_after": load_after,
            "busy_processes": args.load}
    print(f"\nload average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} "
          f"({args.load} busy processes started by this run)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = ("_quick" if args.quick else "") + (f"_load{args.load}" if args.load else "") + (
        f"_{args.tag}" if args.tag else "")
    (RESULTS / f"retrieval{suffix}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    with open(RESULTS / f"retrieval{suffix}.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["case", "method", "median_s", "kernel_speedup", "top1_equal_fp64", "queries"])
        for row in rows:
            for name, result in row.get("methods", {}).items():
                writer.writerow([row["case"], name, f"{result['median_s']:.4f}", f"{result['kernel_speedup']:.3f}",
                                 result["top1_equal_fp64"], row["queries"]])
    print(f"wrote {RESULTS}/retrieval{suffix}.json and .csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Approximate gallery search benchmark (a script, not a test): ``python benchmarks/serve_ann.py [--rows N]``.

One run on one synthetic gallery (fp16 storage; ``--data clustered``: benchmarks/retrieval.py's ``clustered`` rows,
``--classes`` centres plus noise; ``--data junction``: its rows shaped like trained junction features), measuring for
each method: build seconds, bytes it holds in memory (and their ratio to the raw fp16 rows), queries per second
(batches of ``--batch`` queries per call, as a replica batches concurrent requests; median of ``--repeats``
interleaved passes) and Recall@1 of exact (the fraction of queries whose top-1 row equals the exact kernel's):

- flat: the exact kernel (``search_prepared`` on a ``PreparedGallery``), the baseline of every ratio;
- faiss alone: IVF (fp16 rows) and HNSW, each at the smallest search effort whose own top-1 reaches ``--recall``
  of exact on a held-out tuning sample (the same rule as the product's);
- product: the same structures as candidates (``compat_core.retrieval.ann``), re-ranked exactly, effort chosen by
  ``tune_ann`` on the same tuning sample; IVF and HNSW re-rank from the rows the structure stores (their bytes are
  the structure and 16 bytes a row); plus IVF-PQ (the compressed option, lossy codes), its code size and effort
  chosen by ``--pq-recall`` (``compat_core.retrieval.ann_pq.tune_pq``, as ``compat index build --kind ivfpq`` does),
  re-ranked from the exact kernel's prepared gallery, and faiss IVF-PQ alone at the same target. Bytes are reported
  twice: the structure's ("struct x": what faiss holds) and the product's (what the process holds to answer);
- IVF-PQ re-ranked from a row file: the same codes and effort, the fp16 rows written to a file (``--row-dir``) and
  read per candidate with positioned reads (``compat_core.retrieval.row_file``), each query reading only its
  candidates' rows into a buffer. Its bytes are measured, not assumed: the codes, 8 bytes a row of inverse norms,
  and the file pages mapped in the process after all measured passes (``/proc/self/smaps``; none: nothing is
  mapped); one batch's candidate rows buffer (``--batch`` x candidates x D x 6 bytes, fp16 read + fp32 copy) is
  printed besides, what a search holds while it runs. "warm": the file stays in the kernel's page cache (not the
  process's memory); "(cold)": a second copy of the file whose pages are dropped from the kernel's cache before
  every batch (``RowFile.drop_cache``), so every batch reads its rows from the device;
- ``--shards N``: the gallery split by row range into N parts searched in turn and merged exactly in this process
  (``ann_shards.shard_methods``); with ``--serve``, also served over HTTP by Ray Serve, one replica vs N shard
  deployments behind the router, with the replicas' resident memory (``ann_shards.serve_rates``). On one small
  machine this measures the shard path and its overhead, not scaling.

Tuning and measured queries are disjoint samples of the query distribution. Prints the CPU model, threads, the
load average (the machine may be shared), and the table with ratios to the exact kernel and to faiss alone at the
same recall target, all measured in this run. Writes benchmarks/results/serve_ann.json.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from retrieval import clustered, cpu_model, junction_clustered  # noqa: E402

from compat_core.retrieval.ann import (  # noqa: E402
    STORED_EXACT,
    AnnIndex,
    ann_search,
    build_ann,
    candidate_count,
    effort_ladder,
    recall_of_exact,
    tune_ann,
)
from compat_core.retrieval.ann_pq import tune_pq  # noqa: E402
from compat_core.retrieval.row_file import write_row_file  # noqa: E402
from compat_core.retrieval.search import PreparedGallery, search_prepared  # noqa: E402
from ann_shards import serve_rates, shard_methods  # noqa: E402


def gallery_and_queries(args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gallery fp16 (N, D), tuning queries fp32, measured queries fp32): unit rows, disjoint query samples."""
    count = args.queries + args.tune
    if args.data == "junction":
        gallery, _ = junction_clustered(args.rows, args.dim, 512, 1)
        queries, _ = junction_clustered(count, args.dim, 512, 0)
    else:
        queries, _, centres = clustered(count, args.dim, args.classes, args.noise, 0)
        gallery, _, _ = clustered(args.rows, args.dim, args.classes, args.noise, 1, centres)
    gallery = torch.nn.functional.normalize(gallery.float(), dim=1).half()
    queries = torch.nn.functional.normalize(queries.float(), dim=1)
    return gallery, queries[:args.tune].contiguous(), queries[args.tune:].contiguous()


def prepared_bytes(prepared: PreparedGallery) -> int:
    """Bytes of the tensors the exact kernel's prepared gallery holds (each storage counted once)."""
    space = prepared._space
    tensors = [prepared.gallery, space.stage32, space.half_t]
    if space.projection is not None:
        tensors += [space.projection.basis, space.projection.coords]
    seen, total = set(), 0
    for tensor in tensors:
        if tensor is not None and tensor.untyped_storage().data_ptr() not in seen:
            seen.add(tensor.untyped_storage().data_ptr())
            total += tensor.untyped_storage().nbytes()
    return total


def throughput(search, queries: torch.Tensor, batch: int) -> tuple[float, np.ndarray]:
    """(queries per second, top-1 rows) of ``search(batch_rows) -> top-1 rows`` over all queries in batches."""
    started = time.perf_counter()
    top1 = [np.asarray(search(queries[i:i + batch])) for i in range(0, queries.shape[0], batch)]
    return queries.shape[0] / (time.perf_counter() - started), np.concatenate(top1)


def faiss_top1(ann):
    return lambda rows: ann.index.search(rows.numpy(), 1)[1][:, 0]


def at_effort(ann: AnnIndex, effort: dict, search):
    """``search`` run with ``ann`` at ``effort``: faiss alone and the product share one structure (no second copy
    in memory), each searched at its own tuned effort."""
    def run(rows):
        ann.set_effort(effort)
        return search(rows)
    return run


def tune_faiss_alone(ann, sample: torch.Tensor, exact: np.ndarray, recall: float) -> tuple[dict, float]:
    """The smallest effort of ``ann``'s ladder at which faiss' own top-1 reaches ``recall`` of exact on the tuning
    sample (else the largest); (effort, recall there)."""
    reached = 0.0
    for effort in effort_ladder(ann):
        ann.set_effort(effort)
        reached = recall_of_exact(faiss_top1(ann)(sample), exact)
        if reached >= recall:
            break
    return dict(ann.effort), reached


def build_methods(args, gallery, tune_q) -> tuple[dict, PreparedGallery]:
    """Every method's search function, build seconds, bytes and tuned effort."""
    started = time.perf_counter()
    prepared = PreparedGallery(gallery.float(), "auto")
    flat_seconds = time.perf_counter() - started
    flat_bytes = prepared_bytes(prepared)
    exact_tune = search_prepared(tune_q, prepared, 1, return_scores=False)[0][:, 0].numpy()
    methods = {"flat (exact kernel)": {"build_s": flat_seconds, "bytes": flat_bytes, "structure_bytes": 0,
                                       "effort": {},
                                       "search": lambda rows: search_prepared(rows, prepared, 1, return_scores=False)
                                       [0][:, 0].numpy()}}
    for kind in args.kinds:
        started = time.perf_counter()
        target = args.pq_recall if kind == "ivfpq" else args.recall
        if kind == "ivfpq":   # the code size chosen by the target as compat index build does (tune_pq)
            ann, measured = tune_pq(gallery.float(), prepared, tune_q, target, seed=0)
            print(f"  ivfpq codes tried [sub-vectors, bytes per row, recall, build s]: {measured['pq_curve']}")
        else:
            ann = build_ann(gallery.float(), kind, seed=0)
        seconds = time.perf_counter() - started
        size = ann.bytes_in_memory()
        print(f"  built {kind} {ann.params} in {seconds:.1f} s ({size / 2 ** 20:.1f} MiB)", flush=True)
        effort, reached = tune_faiss_alone(ann, tune_q, exact_tune, target)
        methods[f"faiss {kind} alone"] = {"build_s": seconds, "bytes": size, "structure_bytes": size,
                                          "effort": effort, "tune_recall": reached, "kind": kind,
                                          "search": at_effort(ann, effort, faiss_top1(ann))}
        # the product re-ranks from the structure's own rows where it holds them exactly (ivf, hnsw): it holds the
        # structure and 16 bytes a row; ivfpq's lossy codes need the exact kernel's prepared gallery beside
        stored = kind in STORED_EXACT
        if stored:
            started = time.perf_counter()
            ann.prepare_rerank()
            seconds += time.perf_counter() - started
        if kind != "ivfpq":   # ivfpq was tuned by tune_pq above
            measured = tune_ann(ann, prepared, tune_q, target, from_storage=stored)
        methods[f"{kind} + exact re-rank"] = {
            "build_s": seconds + (0.0 if stored else flat_seconds),
            "bytes": ann.bytes_in_memory() + (0 if stored else flat_bytes), "structure_bytes": size,
            "effort": dict(ann.effort), "tune_recall": measured["recall"], "kind": kind,
            "search": at_effort(ann, dict(ann.effort), lambda rows, a=ann, p=None if stored else prepared:
                                ann_search(rows, p, a, 1)[0][:, 0].numpy())}
        print(f"  tuned {kind}: product {ann.effort} ({measured['recall']:.4f}); faiss alone "
              f"{methods.get(f'faiss {kind} alone', {}).get('effort')}", flush=True)
        if kind == "ivfpq":
            methods.update(row_file_methods(args, gallery, ann, seconds, measured["recall"]))
    return methods, prepared


def row_file_methods(args, gallery, ann: AnnIndex, build_s: float, tune_recall: float) -> dict:
    """IVF-PQ ``ann`` (tuned) re-ranked from fp16 row files read per candidate: warm (the file stays in the
    kernel's page cache) and cold (the file's pages dropped from the cache before every batch)."""
    methods = {}
    for cold in (False, True):
        started = time.perf_counter()
        rows = write_row_file(os.path.join(args.row_dir, f"rows-{os.getpid()}-{int(cold)}.f16"), gallery.numpy())
        copy = AnnIndex.from_bytes(ann.to_bytes(), "ivfpq", ann.params, ann.effort).attach_rows(rows)
        copy.prepare_rerank()     # one pass over the file for the inverse norms, then its pages dropped
        seconds = build_s + time.perf_counter() - started

        def search(batch, a=copy, r=rows, drop=cold):
            if drop:
                r.drop_cache()
            return ann_search(batch, None, a, 1)[0][:, 0].numpy()

        name = "ivfpq + re-rank from row file" + (" (cold)" if cold else "")
        methods[name] = {"build_s": seconds, "bytes": copy.bytes_in_memory(), "structure_bytes": ann.bytes_in_memory(),
                         "effort": dict(copy.effort), "tune_recall": tune_recall, "kind": "ivfpq", "search": search,
                         "row_file": rows, "ann": copy}
    return methods


def settle_row_files(args, methods: dict, queries: torch.Tensor) -> None:
    """The bytes of the row-file methods after the measured passes: codes + inverse norms + the file pages mapped
    in this process (none: reads map nothing); and one batch's candidate rows buffer. Removes the files."""
    raw = args.rows * args.dim * 2
    for name, method in methods.items():
        rows = method.pop("row_file", None)
        if rows is None:
            continue
        anonymous = method.pop("ann").bytes_in_memory()
        resident = rows.mapped_bytes() or 0
        batch = args.batch * candidate_count(1, args.rows, "ivfpq") * args.dim * 6
        method.update({"bytes": anonymous + resident, "anonymous_bytes": anonymous, "resident_file_bytes": resident,
                       "batch_file_bytes": batch})
        print(f"  {name}: codes + inverse norms {anonymous / raw:.3f}x the fp16 rows, file pages mapped after "
              f"the passes {resident / raw:.3f}x, one batch of {args.batch} holds its candidate rows while it runs: "
              f"{batch / 2 ** 20:.2f} MiB ({batch / raw:.4f}x)")
        os.remove(rows.path)


def measure(args, methods: dict, queries: torch.Tensor) -> None:
    """QPS (median of interleaved repeats) and Recall@1 of exact of every method, into ``methods``."""
    exact = None
    for _ in range(args.repeats):
        for name, method in methods.items():
            qps, top1 = throughput(method["search"], queries, args.batch)
            method.setdefault("qps_runs", []).append(qps)
            if name.startswith("flat"):
                exact = top1
            method["top1"] = top1
    for method in methods.values():
        method["qps"] = statistics.median(method["qps_runs"])
        method["recall"] = recall_of_exact(method.pop("top1"), exact)


def table(args, methods: dict) -> list[dict]:
    raw = args.rows * args.dim * 2
    exact_qps = methods["flat (exact kernel)"]["qps"]
    rows = []
    print(f"\n{'method':38} {'build s':>8} {'struct x':>8} {'MiB':>9} {'x fp16':>7} {'q/s':>9} {'x exact':>8} "
          f"{'x faiss':>8} {'R@1 of exact':>13}  effort")
    for name, m in methods.items():
        alone = methods.get(f"faiss {m.get('kind')} alone")
        versus = m["qps"] / alone["qps"] if alone and "re-rank" in name and "shards" not in name else None
        row = {"method": name, "build_s": m["build_s"], "structure_bytes": m["structure_bytes"],
               "structure_vs_fp16": m["structure_bytes"] / raw, "bytes": m["bytes"], "bytes_vs_fp16": m["bytes"] / raw,
               "qps": m["qps"], "qps_vs_exact": m["qps"] / exact_qps, "qps_vs_faiss": versus,
               "recall_of_exact": m["recall"], "effort": m["effort"], "tune_recall": m.get("tune_recall"),
               **{key: m[key] for key in ("anonymous_bytes", "resident_file_bytes", "batch_file_bytes") if key in m}}
        rows.append(row)
        print(f"{name:38} {m['build_s']:8.1f} {m['structure_bytes'] / raw:8.3f} {m['bytes'] / 2 ** 20:9.1f} "
              f"{m['bytes'] / raw:7.2f} {m['qps']:9.0f} "
              f"{row['qps_vs_exact']:8.2f} {'' if versus is None else f'{versus:8.2f}':>8} {m['recall']:13.4f}  "
              f"{m['effort']}")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--data", choices=("clustered", "junction"), default="clustered")
    parser.add_argument("--classes", type=int, default=1000, help="cluster centres (--data clustered)")
    parser.add_argument("--noise", type=float, default=1.0, help="noise norm around a unit centre (clustered)")
    parser.add_argument("--queries", type=int, default=2000, help="measured queries")
    parser.add_argument("--tune", type=int, default=1000, help="held-out tuning queries")
    parser.add_argument("--recall", type=float, default=0.99)
    parser.add_argument("--pq-recall", type=float, default=0.95, help="Recall@1-of-exact target of ivfpq (its "
                        "code size and effort), the issue's floor for the compressed option")
    parser.add_argument("--shards", type=int, default=0, help="also measure the gallery split into this many "
                        "shards: searched in turn and merged in this process (and over Ray Serve with --serve)")
    parser.add_argument("--serve", action="store_true", help="with --shards: also serve the gallery over HTTP "
                        "(one replica, then the shards behind the router) and measure both with --clients threads")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--serve-seconds", type=float, default=20.0)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kinds", default="ivf,hnsw,ivfpq")
    parser.add_argument("--row-dir", default=tempfile.gettempdir(), help="a local folder for the IVF-PQ row files "
                        "(2 D bytes a row each, two of them; removed at the end)")
    args = parser.parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    import faiss

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    print(f"CPU {cpu_model()}, {args.threads} threads, load {os.getloadavg()[0]:.1f}; {args.rows} x {args.dim} "
          f"{args.data} fp16 gallery, {args.queries} measured + {args.tune} tuning queries, batches of {args.batch}, "
          f"Recall@1 target {args.recall} of exact", flush=True)
    gallery, tune_q, queries = gallery_and_queries(args)
    methods, _ = build_methods(args, gallery, tune_q)
    if args.shards:
        methods.update(shard_methods(gallery, tune_q, args.shards, [k for k in args.kinds if k == "ivf"],
                                     args.recall, prepared_bytes))
    measure(args, methods, queries)
    settle_row_files(args, methods, queries)
    rows = table(args, methods)
    served = []
    if args.shards and args.serve:
        exact = methods["flat (exact kernel)"]["search"](queries)
        print(f"\nover HTTP (Ray Serve on this machine, {args.clients} client threads, {args.serve_seconds:.0f} s "
              f"each, load {os.getloadavg()[0]:.1f}):", flush=True)
        served = serve_rates(gallery, tune_q, queries, exact, args.shards, "ivf", args.recall, args.clients,
                             args.serve_seconds)
        base = served[0]["qps"]
        for row in served:
            row["qps_vs_one_replica"] = row["qps"] / base
            print(f"{row['method']:34} {row['qps']:9.1f} q/s {row['qps_vs_one_replica']:6.2f}x  p50 "
                  f"{row['p50_ms']:7.1f} ms  p95 {row['p95_ms']:7.1f} ms  failed {row['failed']}  R@1 of exact "
                  f"{row['recall_of_exact']:.4f}  replica RSS MiB {row['replica_rss_mib']}")
    print(f"load after: {os.getloadavg()[0]:.1f}")
    out = pathlib.Path(__file__).resolve().parent / "results" / "serve_ann.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_model(), "args": vars(args), "date": time.strftime("%Y-%m-%d"),
                               "rows": rows, "served": served, "load_after": os.getloadavg()[0]}, indent=2,
                              default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What one search replica holds, in bytes per gallery row (a script, not a test):
``python benchmarks/serve_memory.py [--rows N] [--dim D] [--kind ivf|hnsw|ivfpq]``.

Builds a gallery index of clustered synthetic unit rows (fp16, the retrieval benchmark's generator) with an
approximate structure, then, each in a fresh process, loads it as a ``compat serve`` replica does and builds the
serving state: once keeping the rows besides the structure (the exact kernel's prepared gallery and the fp32 rows:
``load_index(lean=False)``) and once as the replica now loads an index whose structure holds every row exactly
(``lean=True``: the structure, 16 bytes a row for its re-rank, ids, labels, payload URIs and versions; for
``ivfpq`` the codes, 8 bytes a row, and its row file, read per candidate with nothing mapped). Reports the
process's resident memory growth (VmRSS after the load minus before, after a 2,000-row index of the same kind was
loaded and searched to warm the libraries; MiB and bytes per row) next to the raw fp16 rows (2 D bytes a row), then
answers 1,000 queries in batches of 16 (as a replica batches concurrent requests) in both, checks they agree and
reports the growth again after the first 100 and after all 1,000 (the kernel's page cache of the row file is not
the process's and is not counted).
IVF and HNSW are tuned to Recall@1 of exact 0.99, IVF-PQ to 0.95. Writes benchmarks/results/serve_memory.json.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from retrieval import clustered, cpu_model  # noqa: E402

from cluster.serving.index_build import AnnSettings, build_search_entry  # noqa: E402
from cluster.serving.index_store import commit_manifest, load_index, new_manifest, shard_table, write_shard  # noqa: E402
from cluster.serving.state import build_state  # noqa: E402
from compat_core.retrieval.mixed_gallery import search_groups  # noqa: E402
from pipelines.config.model_uri import ModelUri  # noqa: E402

_SHARD_ROWS = 65536
_BATCH = 16


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def build(root: str, rows: int, dim: int, kind: str, seed: int = 0) -> np.ndarray:
    """Write an index of ``rows`` clustered unit fp16 rows with a ``kind`` structure at ``root``; returns queries."""
    queries, _, centres = clustered(1500, dim, 1000, 1.0, seed)
    gallery, _, _ = clustered(rows, dim, 1000, 1.0, seed + 1, centres)
    features = torch.nn.functional.normalize(gallery.float(), dim=1).half().float().numpy()
    queries = torch.nn.functional.normalize(queries.float(), dim=1).numpy()
    target = 0.95 if kind == "ivfpq" else 0.99
    entry = build_search_entry(root, features, queries[:500], AnnSettings(kind, target, 500, 0), "1", "query", print)
    files = [write_shard(root, shard_table(np.arange(s, min(s + _SHARD_ROWS, rows)),
                                           [f"item-{i:08d}" for i in range(s, min(s + _SHARD_ROWS, rows))],
                                           features[s:s + _SHARD_ROWS], "1",
                                           labels=np.arange(s, min(s + _SHARD_ROWS, rows)) % 1000))
             for s in range(0, rows, _SHARD_ROWS)]
    commit_manifest(root, new_manifest(dim, rows, {"name": "benchmark", "version": "1"}, files, search=entry))
    return queries[500:]


def measure_one(root: str, lean: bool, queries_file: str) -> dict:
    """In this process: RSS growth of loading the index and building the serving state, and the top-5 answers."""
    # a small index of the same kind loaded first: the libraries' own pages and pools are not the gallery's
    warm = build_state(ModelUri("benchmark", "1"), None, load_index(root + "-warm-up", lean=lean), None, "auto")
    search_groups(torch.from_numpy(np.load(queries_file)[:8]), warm.groups, 5)
    gc.collect()
    before = _rss_bytes()
    started = time.perf_counter()
    index = load_index(root, lean=lean)
    state = build_state(ModelUri("benchmark", "1"), None, index, None, "auto")
    gc.collect()
    seconds = time.perf_counter() - started
    grown = _rss_bytes() - before
    queries = torch.from_numpy(np.load(queries_file))
    positions, scores, after = [], [], {}
    count = queries.shape[0]
    bounds = sorted(set(range(0, count, _BATCH)) | {min(100, count), count})   # a measure after exactly 100
    for start, stop in zip(bounds, bounds[1:]):
        found, score, _ = search_groups(queries[start:stop], state.groups, 5)
        positions.append(found)
        scores.append(score)
        if stop in (100, count):
            after[stop] = _rss_bytes() - before
    positions, scores = np.concatenate(positions), np.concatenate(scores)
    return {"lean": lean, "rss_growth_bytes": grown,
            "rss_growth_after_queries_bytes": {str(count): value for count, value in after.items()},
            "load_seconds": seconds, "rows": state.index.size,
            "dim": state.index.dim, "rows_in_structure": state.index.rows_in_structure,
            "positions": positions.tolist(), "scores": scores.tolist()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--kind", choices=("ivf", "hnsw", "ivfpq"), default="ivf")
    parser.add_argument("--measure", nargs=3, metavar=("ROOT", "LEAN", "QUERIES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        root, lean, queries = args.measure
        print(json.dumps(measure_one(root, lean == "1", queries)))
        return 0
    torch.set_num_threads(2)
    load_before = os.getloadavg()[0]
    print(f"CPU: {cpu_model()}; load average before: {load_before:.1f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="serve-memory-") as folder:
        root, queries_file = f"{folder}/index", f"{folder}/queries.npy"
        started = time.perf_counter()
        build(root + "-warm-up", 2000, args.dim, args.kind)
        np.save(queries_file, build(root, args.rows, args.dim, args.kind))
        print(f"built {args.rows} x {args.dim} {args.kind} index in {time.perf_counter() - started:.0f} s", flush=True)
        results = []
        for lean in (False, True):
            out = subprocess.run([sys.executable, __file__, "--measure", root, str(int(lean)), queries_file],
                                 capture_output=True, text=True, timeout=3600)
            if out.returncode != 0:
                raise RuntimeError(f"measuring the load (lean={lean}) failed:\n{out.stderr[-4000:]}")
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    raw = args.rows * args.dim * 2
    for row in results:
        row["bytes_per_row"] = row["rss_growth_bytes"] / args.rows
        row["vs_fp16_rows"] = row["rss_growth_bytes"] / raw
        name = ("structure only (lean)" if args.kind != "ivfpq" else "codes + row file (lean)") if row["lean"] \
            else "structure + prepared gallery + fp32 rows"
        row["bytes_per_row_after_queries"] = {count: grown / args.rows
                                              for count, grown in row["rss_growth_after_queries_bytes"].items()}
        after = "; ".join(f"after {count} queries {per_row:.0f} B/row ({per_row * args.rows / raw:.3f}x)"
                          for count, per_row in row["bytes_per_row_after_queries"].items())
        print(f"{name:42} {row['rss_growth_bytes'] / 2**20:9.1f} MiB  {row['bytes_per_row']:8.0f} B/row  "
              f"{row['vs_fp16_rows']:5.3f}x the fp16 rows ({2 * args.dim} B/row)  load {row['load_seconds']:.1f} s; "
              f"{after}")
    same = results[0]["positions"] == results[1]["positions"]
    gap = float(np.max(np.abs(np.asarray(results[0]["scores"]) - np.asarray(results[1]["scores"]))))
    print(f"top-5 of {len(results[0]['positions'])} queries equal: {same}; largest score difference {gap:.2e}; "
          f"lean / before memory {results[1]['rss_growth_bytes'] / results[0]['rss_growth_bytes']:.3f}; "
          f"load {os.getloadavg()[0]:.1f}")
    out = pathlib.Path(__file__).resolve().parent / "results" / "serve_memory.json"
    out.parent.mkdir(exist_ok=True)
    for row in results:
        row.pop("positions"), row.pop("scores")
    out.write_text(json.dumps({"cpu": cpu_model(), "args": vars(args), "date": time.strftime("%Y-%m-%d"),
                               "raw_fp16_bytes": raw, "rows": results, "answers_equal": same,
                               "max_score_difference": gap, "load_before": load_before,
                               "load_after": os.getloadavg()[0]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

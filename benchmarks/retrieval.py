"""Retrieval kernel benchmark (a script, not a test): ``python benchmarks/retrieval.py [--quick]``.

Shapes: CIFAR-like 1:N Recall@1 (Nq=50,000 queries, Ng=10,000 gallery, d=1023) and the CelebA-shaped exact bridge
(Nq=Ng=20,000 embeddings, m=768, heads d=21,999 x 768). One "entry" = one full Recall@1 evaluation (one cell of a
compatibility matrix). Prints seconds per entry, GFLOP/s (2 Nq Ng d / s), this run's measured fp32/bf16 matmul peaks,
speed-ups over a plain fp32 chunked baseline and scikit-learn brute force, agreement with an fp64 brute force and
peak memory (ru_maxrss of a process that runs only the bridge); writes the table to benchmarks/results/retrieval.{json,csv}.

Data are synthetic. The CIFAR-shaped case is built like real retrieval features, as junction outputs
normalize(h @ A^T) of a bias-free linear junction A (1023 x 512, random) applied to 512-dim embeddings h of 10
classes (close class centres, spread in a 32-dim latent subspace plus isotropic noise; Recall@1 about 0.85, not
1.0), so the features have rank 512 < d and the kernel's exact low-rank path applies. A second line repeats the
shape with full-rank class-clustered features (the kernel's full-d path), so neither figure is mistaken for the
other.
"""
from __future__ import annotations

import argparse
import csv
import json
import multiprocessing
import pathlib
import platform
import resource
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from compat_core import retrieval  # noqa: E402
from compat_core.device import fast_matmul_dtype  # noqa: E402

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


def timed(fn, repeats: int = 1):
    best = float("inf")
    value = None
    for _ in range(repeats):
        start = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - start)
    return best, value


def matmul_peak(dtype: torch.dtype, n: int) -> float:
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    a @ b
    seconds, _ = timed(lambda: a @ b, 3)
    return 2 * n ** 3 / seconds / 1e9


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


def cifar_case(nq: int, ng: int, dim: int, with_sklearn: bool, junction: bool) -> dict:
    if junction:
        query, q_labels = junction_clustered(nq, dim, 512, 0)
        gallery, g_labels = junction_clustered(ng, dim, 512, 1)
    else:
        query, q_labels, centres = clustered(nq, dim, 10, 1.0, 0)
        gallery, g_labels, _ = clustered(ng, dim, 10, 1.0, 1, centres)
    flops = 2.0 * nq * ng * dim
    seconds, recall = timed(lambda: retrieval.recall_at_1(query, q_labels, gallery, g_labels))
    index, _ = retrieval.nearest_neighbours(query, gallery, 1, return_scores=False)
    base_seconds, base_index = timed(lambda: fp32_baseline_top1(query, gallery))
    ref_index = fp64_top1(query, gallery)
    ours = index[:, 0].numpy()
    row = {
        "case": (f"recall@1 Nq={nq} Ng={ng} d={dim} "
                 + ("junction features of rank 512 (realistic)" if junction else "full-rank features")),
        "seconds_per_entry": seconds,
        "gflops": flops / seconds / 1e9,
        "recall_at_1": recall,
        "recall_at_1_fp64": float(np.mean(g_labels[ref_index] == q_labels)),
        "top1_equal_fp64": int(np.sum(ours == ref_index)),
        "queries": nq,
        "fp32_baseline_seconds": base_seconds,
        "fp32_baseline_top1_equal_fp64": int(np.sum(base_index == ref_index)),
        "speedup_vs_fp32_baseline": base_seconds / seconds,
    }
    if with_sklearn:
        sk_seconds, sk_index = timed(lambda: sklearn_top1(query, gallery))
        row["sklearn_seconds"] = sk_seconds
        row["speedup_vs_sklearn"] = sk_seconds / seconds
        row["sklearn_top1_equal_fp64"] = int(np.sum(sk_index == ref_index))
    return row


def bridge_case(nq: int, ng: int, dim: int, embed: int, check_queries: int) -> dict:
    gen = torch.Generator().manual_seed(2)
    classes = max(2, nq // 20)
    q_embed, q_labels, centres = clustered(nq, embed, classes, 1.0, 3)
    g_embed, g_labels, _ = clustered(ng, embed, classes, 1.0, 4, centres)
    head_t = torch.randn(dim, embed, generator=gen) / embed ** 0.5
    head_k = head_t + 0.3 * torch.randn(dim, embed, generator=gen) / embed ** 0.5
    rss_inputs = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds, recall = timed(lambda: retrieval.bridged_recall_at_1(q_embed, head_t, g_embed, head_k,
                                                                   q_labels, g_labels))
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    index, _ = retrieval.bridged_nearest_neighbours(q_embed, head_t, g_embed, head_k, 1, return_scores=False)
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
    parser.add_argument("--no-sklearn", action="store_true", help="skip the scikit-learn comparison")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.quick:
        cifar, bridge, peak_n = (8000, 4000, 1023), (3000, 3000, 4000, 768), 1024
    else:
        cifar, bridge, peak_n = (50_000, 10_000, 1023), (20_000, 20_000, 21_999, 768), 4096
    peaks = {"fp32_matmul_gflops": matmul_peak(torch.float32, peak_n),
             "bf16_matmul_gflops": matmul_peak(torch.bfloat16, peak_n)}
    # the bridge runs in its own process so that its peak resident memory is its own
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_bridge_in_child, args=((*bridge, 2000 if not args.quick else 500), queue))
    child.start()
    bridge_row = queue.get()
    child.join()
    rows = [cifar_case(*cifar, with_sklearn=not args.no_sklearn, junction=True),
            cifar_case(*cifar, with_sklearn=False, junction=False), bridge_row]
    meta = {"threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.processor(),
            "half_dtype": str(fast_matmul_dtype("cpu")), "quick": args.quick, **peaks}
    print(f"threads={meta['threads']} half={meta['half_dtype']} fp32 peak {peaks['fp32_matmul_gflops']:.0f} "
          f"GFLOP/s, bf16 peak {peaks['bf16_matmul_gflops']:.0f} GFLOP/s ({peak_n}^3 matmul)")
    for row in rows:
        print(f"\n{row['case']}")
        for key, value in row.items():
            if key != "case":
                print(f"  {key:32s} {value:.4g}" if isinstance(value, float) else f"  {key:32s} {value}")
        row["gflops_fraction_of_bf16_peak"] = row["gflops"] / peaks["bf16_matmul_gflops"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = "_quick" if args.quick else ""
    (RESULTS / f"retrieval{suffix}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    keys = sorted({key for row in rows for key in row})
    with open(RESULTS / f"retrieval{suffix}.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    print(f"\nwrote {RESULTS}/retrieval{suffix}.json and .csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

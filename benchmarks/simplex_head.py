"""The d-Simplex head at the CelebA job's shape: the closed form the model uses against the explicit product with
the materialised prototype matrix (what the model computed before), forward + backward, same run, same thread count.

    python benchmarks/simplex_head.py                  # K = 22,000, batch 64, 1 thread, bf16 and fp32 inputs
    python benchmarks/simplex_head.py --slots 2000 --batch 320 --threads 2

Prints seconds per forward + backward (median of --repeats), the ratio, the largest logit difference against an
fp64 product, and the memory each needs beyond its inputs (the prototypes: K x (K-1) x 4 bytes for the product).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compat_core.simplex import dsimplex, dsimplex_logits  # noqa: E402


def _time(step, repeats: int) -> float:
    step()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=22000, help="K")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    K, B = args.slots, args.batch
    generator = torch.Generator().manual_seed(0)
    targets = torch.randint(0, K, (B,), generator=generator)
    prototypes = dsimplex(K)  # what the model held before (fp32, K x (K-1))
    print(f"K = {K}, batch {B}, {args.threads} thread(s); prototypes {prototypes.numel() * 4 / 2**30:.2f} GiB fp32")
    for dtype in (torch.bfloat16, torch.float32):
        projection = torch.randn(B, K - 1, generator=generator).to(dtype).requires_grad_(True)

        def explicit() -> None:
            weights = prototypes if dtype == torch.float32 else prototypes.to(dtype)  # the bf16 copy per forward
            logits = projection @ weights.T
            torch.nn.functional.cross_entropy(logits.float(), targets).backward()
            projection.grad = None

        def closed() -> None:
            logits = dsimplex_logits(projection.float(), K)
            torch.nn.functional.cross_entropy(logits, targets).backward()
            projection.grad = None

        seconds = {}
        for name, step in (("explicit", explicit), ("closed", closed), ("explicit", explicit), ("closed", closed)):
            seconds.setdefault(name, []).append(_time(step, args.repeats))
        best = {name: min(values) for name, values in seconds.items()}
        with torch.no_grad():
            reference = projection.double() @ prototypes.double().T
            error = (dsimplex_logits(projection.float(), K).double() - reference).abs().max().item()
        print(f"{str(dtype).split('.')[-1]:9s} explicit {best['explicit'] * 1e3:9.1f} ms   closed form "
              f"{best['closed'] * 1e3:7.2f} ms   {best['explicit'] / best['closed']:7.1f}x   "
              f"max |closed - fp64 product| {error:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

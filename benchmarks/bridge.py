"""CelebA-shaped matrix entry: direct d-dim features against the exact linear-head bridge (m-dim embeddings + heads).

CelebA config shape: d = K - 1 = 21,999 feature dimensions, m = 768 embedding width (ViT-B/16). Both ways in one
run on the same random embeddings and heads (features = A e, L2-normalised), fp16 storage as the run store keeps
features. Prints storage per image per model, seconds per entry (median of ``--repeats``) and checks that both
give the same Recall@1. Usage::

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bridge --query 2000 --gallery 2000
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--query", type=int, default=2000)
    parser.add_argument("--gallery", type=int, default=2000)
    parser.add_argument("--dim", type=int, default=21999, help="d = K - 1")
    parser.add_argument("--embed", type=int, default=768, help="m")
    parser.add_argument("--classes", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from compat_core.retrieval import bridged_recall_at_1, recall_at_1

    generator = torch.Generator().manual_seed(0)
    d, m = args.dim, args.embed
    head_old = torch.randn(d, m, generator=generator) / m ** 0.5
    head_new = head_old + 0.1 * torch.randn(d, m, generator=generator) / m ** 0.5
    centres = torch.randn(args.classes, m, generator=generator)
    q_labels = np.arange(args.query) % args.classes
    g_labels = np.arange(args.gallery) % args.classes
    query_embed = (centres[q_labels] + 3.0 * torch.randn(args.query, m, generator=generator)).half()
    gallery_embed = (centres[g_labels] + 3.0 * torch.randn(args.gallery, m, generator=generator)).half()
    # what the direct path stores: the normalised d-dim features, fp16
    query_features = torch.nn.functional.normalize(query_embed.float() @ head_new.T, dim=1).half()
    gallery_features = torch.nn.functional.normalize(gallery_embed.float() @ head_old.T, dim=1).half()

    def timed(run) -> tuple[float, float]:
        values, result = [], None
        for _ in range(args.repeats):
            started = time.perf_counter()
            result = run()
            values.append(time.perf_counter() - started)
        return statistics.median(values), result

    direct_s, direct = timed(lambda: recall_at_1(query_features.float(), q_labels, gallery_features.float(), g_labels))
    bridge_s, bridged = timed(lambda: bridged_recall_at_1(query_embed.float(), head_new, gallery_embed.float(),
                                                          head_old, q_labels, g_labels))
    images = args.gallery
    direct_bytes = d * 2
    bridge_bytes = m * 2 + d * m * 4 / images  # embedding fp16 + the fp32 head shared by every image of the model
    print(f"shape: {args.query} queries x {args.gallery} gallery, d={d}, m={m}; threads {torch.get_num_threads()}")
    print(f"direct: {direct_bytes / 1024:.1f} KiB per image per model, {direct_s:.2f} s per entry, R@1 {direct:.4f}")
    print(f"bridge: {bridge_bytes / 1024:.1f} KiB per image per model (head amortised over {images} images; "
          f"{m * 2 / 1024:.1f} KiB + head {d * m * 4 / 2**20:.0f} MiB per model), {bridge_s:.2f} s per entry, "
          f"R@1 {bridged:.4f}")
    print(f"ratios direct/bridge: storage {direct_bytes / bridge_bytes:.1f}x (embeddings only "
          f"{direct_bytes / (m * 2):.1f}x), time {direct_s / bridge_s:.1f}x")


if __name__ == "__main__":
    main()

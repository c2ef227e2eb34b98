"""CelebA-shaped matrix entry through the pipeline: direct d-dim features against the exact linear-head bridge.

CelebA config shape (configs/iam-cl2r-celeba-dinov3-t16.yaml): d = K - 1 = 21,999, m = 768 (ViT-B/16). Two model
stages (their ``model.safetensors`` hold the junction weights A, as a trained model's do) and four extract stages
are committed to a run store in a temporary folder: query/gallery features of the direct way (fp16, the default
``feature_dtype``) and query/gallery embeddings of the bridge way (fp16), written by the pipeline's own helpers
(``feature_blobs``, ``bridge_features.bridge_blobs``). Each entry is computed by ``pipelines.stages.bridge_features
.entry_value``, the function the entry stage calls, cold (its per-process caches cleared: the store is read and
verified as a fresh entry worker does) and warm (a row's query and heads already read). Prints bytes stored per
image per model, seconds per entry (median of ``--repeats``), both Recall@1 values and the ratios. Usage::

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bridge --query 2000 --gallery 2000
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def _commit_models(store, heads: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save

    for key, head in heads.items():
        store.commit(key, {"type": "model", "stage_key": key}, {"model.safetensors": save({"junction.weight": head})})


def _commit_extract(store, key: str, model_key: str, blobs: dict, layout: dict):
    from pipelines.records.stage_records import FeatureRecord, record_to_json

    record = FeatureRecord(key, 0, "query", key, layout, num_classes_model=0, seconds=0.0, images_per_second=0.0,
                           model_stage_key=model_key)
    store.commit(key, record_to_json(record), blobs)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--query", type=int, default=2000)
    parser.add_argument("--gallery", type=int, default=2000)
    parser.add_argument("--classes", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from compat_core.models.backbones import embedding_width
    from pipelines.config.load import load_config
    from pipelines.stages import bridge_features, feature_store
    from pipelines.stages.feature_store import _FEATURE_CACHE
    from pipelines.store.run_store import RunStore, feature_blobs

    config = load_config(Path(__file__).parents[1] / "configs" / "iam-cl2r-celeba-dinov3-t16.yaml")
    d = config.model.num_slots - 1
    m = embedding_width(config.model.backbone, config.model.backbone_config)
    protocol = {"metric": "recall_at_1", "gallery": "instances", "label_level": "fine", "far": 1e-3,
                "verification_pairs": 3000}
    generator = torch.Generator().manual_seed(0)
    head_old = torch.randn(d, m, generator=generator) / m ** 0.5
    head_new = head_old + 0.1 * torch.randn(d, m, generator=generator) / m ** 0.5
    centres = torch.randn(args.classes, m, generator=generator)
    q_labels = np.arange(args.query) % args.classes
    g_labels = np.arange(args.gallery) % args.classes
    query_embed = (centres[q_labels] + 3.0 * torch.randn(args.query, m, generator=generator)).half().numpy()
    gallery_embed = (centres[g_labels] + 3.0 * torch.randn(args.gallery, m, generator=generator)).half().numpy()
    # what the direct extract stores: the model's d-dim features, here A h of the same embeddings
    query_features = (torch.from_numpy(query_embed).float() @ head_new.T).numpy()
    gallery_features = (torch.from_numpy(gallery_embed).float() @ head_old.T).numpy()
    dtype = config.evaluation.feature_dtype

    with tempfile.TemporaryDirectory(prefix="bridge-bench-") as folder:
        store = RunStore(folder)
        _commit_models(store, {"model-new": head_new, "model-old": head_old})
        direct = [_commit_extract(store, "direct-q", "model-new", *feature_blobs(query_features, q_labels, None, dtype)),
                  _commit_extract(store, "direct-g", "model-old",
                                  *feature_blobs(gallery_features, g_labels, None, dtype))]
        bridge = [_commit_extract(store, "bridge-q", "model-new",
                                  *bridge_features.bridge_blobs(query_embed, "model-new", d, q_labels, None, dtype)),
                  _commit_extract(store, "bridge-g", "model-old",
                                  *bridge_features.bridge_blobs(gallery_embed, "model-old", d, g_labels, None,
                                                                dtype))]

        def stored_bytes(key: str, rows: int) -> float:
            blobs = store.load_manifest(key)["blobs"]
            return sum(info["size"] for name, info in blobs.items() if name != "labels.npy") / rows

        def timed(records: list, cold: bool) -> tuple[float, float, dict]:
            values, result = [], None
            for _ in range(args.repeats):
                if cold:
                    _FEATURE_CACHE.clear()
                    for cache in (feature_store._HEADS, feature_store._GRAMS, feature_store._EMBEDDINGS):
                        cache.clear()
                started = time.perf_counter()
                result = bridge_features.entry_value(store, config, records[0], records[1], protocol, [])
                values.append(time.perf_counter() - started)
            return statistics.median(values), result[0], result[1]

        direct_cold, direct_value, direct_how = timed(direct, True)
        bridge_cold, bridge_value, bridge_how = timed(bridge, True)
        direct_warm, _, _ = timed(direct, False)
        bridge_warm, _, _ = timed(bridge, False)
        direct_bytes = stored_bytes("direct-g", args.gallery)
        bridge_bytes = stored_bytes("bridge-g", args.gallery)
    head_bytes = d * m * 4
    print(f"shape: {args.query} queries x {args.gallery} gallery, d={d}, m={m}, {dtype}; torch threads "
          f"{torch.get_num_threads()}; entries by pipelines.stages.bridge_features.entry_value")
    print(f"direct ({direct_how['way']}): {direct_bytes:.0f} B per image per model stored, entry {direct_cold:.2f} s "
          f"cold / {direct_warm:.2f} s warm, R@1 {direct_value:.4f}")
    print(f"bridge ({bridge_how['way']}, {bridge_how['kernel']}): {bridge_bytes:.0f} B per image per model stored "
          f"(+ the head A, {head_bytes / 2**20:.1f} MiB, already in the model weights; "
          f"{bridge_bytes + head_bytes / args.gallery:.0f} B if it were counted over these {args.gallery} images), "
          f"entry {bridge_cold:.2f} s cold / {bridge_warm:.2f} s warm, R@1 {bridge_value:.4f}")
    print(f"ratios direct/bridge: storage {direct_bytes / bridge_bytes:.1f}x, time cold "
          f"{direct_cold / bridge_cold:.1f}x, warm {direct_warm / bridge_warm:.1f}x; same R@1: "
          f"{direct_value == bridge_value}")


if __name__ == "__main__":
    main()

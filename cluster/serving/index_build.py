"""``compat index build``: embed a data pool with one registered model version and write it as a gallery index,
with an approximate search structure (``--kind ivf | hnsw | ivfpq``) whose search effort is chosen by measured
Recall@1 of exact on a held-out sample of the other evaluation pool (embedded by the same version)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from cluster.model_registry.serving_indexes import record_serving_index
from cluster.model_registry.versions import MlflowModelResolver
from cluster.serving.index_store import (
    commit_manifest,
    new_manifest,
    shard_table,
    write_ann,
    write_row_file_blob,
    write_shard,
)
from cluster.serving.models import load_served_model, resolve_model_ref
from cluster.serving.shards import write_sharded_index
from compat_core.retrieval.ann import KINDS, build_ann, candidate_rule, stored_fp16_rows, tune_ann
from compat_core.retrieval.ann_pq import tune_pq
from compat_core.retrieval.mixed_gallery import unit_rows
from compat_core.retrieval.search import PreparedGallery
from pipelines.stages.context import resolve_device
from pipelines.stages.extraction import extract_pool_features
from pipelines.stages.pools import load_pool

__all__ = ["build_index", "build_search_entry", "evaluation_labels", "pool_image_spec", "pool_of", "AnnSettings"]


@dataclass(frozen=True)
class AnnSettings:
    """What ``--kind``, ``--recall``, ``--sample`` and ``--seed`` ask of the build: the structure's kind, the
    Recall@1 of exact its search effort must reach (a fraction), the held-out query sample's size and seed."""

    kind: str = "flat"
    recall: float = 0.99
    sample: int = 1000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"--kind {self.kind!r}: expected one of {', '.join(KINDS)}")
        if not 0.0 < float(self.recall) <= 1.0:
            raise ValueError(f"--recall {self.recall}: expected a fraction of exact Recall@1 in (0, 1]")
        if self.sample < 1:
            raise ValueError(f"--sample {self.sample}: expected a positive number of held-out queries")


def pool_of(config: Any, pool: str):
    """The pool spec named ``pool`` (gallery | query: the config's evaluation sets) and its key for messages."""
    keys = {"gallery": "evaluation.gallery_set", "query": "evaluation.query_set"}
    if pool not in keys:
        raise ValueError(f"--pool {pool!r}: expected one of {sorted(keys)}")
    spec = config.evaluation.gallery_set if pool == "gallery" else config.evaluation.query_set
    return spec, load_pool(spec, keys[pool])


def evaluation_labels(config: Any, source: Any) -> np.ndarray:
    """The pool's labels at the config's ``evaluation.label_level`` (the coarse labels for 'coarse'), as the
    evaluation compares them: what the index stores and the backfill probe scores, so its Recall@1 is the
    evaluation's."""
    if config.evaluation.label_level == "coarse":
        coarse = getattr(source, "coarse_labels", None)
        if coarse is None:
            raise ValueError("evaluation.label_level: 'coarse' needs a dataset with coarse labels (this one has none)")
        return np.asarray(coarse, dtype=np.int64)
    return np.asarray(source.labels, dtype=np.int64)


def pool_image_spec(source: Any) -> dict:
    """The preprocessing a query image needs to match the indexed pool: shape (H, W, C), mean, std."""
    return {"shape": [int(x) for x in source.image_shape], "mean": [float(x) for x in source.mean],
            "std": [float(x) for x in source.std]}


def build_index(root: str, config: Any, model_uri: str, tracking_uri: str, pool: str = "gallery",
                shard_rows: int = 4096, payload_prefix: str | None = None, cache_dir: str | None = None,
                log: Callable[[str], None] = print, ann: AnnSettings = AnnSettings(),
                shards: int = 1) -> tuple[str, dict]:
    """Embed the pool with the version behind ``model_uri`` (the extraction the pipeline uses) and commit an index
    at ``root``; returns (manifest sha256, manifest). payload_prefix: item i gets payload URI ``<prefix>/<i>``.
    ann: the approximate structure to build beside the shards (kind "flat": none, the exact kernel alone).
    shards > 1: split the gallery by row range into that many indexes of their own (``cluster.serving.shards``);
    returns (the shard set's sha256, the shard set)."""
    if shards < 1:
        raise ValueError(f"--shards: expected a positive number of shards, got {shards}")
    if shard_rows < 1:
        raise ValueError(f"--shard-rows: expected a positive number of rows, got {shard_rows}")
    if not isinstance(ann, AnnSettings):
        raise TypeError(f"ann: expected AnnSettings, got {type(ann).__name__}")
    resolver = MlflowModelResolver(tracking_uri, cache_dir=cache_dir)
    ref = resolve_model_ref(resolver.client, model_uri)
    spec, source = pool_of(config, pool)
    device = resolve_device(config.device)
    model = load_served_model(resolver, ref, device)
    started = time.perf_counter()
    features = extract_pool_features(model, source, config, device)
    log(f"index: {features.shape[0]} x {features.shape[1]} embeddings by {ref.uri} in "
        f"{time.perf_counter() - started:.1f} s")
    labels = evaluation_labels(config, source)
    other = "query" if pool == "gallery" else "gallery"
    held_out = extract_pool_features(model, pool_of(config, other)[1], config, device) if ann.kind != "flat" else None
    if shards > 1:
        def part_search(where, rows):
            return (build_search_entry(where, rows, held_out, ann, ref.version, other, log) if held_out is not None
                    else {"kind": "flat"})

        committed = write_sharded_index(root, features, shards, {"name": ref.name, "version": ref.version},
                                        search=part_search, labels=labels, shard_rows=shard_rows,
                                        payload_prefix=payload_prefix, log=log, image=pool_image_spec(source),
                                        pool=spec.model_dump(mode="json"))
        record_serving_index(resolver.client, ref.name, root)  # a rollback checks its targets against it
        return committed
    files = []
    for start in range(0, features.shape[0], shard_rows):
        stop = min(features.shape[0], start + shard_rows)
        positions = np.arange(start, stop)
        payloads = [f"{payload_prefix.rstrip('/')}/{i}" for i in positions] if payload_prefix else None
        files.append(write_shard(root, shard_table(positions, [str(i) for i in positions], features[start:stop],
                                                    ref.version, payloads, labels[start:stop])))
    search = {"kind": "flat"}
    if held_out is not None:
        search = build_search_entry(root, features, held_out, ann, ref.version, other, log)
    manifest = new_manifest(features.shape[1], features.shape[0], {"name": ref.name, "version": ref.version},
                            files, image=pool_image_spec(source), pool=spec.model_dump(mode="json"), search=search)
    digest = commit_manifest(root, manifest)
    record_serving_index(resolver.client, ref.name, root)  # a rollback checks its targets against it
    log(f"index: {len(files)} shards, manifest {digest[:12]} at {root}")
    return digest, manifest




def build_search_entry(root: str, features: np.ndarray, held_out: np.ndarray, ann: AnnSettings, version: str,
                       sample_pool: str = "query", log: Callable[[str], None] = print) -> dict:
    """Build ``ann.kind``'s structure over ``features`` (N, D) (L2-normalised), choose its search effort on a
    seeded sample of ``held_out`` query rows, store its bytes at ``root``; returns the manifest's "search" entry."""
    started = time.perf_counter()
    gallery = unit_rows(features)
    take = min(ann.sample, held_out.shape[0])
    rows = np.sort(np.random.default_rng(ann.seed).choice(held_out.shape[0], take, replace=False))
    if ann.kind == "ivfpq":   # the code size too is chosen by the recall target (the smallest that reaches it)
        structure, measured = tune_pq(gallery, PreparedGallery(gallery), held_out[rows], ann.recall, ann.seed)
        built = sum(entry[3] for entry in measured["pq_curve"])
    else:
        structure = build_ann(gallery, ann.kind, seed=ann.seed)
        built = time.perf_counter() - started
        measured = tune_ann(structure, PreparedGallery(gallery), held_out[rows], ann.recall)
    stored = write_ann(root, structure.to_bytes())
    if ann.kind == "ivfpq":   # lossy codes: a replica re-ranks from these rows, read per candidate, not held in memory
        stored["row_file"] = write_row_file_blob(root, stored_fp16_rows(gallery).astype("<f2").tobytes())
    log(f"index: {ann.kind} {structure.params} built in {built:.1f} s; {structure.effort} reaches Recall@1 of exact "
        f"{measured['recall']:.4f} >= {ann.recall} on {take} held-out {sample_pool} rows")
    return {"kind": ann.kind, **stored, "params": structure.params, "effort": structure.effort,
            "candidates": candidate_rule(ann.kind),
            "metric": "cosine", "rows": int(features.shape[0]), "dim": int(features.shape[1]),
            "model_version": str(version), "recall_target": float(ann.recall), "recall": measured["recall"],
            "curve": measured["curve"], "sample": {"pool": sample_pool, "size": take, "seed": ann.seed},
            "build_seconds": built, "tune_seconds": measured["seconds"],
            **({"pq_curve": measured["pq_curve"]} if "pq_curve" in measured else {})}

"""``compat index build``: embed a data pool with one registered model version and write it as a gallery index."""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from cluster.model_registry.versions import MlflowModelResolver
from cluster.serving.index_store import commit_manifest, new_manifest, shard_table, write_shard
from cluster.serving.models import load_served_model, resolve_model_ref
from pipelines.stages.context import resolve_device
from pipelines.stages.extraction import extract_pool_features
from pipelines.stages.pools import load_pool

__all__ = ["build_index", "evaluation_labels", "pool_image_spec", "pool_of"]


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
                log: Callable[[str], None] = print) -> tuple[str, dict]:
    """Embed the pool with the version behind ``model_uri`` (the extraction the pipeline uses) and commit an index
    at ``root``; returns (manifest sha256, manifest). payload_prefix: item i gets payload URI ``<prefix>/<i>``."""
    if shard_rows < 1:
        raise ValueError(f"--shard-rows: expected a positive number of rows, got {shard_rows}")
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
    shards = []
    for start in range(0, features.shape[0], shard_rows):
        stop = min(features.shape[0], start + shard_rows)
        positions = np.arange(start, stop)
        payloads = [f"{payload_prefix.rstrip('/')}/{i}" for i in positions] if payload_prefix else None
        shards.append(write_shard(root, shard_table(positions, [str(i) for i in positions], features[start:stop],
                                                    ref.version, payloads, labels[start:stop])))
    manifest = new_manifest(features.shape[1], features.shape[0], {"name": ref.name, "version": ref.version},
                            shards, image=pool_image_spec(source), pool=spec.model_dump(mode="json"))
    digest = commit_manifest(root, manifest)
    log(f"index: {len(shards)} shards, manifest {digest[:12]} at {root}")
    return digest, manifest



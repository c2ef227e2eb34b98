"""Reading extract-stage features back from the run store: :func:`read_features` (a bridge extract's embeddings
come back as materialised d-dim features), :func:`cached_features` (a small per-process LRU), and the bridge's
embeddings and junction heads (ranged reads of the model weights, cached).

The caches are safe because extract and model keys are content hashes: a key's bytes never change.
"""
from __future__ import annotations

import collections

import numpy as np
import torch

from compat_core.safetensors_index import tensor_from_bytes
from pipelines.records.payloads import FeatureLayout, JunctionRef
from pipelines.store.run_store import RunStore

_HEADS: "collections.OrderedDict[tuple[str, str], torch.Tensor]" = collections.OrderedDict()
_GRAMS: "collections.OrderedDict[tuple[str, str], torch.Tensor]" = collections.OrderedDict()
_EMBEDDINGS: "collections.OrderedDict[tuple[str, str], tuple]" = collections.OrderedDict()
_CACHE_ITEMS = 4


def _cached(cache: collections.OrderedDict, key: tuple, compute, items: int = _CACHE_ITEMS):
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    value = compute()
    cache[key] = value
    while len(cache) > items:
        cache.popitem(last=False)
    return value


def junction_head(store: RunStore, head_ref: JunctionRef) -> torch.Tensor:
    """A (d, m) float32 of a layout's head reference, read once per process: only the junction's bytes of the model
    stage's weights (ranged reads, each range checked against the per-tensor sha256 of its manifest)."""
    def read() -> torch.Tensor:
        try:
            ((raw, dtype, shape),) = store.read_tensors(head_ref.stage_key, head_ref.blob,
                                                        [head_ref.tensor]).values()
        except KeyError as error:
            raise KeyError(f"{head_ref.stage_key}/{head_ref.blob}: no tensor {head_ref.tensor!r} "
                           f"(the bridge needs the junction weights): {error}") from None
        where = f"{head_ref.stage_key}/{head_ref.blob}:{head_ref.tensor}"
        return tensor_from_bytes(raw, dtype, shape, where).float().contiguous()

    return _cached(_HEADS, (store.root, head_ref.stage_key), read)


def junction_gram(store: RunStore, head_ref: JunctionRef) -> torch.Tensor:
    """A^T A (m, m) fp64 of a head, once per process."""
    def compute() -> torch.Tensor:
        head = junction_head(store, head_ref).double()
        return head.t() @ head

    return _cached(_GRAMS, (store.root, head_ref.stage_key), compute)


def _layout(manifest: dict, stage_key: str) -> FeatureLayout:
    return FeatureLayout.from_json(manifest["record"]["layout"], f"stage record {stage_key}: layout")


def read_embeddings(store: RunStore, stage_key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None,
                                                                FeatureLayout]:
    """(embeddings (N, m) as stored, labels, coarse labels or None, layout) of a bridge extract, cached."""
    def read():
        manifest = store.load_manifest(stage_key)
        layout = _layout(manifest, stage_key)
        parts = [store.read_array(stage_key, name, manifest) for name in layout.shards]
        embeddings = (np.concatenate(parts, axis=0) if parts
                      else np.zeros((0, layout.dim), dtype=layout.dtype))
        labels = store.read_array(stage_key, "labels.npy", manifest)
        coarse = store.read_array(stage_key, "coarse_labels.npy", manifest) if layout.has_coarse else None
        return embeddings, labels, coarse, layout

    return _cached(_EMBEDDINGS, (store.root, stage_key), read)


def materialize(store: RunStore, layout: FeatureLayout, embeddings: np.ndarray) -> np.ndarray:
    """The d-dim junction features A h (N, d) float32 of stored embeddings (unnormalised: every reader
    normalises, and the direction is what a cosine uses)."""
    head = junction_head(store, layout.head)
    rows = torch.from_numpy(np.asarray(embeddings, dtype=np.float32))
    out = torch.empty((rows.shape[0], head.shape[0]), dtype=torch.float32)
    block = max(1, (1 << 24) // max(1, head.shape[0]))
    for start in range(0, rows.shape[0], block):
        out[start:start + block] = (rows[start:start + block].double() @ head.double().t()).float()
    return out.numpy()


def read_features(store: RunStore, stage_key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(features (N, D) in their stored dtype, labels (N,), coarse labels (N,) or None) of an extract stage.

    A bridge extract (layout way ``bridge``) stores embeddings: its d-dim features come back materialised (A h,
    float32; see pipelines.stages.bridge_features)."""
    manifest = store.load_manifest(stage_key)
    layout = _layout(manifest, stage_key)
    if layout.feature_way == "bridge":
        embeddings, labels, coarse, layout = read_embeddings(store, stage_key)
        return materialize(store, layout, embeddings), labels, coarse
    parts = [store.read_array(stage_key, name, manifest) for name in layout.shards]
    features = np.concatenate(parts, axis=0) if parts else np.zeros((0, layout.dim), dtype=layout.dtype)
    labels = store.read_array(stage_key, "labels.npy", manifest)
    coarse = store.read_array(stage_key, "coarse_labels.npy", manifest) if layout.has_coarse else None
    return features, labels, coarse


_FEATURE_CACHE: "collections.OrderedDict[tuple[str, str], tuple]" = collections.OrderedDict()
_FEATURE_CACHE_ITEMS = 4  # a row's query and a few galleries: entries of one row reuse them


def cached_features(store: RunStore, key: str) -> tuple:
    """:func:`read_features` with a small per-process LRU cache: an in-process run and a reused Ray worker process
    both read a row's query once."""
    return _cached(_FEATURE_CACHE, (store.root, key), lambda: read_features(store, key), _FEATURE_CACHE_ITEMS)

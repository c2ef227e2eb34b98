"""The immutable serving state (model + index + version groups) and the Prometheus metrics of one replica.

A replica answers every request from ONE ``ServingState`` it read once at the start of the request; an upgrade
builds a complete new state off the request path and replaces the replica's reference to it in one assignment,
so no request sees a model of one version and groups or adapters of another.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cluster.serving.index_store import GalleryIndex, search_entry
from compat_core.retrieval.ann import KINDS
from compat_core.retrieval.mixed_gallery import VersionGroup, build_groups
from compat_core.retrieval.search_request import RequestError
from compat_core.upgrades.adapters import GALLERY_ADAPTERS
from pipelines.config.model_uri import ModelUri

def check_model_version(serving_version: str, index: GalleryIndex, requested: str | None) -> None:
    """Refuse a query embedded by another model version than ``serving_version``: RequestError 400 when the
    index holds no row of ``requested`` (naming the versions it holds), 409 when it does (the alias moved: re-embed
    or retry). O(versions) a request: the index's distinct versions are found once at load."""
    if requested is None or requested == serving_version:
        return
    if requested not in index.version_set:
        raise RequestError(400, "model_version", f"unknown version {requested!r}: the service embeds with "
                           f"{serving_version}, the index holds {sorted(index.version_set)}")
    raise RequestError(409, "model_version", f"the embedding was made by version {requested}, the service now "
                       f"embeds with {serving_version}; re-embed or retry")


LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class ServingState:
    """Everything one request needs, never mutated after construction."""

    ref: ModelUri
    model: Any                        # CompatModel (eval) or None when the service embeds no images
    index: GalleryIndex
    groups: tuple[VersionGroup, ...]
    adapter: tuple[str, str] | None   # (kind, old version) the gate installed with ``ref``, when applied
    image_shape: tuple[int, int, int] | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None
    loaded_unix: float = field(default_factory=time.time)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.ref.name, self.ref.version, self.index.manifest_sha)


def build_state(ref: ModelUri, model: Any, index: GalleryIndex, adapter: tuple[str, str, Any] | None,
                precision: str) -> ServingState:
    """Version groups of ``index`` for queries of ``ref``; an installed adapter maps the group of its old version
    (query adapters map the query, gallery adapters such as FCT the group's stored embeddings)."""
    query_maps, gallery_maps, applied = {}, {}, None
    if adapter is not None:
        kind, old_version, fitted = adapter
        if old_version in index.version_set and old_version != ref.version:
            if kind in GALLERY_ADAPTERS:
                gallery_maps[old_version] = lambda rows, f=fitted: f.apply(rows).float()
            else:
                query_maps[old_version] = lambda rows, f=fitted: f.apply(rows).float()
            applied = (kind, old_version)
    if index.rows_in_structure:
        if gallery_maps:
            raise ValueError(f"index {index.manifest_sha[:12]} was loaded with its rows in the search structure "
                             "only; a gallery adapter needs them loaded (load_index(lean=False))")
        version = str(index.versions[0])
        # one group, re-ranked from the structure's own stored rows: no prepared copy of the gallery
        groups = (VersionGroup(version, None, None, query_maps.get(version), index.ann),)
    else:
        groups = build_groups(index.embeddings, index.versions, precision, query_maps, gallery_maps,
                              structures=index.structures())
    image = index.manifest.get("image") or {}
    shape = tuple(int(x) for x in image["shape"]) if image.get("shape") else None
    return ServingState(ref, model, index, groups, applied, shape, tuple(image.get("mean") or ()) or None,
                        tuple(image.get("std") or ()) or None)


def check_servable(manifest: dict, root: str, model_uri: str, feature_dim: int | None) -> None:
    """Refuse (ValueError naming both) a model whose features the index (its ``manifest``) cannot take: another
    width than the index's rows, or an index whose search structure is of a kind or metric this service does not
    search."""
    entry = search_entry(manifest)
    dim = int(manifest["dim"])
    kind = entry.get("kind")
    if kind not in KINDS or (kind != "flat" and entry.get("metric") != "cosine"):
        raise ValueError(f"index at {root}: search kind {kind!r} with metric {entry.get('metric')!r} cannot serve "
                         f"model {model_uri}: this service searches {', '.join(KINDS)} over cosine similarity")
    if feature_dim is not None and int(feature_dim) != dim:
        raise ValueError(f"model {model_uri} makes {int(feature_dim)}-d features, the index at {root} holds "
                         f"{dim}-d embeddings ({kind} search); serve a model of width {dim} or build an index "
                         f"with this one (compat index build)")


class ReplicaMetrics:
    """Counters and a latency histogram in Prometheus text format (one replica's view)."""

    def __init__(self, replica: str) -> None:
        self.replica = replica
        self._lock = threading.Lock()
        self.request_counts: dict[tuple[str, int], int] = {}
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0
        self.latency_count = 0
        self.swaps = 0
        self.swap_errors = 0
        self.batches = 0
        self.batched_requests = 0

    def observe_batch(self, size: int) -> None:
        with self._lock:
            self.batches += 1
            self.batched_requests += size

    def observe(self, path: str, status: int, seconds: float) -> None:
        with self._lock:
            self.request_counts[(path, status)] = self.request_counts.get((path, status), 0) + 1
            if path == "/search" and status == 200:
                self.latency_sum += seconds
                self.latency_count += 1
                self.buckets[next((i for i, b in enumerate(LATENCY_BUCKETS) if seconds <= b), len(LATENCY_BUCKETS))] += 1

    def render(self, state: ServingState | None) -> str:
        r = f'replica="{self.replica}"'
        lines = ["# HELP compat_search_requests_total HTTP requests answered, by path and status code.",
                 "# TYPE compat_search_requests_total counter"]
        with self._lock:
            for (path, status), count in sorted(self.request_counts.items()):
                lines.append(f'compat_search_requests_total{{{r},path="{path}",code="{status}"}} {count}')
            lines += ["# HELP compat_search_latency_seconds Latency of successful /search requests in the replica.",
                      "# TYPE compat_search_latency_seconds histogram"]
            cumulative = 0
            for bound, count in zip(LATENCY_BUCKETS + (float("inf"),), self.buckets):
                cumulative += count
                le = "+Inf" if bound == float("inf") else repr(bound)
                lines.append(f'compat_search_latency_seconds_bucket{{{r},le="{le}"}} {cumulative}')
            lines.append(f"compat_search_latency_seconds_sum{{{r}}} {self.latency_sum!r}")
            lines.append(f"compat_search_latency_seconds_count{{{r}}} {self.latency_count}")
            lines += ["# HELP compat_model_swaps_total Model or index switches of this replica.",
                      "# TYPE compat_model_swaps_total counter", f"compat_model_swaps_total{{{r}}} {self.swaps}",
                      "# HELP compat_model_swap_errors_total Failed attempts to load a new model or index.",
                      "# TYPE compat_model_swap_errors_total counter",
                      f"compat_model_swap_errors_total{{{r}}} {self.swap_errors}",
                      "# HELP compat_search_batches_total Kernel batches run (requests answered together).",
                      "# TYPE compat_search_batches_total counter", f"compat_search_batches_total{{{r}}} {self.batches}",
                      "# HELP compat_search_batched_requests_total Requests answered in those batches.",
                      "# TYPE compat_search_batched_requests_total counter",
                      f"compat_search_batched_requests_total{{{r}}} {self.batched_requests}"]
        lines += ["# HELP compat_model_loaded 1 when a model and index are loaded (else 503 on /search).",
                  "# TYPE compat_model_loaded gauge", f"compat_model_loaded{{{r}}} {int(state is not None)}"]
        if state is not None:
            versions, counts = np.unique(state.index.versions, return_counts=True)
            served = int(counts[versions == state.ref.version].sum()) if versions.size else 0
            lines += ["# HELP compat_model_version_info The model version that embeds queries.",
                      "# TYPE compat_model_version_info gauge",
                      f'compat_model_version_info{{{r},model="{state.ref.name}",version="{state.ref.version}",'
                      f'adapter="{state.adapter[0] if state.adapter else ""}"}} 1',
                      "# HELP compat_index_items Gallery items by the model version that embedded them.",
                      "# TYPE compat_index_items gauge"]
            lines += [f'compat_index_items{{{r},version="{v}"}} {int(c)}' for v, c in zip(versions, counts)]
            lines += ["# HELP compat_backfill_fraction Fraction of the gallery embedded by the serving model version.",
                      "# TYPE compat_backfill_fraction gauge",
                      f'compat_backfill_fraction{{{r},version="{state.ref.version}"}} '
                      f"{served / max(1, state.index.size)!r}"]
        return "\n".join(lines) + "\n"


def search_summary(state: ServingState) -> dict:
    """The index's search kind, its effort and measured recall, and the version groups it answers (the rest are
    searched exactly)."""
    entry = search_entry(state.index.manifest)
    summary = {"kind": entry["kind"], "approximate_groups": [g.version for g in state.groups if g.ann is not None]}
    if entry["kind"] != "flat":
        # where the exact re-rank reads the rows: the structure's own stored rows or, for lossy codes, the
        # row file, read per candidate (the replica holds no other copy of the gallery), or the gallery's rows prepared
        # for the exact kernel
        summary["rerank"] = ("gallery" if not state.index.rows_in_structure
                             else "row_file" if state.index.ann.row_file is not None else "structure")
        summary.update({key: entry.get(key) for key in ("params", "effort", "candidates", "recall", "recall_target",
                                                         "sample", "model_version")})
    backfill = state.index.manifest.get("search_backfill")
    if backfill:
        summary["backfill"] = {key: backfill.get(key) for key in ("model_version", "rows", "params", "effort",
                                                                   "recall")}
    return summary


def state_summary(state: ServingState) -> dict:
    versions, counts = np.unique(state.index.versions, return_counts=True)
    return {"model": state.ref.name, "model_version": state.ref.version, "index_manifest": state.index.manifest_sha,
            "items": state.index.size, "dim": state.index.dim,
            "items_by_version": {str(v): int(c) for v, c in zip(versions, counts)},
            "adapter": {"kind": state.adapter[0], "old_version": state.adapter[1]} if state.adapter else None,
            "search": search_summary(state), "loaded_unix": state.loaded_unix}


def as_query_tensor(rows) -> torch.Tensor:
    return torch.as_tensor(np.asarray(rows, dtype=np.float32))

"""Exact top-k over a gallery whose items were embedded by different model versions (a gallery mid-upgrade).

The gallery is split into version groups; each group is searched with the query embedding that belongs to it (the
serving model's embedding for its own and compatible groups, that embedding passed through a query adapter for an
older group that is not compatible) by the exact kernel (``compat_core.retrieval.search``), and the per-group top-k lists
are merged by (score descending, gallery position ascending). A group may carry an approximate structure over its
rows (``compat_core.retrieval.ann``): its top-k is then the structure's candidates re-ranked exactly, equal to the
exact top-k whenever the candidates hold it. That merge is exact: every item of the global top-k
is in its group's top-k, and inside a group the kernel breaks exact ties by the lowest row, which is the lowest
gallery position because a group's rows keep the gallery order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from compat_core.retrieval.ann import AnnIndex, ann_search
from compat_core.retrieval.search import PreparedGallery, search_prepared

__all__ = ["VersionGroup", "build_groups", "search_groups", "unit_rows"]


def unit_rows(features) -> torch.Tensor:
    """fp32 L2-normalised rows, normalised exactly as the evaluation normalises features before retrieval."""
    tensor = torch.as_tensor(np.asarray(features, dtype=np.float32)) if not torch.is_tensor(features) else features
    return torch.nn.functional.normalize(tensor.float(), dim=1)


@dataclass(frozen=True)
class VersionGroup:
    """The gallery items of one model version. positions: (n,) int64 ascending gallery positions; prepared: their
    unit embeddings ready for the kernel; query_map: embedding of the serving model -> this group's query space
    (None: as is); ann: an approximate structure over exactly these rows (None: exact search)."""

    version: str
    positions: np.ndarray
    prepared: PreparedGallery
    query_map: Callable[[torch.Tensor], torch.Tensor] | None = None
    ann: AnnIndex | None = None


def build_groups(embeddings: np.ndarray, versions: np.ndarray, precision: str = "auto",
                 query_maps: dict[str, Callable] | None = None,
                 gallery_maps: dict[str, Callable] | None = None, ann: AnnIndex | None = None,
                 ann_version: str | None = None) -> tuple[VersionGroup, ...]:
    """Version groups of a gallery (embeddings (N, D) in gallery order, versions (N,) strings), prepared once.

    gallery_maps: version -> transformation of that group's stored embeddings into the serving model's space (a
    gallery adapter such as FCT); query_maps: version -> query adapter (new -> that version's space).
    ann: a structure built over the first ``ann.size`` gallery rows as embedded by ``ann_version``; the group of
    that version searches with it while it still holds all of those rows as stored (no gallery adapter, no row
    re-embedded by another version), else exactly.
    """
    embeddings = np.asarray(embeddings, dtype=np.float32)
    versions = np.asarray(versions).astype(str)
    if embeddings.ndim != 2 or embeddings.shape[0] != versions.shape[0]:
        raise ValueError(f"embeddings {embeddings.shape} and versions {versions.shape}: expected (N, D) and (N,)")
    groups = []
    for version in sorted(set(versions.tolist())):
        positions = np.flatnonzero(versions == version).astype(np.int64)
        rows = torch.from_numpy(embeddings[positions])
        if gallery_maps and version in gallery_maps:
            rows = gallery_maps[version](rows)
        mapped = bool(gallery_maps and version in gallery_maps)
        whole = (ann is not None and version == ann_version and not mapped and positions.shape[0] == ann.size
                 and embeddings.shape[0] == ann.size)
        groups.append(VersionGroup(version, positions, PreparedGallery(unit_rows(rows), precision),
                                   (query_maps or {}).get(version), ann if whole else None))
    return tuple(groups)


def search_groups(query: torch.Tensor, groups: tuple[VersionGroup, ...], k: int) -> tuple[np.ndarray, np.ndarray,
                                                                                           np.ndarray]:
    """Exact top-k of each query row over all groups.

    query (Nq, D) embeddings of the serving model. Returns (positions (Nq, k) int64 gallery positions,
    scores (Nq, k) float64 cosine similarities, group (Nq, k) int64 index into ``groups``), best first, exact ties
    by the lowest gallery position. Raises ValueError unless 1 <= k <= the gallery size.
    """
    total = sum(group.positions.shape[0] for group in groups)
    if not 1 <= k <= total:
        raise ValueError(f"k: expected 1 <= k <= gallery size ({total}), got {k}")
    query = unit_rows(query)
    parts_pos, parts_score, parts_group = [], [], []
    for number, group in enumerate(groups):
        q = query if group.query_map is None else unit_rows(group.query_map(query))
        take = min(k, group.positions.shape[0])
        if group.ann is not None:
            index, score = ann_search(q, group.prepared, group.ann, take)
        else:
            index, score = search_prepared(q, group.prepared, take)
        parts_pos.append(group.positions[index.cpu().numpy()])
        parts_score.append(score.cpu().numpy())
        parts_group.append(np.full(index.shape, number, dtype=np.int64))
    positions = np.concatenate(parts_pos, axis=1)
    scores = np.concatenate(parts_score, axis=1)
    group_of = np.concatenate(parts_group, axis=1)
    # per row: by score descending, then position ascending (lexsort's last key is the primary one)
    order = np.stack([np.lexsort((positions[row], -scores[row]))[:k] for row in range(positions.shape[0])]) \
        if positions.shape[0] else np.zeros((0, k), dtype=np.int64)
    return (np.take_along_axis(positions, order, axis=1), np.take_along_axis(scores, order, axis=1),
            np.take_along_axis(group_of, order, axis=1))

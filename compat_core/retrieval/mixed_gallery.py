"""Exact top-k over a gallery whose items were embedded by different model versions (a gallery mid-upgrade).

The gallery is split into version groups (a row lives in exactly one: the version that embedded it); each group
is searched with the query embedding that belongs to it (the serving model's embedding for its own and compatible
groups, that embedding passed through a query adapter for an older group that is not compatible) by the exact
kernel (``compat_core.retrieval.search``), and the per-group top-k lists are merged by (score descending, gallery
position ascending). A group may carry an approximate structure (``compat_core.retrieval.ann``): its top-k is then
the structure's candidates re-ranked exactly, equal to the exact top-k whenever the candidates hold it. During a
backfill the old model's structure, built over the whole gallery, keeps serving the rows not yet re-embedded (the
re-embedded ones are masked in it, never returned), and the re-embedded rows have a structure of their own, built
for the new model. That merge is exact: every item of the global top-k is in its group's top-k, and inside a group
the kernel breaks exact ties by the lowest row, which is the lowest gallery position because a group's rows keep
the gallery order. The scores merged are cosine similarities in each group's own space; they compare across groups
as far as the two models are compatible (what compatible training and the gate's adapter are for).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from compat_core.retrieval.ann import AnnIndex, AnnSubset, ann_search, ann_subset
from compat_core.retrieval.search import PreparedGallery, search_prepared

__all__ = ["VersionGroup", "build_groups", "search_groups", "unit_rows"]


def unit_rows(features) -> torch.Tensor:
    """fp32 L2-normalised rows, normalised exactly as the evaluation normalises features before retrieval."""
    tensor = torch.as_tensor(np.asarray(features, dtype=np.float32)) if not torch.is_tensor(features) else features
    return torch.nn.functional.normalize(tensor.float(), dim=1)


@dataclass(frozen=True)
class VersionGroup:
    """The gallery items of one model version. positions: (n,) int64 ascending gallery positions, or None when the
    group is the whole gallery in order (group row i = position i: nothing held a row for it); prepared: their
    unit embeddings ready for the kernel; query_map: embedding of the serving model -> this group's query space
    (None: as is); ann: an approximate structure over these rows (None: exact search); ann_subset: the group's
    rows in ``ann`` when it holds more rows than the group (a whole-gallery structure some of whose rows were
    re-embedded by another version: those are masked), else None (structure row i = group row i)."""

    version: str
    positions: np.ndarray
    prepared: PreparedGallery
    query_map: Callable[[torch.Tensor], torch.Tensor] | None = None
    ann: AnnIndex | None = None
    ann_subset: AnnSubset | None = None

    @property
    def size(self) -> int:
        """Gallery items in the group."""
        if self.positions is not None:
            return int(self.positions.shape[0])
        return int(self.prepared.size if self.prepared is not None else self.ann.size)

    def gallery_positions(self, rows: np.ndarray) -> np.ndarray:
        """int64 gallery positions of the group's rows ``rows`` (any shape)."""
        rows = np.asarray(rows, dtype=np.int64)
        return rows if self.positions is None else self.positions[rows]


def build_groups(embeddings: np.ndarray, versions: np.ndarray, precision: str = "auto",
                 query_maps: dict[str, Callable] | None = None,
                 gallery_maps: dict[str, Callable] | None = None, ann: AnnIndex | None = None,
                 ann_version: str | None = None,
                 structures: dict[str, AnnIndex] | None = None) -> tuple[VersionGroup, ...]:
    """Version groups of a gallery (embeddings (N, D) in gallery order, versions (N,) strings), prepared once.

    gallery_maps: version -> transformation of that group's stored embeddings into the serving model's space (a
    gallery adapter such as FCT); query_maps: version -> query adapter (new -> that version's space).
    structures: version -> an approximate structure built over that version's embeddings of either every gallery
    row (in gallery order: the index's first structure) or exactly the rows that version holds (in gallery order:
    a structure built for the re-embedded rows during a backfill); ``ann`` / ``ann_version`` add one entry. A
    group searches with its version's structure unless a gallery adapter maps its rows (then exactly); a
    whole-gallery structure of a group that lost rows to another version masks them. A structure of any other
    size matches no group (exact search).
    """
    embeddings = np.asarray(embeddings, dtype=np.float32)
    versions = np.asarray(versions).astype(str)
    if embeddings.ndim != 2 or embeddings.shape[0] != versions.shape[0]:
        raise ValueError(f"embeddings {embeddings.shape} and versions {versions.shape}: expected (N, D) and (N,)")
    structures = {**(structures or {}), **({ann_version: ann} if ann is not None and ann_version else {})}
    groups = []
    for version in sorted(set(versions.tolist())):
        positions = np.flatnonzero(versions == version).astype(np.int64)
        rows = torch.from_numpy(embeddings[positions])
        if gallery_maps and version in gallery_maps:
            rows = gallery_maps[version](rows)
        mapped = bool(gallery_maps and version in gallery_maps)
        structure = None if mapped else structures.get(version)
        subset = None
        if structure is not None and structure.size == embeddings.shape[0] and positions.shape[0] < structure.size:
            subset = ann_subset(structure, positions)
        elif structure is not None and structure.size != positions.shape[0]:
            structure = None
        groups.append(VersionGroup(version, positions, PreparedGallery(unit_rows(rows), precision),
                                   (query_maps or {}).get(version), structure, subset))
    return tuple(groups)


def search_groups(query: torch.Tensor, groups: tuple[VersionGroup, ...], k: int) -> tuple[np.ndarray, np.ndarray,
                                                                                           np.ndarray]:
    """Exact top-k of each query row over all groups.

    query (Nq, D) embeddings of the serving model. Returns (positions (Nq, k) int64 gallery positions,
    scores (Nq, k) float64 cosine similarities, group (Nq, k) int64 index into ``groups``), best first, exact ties
    by the lowest gallery position. Raises ValueError unless 1 <= k <= the gallery size.
    """
    total = sum(group.size for group in groups)
    if not 1 <= k <= total:
        raise ValueError(f"k: expected 1 <= k <= gallery size ({total}), got {k}")
    query = unit_rows(query)
    parts_pos, parts_score, parts_group = [], [], []
    for number, group in enumerate(groups):
        q = query if group.query_map is None else unit_rows(group.query_map(query))
        take = min(k, group.size)
        if group.ann is not None:
            index, score = ann_search(q, group.prepared, group.ann, take, group.ann_subset)
        else:
            index, score = search_prepared(q, group.prepared, take)
        parts_pos.append(group.gallery_positions(index.cpu().numpy()))
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

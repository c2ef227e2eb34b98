"""Exact top-k among candidate rows handed over as vectors: the re-rank of an approximate structure that stores the
gallery rows itself (faiss IVF with fp16 rows, HNSW with fp32 rows), so that nothing but the structure and one fp64
inverse norm per row (8 bytes) is held for the exact stage.

The score of (query q, stored row g_j) is the fp64 reference score of ``compat_core.retrieval.search``:
``sum_i q_i * (g_ji * inv_j)`` with q = query / ||query|| and inv_j = 1 / ||g_j|| in fp64, each pair reduced by the
same elementwise product and inner sum, so identical stored rows score bit for bit alike; a query's candidates are
ordered by (score descending, gallery row ascending), so exact ties go to the lowest row as in the exact search.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from compat_core.retrieval.int8 import SLACK, U32, gamma
from compat_core.retrieval.space import _inverse_norms

__all__ = ["compact", "rerank_vectors", "stored_inverse_norms", "survivors", "unit_queries"]


def _structure_bound(dim: int) -> float:
    """Bound on |d_j inv_j - r_j|: a structure's fp32 score d_j = x . g_j (x the fp32 unit query, g_j a stored row
    of norm n_j, summed in fp32 in any order) times the row's fp64 inverse norm, against the fp64 reference score
    r_j of the cosine. |d_j - x.g_j| <= gamma_D ||x|| n_j (accumulation), |x.g_j - q.g_j| <= ||x - q|| n_j <= u32
    (1 + 1e-8) n_j (x is q rounded to fp32 from fp64), so d_j / n_j is within gamma_D (1 + u32) + u32 (1 + 1e-8)
    of the cosine; the reference is within 2 gamma_D(u64) + 8 u64 of it, the product d_j inv_j within 4 u64 of
    d_j / n_j."""
    u64 = 2.0 ** -53
    return (gamma(dim, U32) * (1.0 + U32) + U32 * (1.0 + 1e-8) + 2.0 * gamma(dim, u64) + 12.0 * u64) * SLACK


def survivors(scores32: np.ndarray, cand: np.ndarray, inverse: np.ndarray, dim: int, k: int) -> np.ndarray:
    """(Nq, C) bool: the candidates that can be in their row's exact top-k (or tied with its k-th), from the
    structure's own fp32 inner products ``scores32`` (Nq, C) of the fp32 unit query (``unit_queries``) and the
    stored rows ``cand`` (int64, -1 for none; ``inverse``: the stored rows' fp64 inverse norms). With
    s_j = d_j inv_j and the bound E (``_structure_bound``), every reference score lies in [s_j - E, s_j + E]; T,
    the k-th largest s_j - E of a row, is at most its k-th reference score, so a candidate whose s_j + E < T can
    be neither in the top-k nor tied with it. Rows with fewer than k valid candidates keep them all. (numpy: a
    few microseconds a call where torch's per-operation cost is several times that.)"""
    valid = cand >= 0
    scaled = np.where(valid, scores32.astype(np.float64) * inverse[np.where(valid, cand, 0)], -np.inf)
    take = min(k, scaled.shape[1])
    kth = scaled.max(axis=1, keepdims=True) if take == 1 else -np.partition(-scaled, take - 1, axis=1)[:, take - 1:take]
    bound = _structure_bound(dim)
    return valid & (scaled + bound >= kth - bound)


def compact(keep: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """(Nq, W) int64: each row's kept candidates first (in their order), -1 after them; W = the widest row's
    count (at least 1)."""
    counts = keep.sum(axis=1)
    width = max(1, int(counts.max()))
    if width == 1 and counts.min() == 1:     # one survivor a row (the usual k = 1 case)
        return np.take_along_axis(cand, keep.argmax(axis=1)[:, None], 1)
    first = np.argsort(~keep, axis=1, kind="stable")[:, :width]
    return np.where(np.take_along_axis(keep, first, 1), np.take_along_axis(cand, first, 1), -1)


def stored_inverse_norms(rows_of, size: int, block: int = 65536) -> torch.Tensor:
    """(size,) fp64 inverse norms of the rows ``rows_of(start, stop) -> (stop - start, D) float32`` (a structure's
    stored rows, decoded block by block so that at most ``block`` rows are decoded at once)."""
    parts = [_inverse_norms("stored rows", torch.from_numpy(rows_of(start, min(size, start + block))))
             for start in range(0, size, block)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.float64)


def unit_queries(query: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(fp64 unit rows q = query / ||query|| as the exact search's reference takes them, their fp32 rounding as a
    C-contiguous array for the structure); ValueError naming the first row of zero or non-finite norm."""
    norms = torch.linalg.vector_norm(query, dim=1, dtype=torch.float64).numpy()
    if not norms.min() > 0 or not math.isfinite(norms.max()):     # NaN fails the first test
        bad = ~(np.isfinite(norms) & (norms > 0))
        raise ValueError(f"query: row {int(np.flatnonzero(bad)[0])} has zero or non-finite norm; cosine "
                         "similarity is undefined")
    q64 = query.numpy().astype(np.float64) * (1.0 / norms)[:, None]
    return q64, np.ascontiguousarray(q64, dtype=np.float32)


def rerank_vectors(q64: np.ndarray, cand: np.ndarray, vectors: np.ndarray, inverse: np.ndarray, k: int):
    """Exact top-k of each query row among its candidates.

    q64 (Nq, D) fp64 unit query rows (:func:`unit_queries`); cand (Nq, C) int64 gallery rows, -1 for none
    (distinct within a row); vectors (Nq, C, D) float32: the stored rows of ``cand`` (anything where cand is -1);
    inverse (N,) fp64: the stored rows' inverse norms (:func:`stored_inverse_norms`). Rows with fewer than k valid
    candidates get -1 and -inf past their last valid one (the caller completes them). Returns (indices (Nq, k)
    int64, fp64 cosine scores (Nq, k)) tensors. The elementwise products run in numpy (identical IEEE results,
    a fraction of torch's cost per call on these small arrays), the sums in torch as the exact kernel's."""
    count, width = cand.shape
    dim = vectors.shape[-1]
    if width < k:       # fewer candidates than k: padding to k columns, answered -1 / -inf
        cand = np.pad(cand, ((0, 0), (0, k - width)), constant_values=-1)
        vectors = np.pad(vectors, ((0, 0), (0, k - width), (0, 0)))
        width = k
    valid = cand >= 0
    pairs = vectors.astype(np.float64) * inverse[np.where(valid, cand, 0)][:, :, None]
    pairs *= q64[:, None, :]
    sums = torch.from_numpy(pairs.reshape(count * width, dim)).sum(dim=1).numpy()
    scores = np.where(valid, sums.reshape(count, width), -np.inf)
    if width == 1:      # one candidate a row (k = 1 and one survivor each): nothing to order
        return torch.from_numpy(cand), torch.from_numpy(scores)
    # candidates in ascending row order (padding last), then a stable sort by score: ties go to the lowest row
    ascending = np.argsort(np.where(valid, cand, np.iinfo(np.int64).max), axis=1, kind="stable")
    cand, scores = np.take_along_axis(cand, ascending, 1), np.take_along_axis(scores, ascending, 1)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return (torch.from_numpy(np.take_along_axis(cand, order, 1)),
            torch.from_numpy(np.take_along_axis(scores, order, 1)))

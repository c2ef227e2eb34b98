"""The exact linear-head bridge (SPEC §7): top-k of cos(A_t q, A_k g) searched in the m-dim embedding space with
the exact kernel of ``compat_core.retrieval.search``, without forming the d-dim features."""
from __future__ import annotations

import numpy as np
import torch

from compat_core.hardware.torch_settings import ieee_fp32 as _ieee_fp32
from compat_core.retrieval.int8 import U32 as _U32
from compat_core.retrieval.kernel import _Queries, _search
from compat_core.retrieval.search import _as_labels, _as_matrix, _check_precision
from compat_core.retrieval.space import _build_space, _half_dtype_for, _Space, _with_stage


def _check_head(name: str, head: torch.Tensor, embed_dim: int) -> None:
    if head.shape[1] != embed_dim:
        raise ValueError(f"{name}: expected shape (d, {embed_dim}) as nn.Linear(m, d).weight stores it, "
                         f"got {tuple(head.shape)}")


def _bridge_space(gallery_embed: torch.Tensor, query_head: torch.Tensor, gallery_head: torch.Tensor,
                  precision: str) -> _Space:
    """Gallery vectors (A_t^T A_k g_j) / ||A_k g_j||, m-dimensional, from the two m x m Gram products in fp64."""
    device = gallery_embed.device
    head_k = gallery_head.to(device).double()
    gram_k = head_k.t() @ head_k                       # A_k^T A_k (m, m): ||A_k g||^2 = g^T G g
    if query_head is gallery_head or torch.equal(query_head, gallery_head):
        cross = gram_k                                 # self-test: one Gram product serves both
    else:
        cross = query_head.to(device).double().t() @ head_k     # A_t^T A_k (m, m)
    del head_k
    # identical embeddings must get bit-identical vectors (exact ties go to the lowest index), and a matrix product
    # may split its inner dimension differently between output tiles (stream-K on recent GPUs): each distinct row
    # is computed once and copied to its duplicates (which also makes the row sums below tie-safe on any device)
    distinct, copy_of = torch.unique(gallery_embed, dim=0, return_inverse=True)
    size, dim = distinct.shape
    vectors = torch.empty((size, dim), dtype=torch.float64, device=device)
    block = max(1, (1 << 22) // dim)
    for start in range(0, size, block):
        stop = min(size, start + block)
        g = distinct[start:stop].double()
        squared = ((g @ gram_k) * g).sum(dim=1)
        if bool((~(squared > 0)).any()):
            bad = start + int(torch.nonzero(~(squared > 0))[0, 0])
            first = int(torch.nonzero(copy_of == bad)[0, 0])
            raise ValueError(f"gallery_embed: row {first} maps to a zero feature under gallery_head; "
                             "cosine similarity is undefined")
        vectors[start:stop] = (g @ cross.t()) / torch.sqrt(squared)[:, None]
    vectors = vectors[copy_of]                         # back to the gallery's order (unique rows come sorted)
    norms = torch.linalg.vector_norm(vectors, dim=1)
    # rounding fp64 -> fp32 moves each component by at most u32 of itself
    return _build_space(vectors.float(), _U32 * float(norms.max()), float(norms.max()),
                        lambda index, out=None: torch.index_select(vectors, 0, index, out=out),
                        _half_dtype_for(precision, device))


def bridged_nearest_neighbours(query_embed, query_head, gallery_embed, gallery_head, k: int = 1,
                               chunk_size: int | None = None, precision: str = "auto",
                               return_scores: bool = True):
    """Exact top-k of cos(A_t q, A_k g) without forming the d-dimensional features.

    query_embed (Nq, m), gallery_embed (Ng, m): backbone embeddings; query_head (d, m) = A_t, gallery_head (d, m)
    = A_k, the bias-free junction weights as ``nn.Linear(m, d).weight`` stores them. Since
    cos(A_t q, A_k g) = q^T (A_t^T A_k) g / (||A_t q|| ||A_k g||), the gallery becomes m-dim vectors
    (A_t^T A_k g) / ||A_k g|| (||A_k g||^2 = g^T (A_k^T A_k) g) and the search runs in m dimensions.
    The query norm ||A_t q|| is a positive factor common to a query's row: it changes neither the order nor exact
    ties (ties are decided on the unscaled fp64 products, so scaling cannot merge or split them) and is computed
    only when ``return_scores`` asks for cosine values (one more m x m Gram product).
    Returns (indices (Nq, k) int64, scores (Nq, k) float64 cosines or None), as ``nearest_neighbours``.
    """
    _check_precision(precision)
    gallery_embed = _as_matrix("gallery_embed", gallery_embed)
    device = gallery_embed.device
    query_embed = _as_matrix("query_embed", query_embed, device)
    query_head = _as_matrix("query_head", query_head, device)
    gallery_head = _as_matrix("gallery_head", gallery_head, device)
    _check_head("query_head", query_head, query_embed.shape[1])
    _check_head("gallery_head", gallery_head, gallery_embed.shape[1])
    if query_head.shape[0] != gallery_head.shape[0]:
        raise ValueError(f"query_head/gallery_head: feature dimensions d differ "
                         f"({query_head.shape[0]} vs {gallery_head.shape[0]})")
    with torch.inference_mode(), _ieee_fp32():
        space = _bridge_space(gallery_embed, query_head, gallery_head, precision)
        # any positive per-query scale is allowed for the ranking; the Euclidean one keeps the stage bounds small
        queries = _Queries("query_embed", query_embed, raw=space.half_dtype == torch.int8)
        result = _search(space, queries, k, precision, chunk_size, return_scores,
                         rebuild=lambda fallback: _with_stage(space, _half_dtype_for(fallback, device)))
        if return_scores:
            head_t = query_head.double()
            gram_t = head_t.t() @ head_t
            q = query_embed.double()
            feature_norm = torch.sqrt(((q @ gram_t) * q).sum(dim=1))
            if bool((~(feature_norm > 0)).any()):
                first = int(torch.nonzero(~(feature_norm > 0))[0, 0])
                raise ValueError(f"query_embed: row {first} maps to a zero feature under query_head; "
                                 "cosine similarity is undefined")
            euclidean = torch.linalg.vector_norm(q, dim=1)
            result.score *= (euclidean / feature_norm)[:, None]
    return result.index, result.score


def bridged_recall_at_1(query_embed, query_head, gallery_embed, gallery_head, query_labels, gallery_labels,
                        chunk_size: int | None = None, precision: str = "auto") -> float:
    """1:N Recall@1 (fraction) of queries A_t q against gallery A_k g, computed in the m-dim embedding space
    (see ``bridged_nearest_neighbours``); identical top-1 to searching the d-dim features directly."""
    q_labels = _as_labels("query_labels", query_labels, len(query_embed))
    g_labels = _as_labels("gallery_labels", gallery_labels, len(gallery_embed))
    index, _ = bridged_nearest_neighbours(query_embed, query_head, gallery_embed, gallery_head, 1, chunk_size,
                                          precision, return_scores=False)
    return float(np.mean(g_labels[index[:, 0].cpu().numpy()] == q_labels))



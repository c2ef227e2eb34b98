"""The compressed option's code size chosen by measurement: IVF-PQ with the fewest bytes per row whose re-ranked
top-1 reaches a Recall@1-of-exact target on held-out queries.

:func:`tune_pq` tries product quantisers of 8-bit codes over ``m`` sub-vectors, ``m`` in a ladder of divisors of
the width from small to large (by default D/16, D/8, D/4: 1/32, 1/16 and 1/8 of the fp16 rows' bytes), and keeps
the first whose search effort, tuned by :func:`compat_core.retrieval.ann.tune_ann`, reaches the target. The codes
rank coarsely; the exact re-rank reads the gallery's rows: the prepared gallery (then an index that re-ranks holds
the codes plus the rows), or a memory-mapped file of the fp16 rows (``AnnIndex.attach_rows``: the codes, 8 bytes a
row and the file pages the queries touch).
"""
from __future__ import annotations

import time

from compat_core.retrieval.ann import AnnIndex, build_ann, default_params, tune_ann
from compat_core.retrieval.search import PreparedGallery

__all__ = ["pq_ladder", "tune_pq"]


def pq_ladder(dim: int, divisions: tuple[int, ...] = (16, 8, 4)) -> list[int]:
    """Sub-vector counts ``dim // d`` for each division ``d`` that divides ``dim``, smallest code first."""
    counts = sorted({dim // d for d in divisions if d <= dim and dim % d == 0})
    if not counts:
        raise ValueError(f"pq ladder: no division of {divisions} divides the width {dim}")
    return counts


def tune_pq(gallery, prepared: PreparedGallery, sample, recall: float, seed: int = 0,
            ladder: list[int] | None = None) -> tuple[AnnIndex, dict]:
    """(the IVF-PQ structure of the smallest code in ``ladder`` (default :func:`pq_ladder`) whose tuned effort
    reaches ``recall`` of exact Recall@1 on ``sample``, its measurement) with "pq_curve": [[m, bytes per code,
    recall reached (None: below the target at every effort), build seconds], ...] over the codes tried.
    ValueError when no code reaches it."""
    size, dim = int(prepared.size), int(prepared.dim)
    curve, started = [], time.perf_counter()
    for m in ladder or pq_ladder(dim):
        params = {**default_params("ivfpq", size, dim), "pq_m": int(m)}
        built = time.perf_counter()
        ann = build_ann(gallery, "ivfpq", params, seed=seed)
        seconds = time.perf_counter() - built
        code_bytes = (int(m) * int(params["pq_bits"]) + 7) // 8   # faiss' code size
        try:
            measured = tune_ann(ann, prepared, sample, recall)
        except ValueError:   # this code size cannot reach the target: a larger one
            curve.append([int(m), code_bytes, None, seconds])
            continue
        curve.append([int(m), code_bytes, measured["recall"], seconds])
        return ann, {**measured, "pq_curve": curve, "seconds": time.perf_counter() - started}
    raise ValueError(f"recall {recall}: no IVF-PQ code of {[c[0] for c in curve]} sub-vectors reached it on the "
                     f"held-out queries; use --kind ivf or hnsw, or lower --recall")

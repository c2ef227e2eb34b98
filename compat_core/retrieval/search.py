"""Exact cosine retrieval (1:N Recall@k, mAP); the exact linear-head bridge (SPEC §7) that searches with it is in
``compat_core.retrieval.bridge``, 1:1 verification in ``compat_core.evaluation.verification``.

The kernel (``nearest_neighbours``) returns exactly the top-k of an fp64 brute force while doing almost all of its
arithmetic in half precision where the hardware multiplies half-precision matrices fast.

Why it is exact. Let q, g be the fp64 unit vectors (the *reference*), x, y the vectors a stage multiplies (half
or fp32 copies), z the stage's exact-arithmetic product x.y and S the stored score. Then
    |z_fp32acc - q.g| <= ||x - q|| ||y|| + ||q|| ||y - g||     (input rounding: measured per gallery row in fp64;
                                                                 per query row bounded by 3 u32 + the measured
                                                                 half-vs-fp32 difference, exact in fp32)
                         + gamma_D ||x|| ||y||                   (fp32 accumulation in any order,
                                                                 gamma_D = D u32 / (1 - D u32))
                      =: E(q)   (gallery terms at their maxima over the gallery, so E depends on the query only)
and a half-precision output S = round(z) adds |S - z| <= u_out |S| (u_out = 2^-8 bf16, 2^-11 fp16, 0 for fp32
output; plus 2^-24 absolute for subnormals). Let v be the k-th largest S of a query. The k items with S >= v have
z >= v - u_out|v| (rounding is monotone), hence reference scores >= v - u_out|v| - E, so the exact k-th score is at
least that; any item of the exact top-k, or tied with its k-th, has z >= v - u_out|v| - 2E and, rounding being
monotone, S >= round_down(v - u_out|v| - 2E) =: T. The candidates {S >= T} therefore contain the answer, exact
ties included. They are re-scored in fp32 (same bound, no output rounding), filtered again the same way, and the
survivors are scored in fp64 and ordered by (score descending, gallery index ascending). If the (k+1)-th S is
already below T, the top-k by S are the only candidates and, for k = 1 without scores, the answer: no other item
can reach its score. A query with more than ``_MAX_CANDIDATES`` candidates falls back to a full fp32 row, then to a
full fp64 row. Every query gets the exact answer; speed depends only on how often the bound forces re-scoring.
The bound is worst case (Cauchy-Schwarz); bf16's 8-bit significand makes its window about 0.005-0.01 in cosine, so
galleries with many items within that distance of the best re-score more of them.

int8 candidate stage (``precision="int8"``, or "auto" where the calibration measured int8 products fastest).
Gallery rows y_j (fp32 unit rows, or their low-rank coordinates) are quantised symmetrically under one common
scale, b_j = round(y_j / t) in [-127, 127] with t = max_ji |y_ji| / 127, query rows per row (a = round(x / s)).
The integer products P_j = a . b_j are exact in int32 (127^2 D < 2^31 for D <= 133,143), so the stage has neither
accumulation nor output rounding; the real product z_j = (s a).(t b_j) = s t P_j obeys
    |z_j - q.g_j| <= ||s a - q|| max_j ||t b_j|| + ||q|| max_j ||t b_j - g_j|| (+ the low-rank residual) =: E(q)
with ||t b_j - y_j|| and ||s a - x|| bounded from their fp32 evaluation (``_quantize_rows``: the rounding of
s a and of the difference is accounted for, so no fp64 pass is needed). s t > 0 is common to a query's row, so P
itself orders the row like z, ties included, and the candidate set {P >= ceil(v - 2E/(s t))} is the argument
above in units of s t: every gallery item whose upper bound reaches the best lower bound survives, and nothing
else can be the answer. Ranking the exact integers directly saves a rescaling pass over the score block (which
cost about half the int8 product). The int8 window (the quantisation error ~ 0.3 sqrt(D) t, ~0.0075 per side for
unit rows) is several times bf16's, so clustered galleries re-score more candidates; survivors are re-scored like
the half stages' (one sampled fp32 product over the (query, candidate) pairs, ``_candidate_scores32``). "auto"
picks int8 only where it measured 1.25x the best float product (``calibration.fastest_matmul``), runs a first
chunk of 512 queries, and moves to the next-fastest stage (same fp32 copy and basis) when that chunk re-scored
more than Ng/64 rows per query. The int8 code (quantisation, products, top-1 selection) is in
``compat_core.retrieval.int8``.

Raw query rows (fp32 input; int8, bf16 and fp32 stages: fp16's range would overflow): the stages rank the query
rows as given, r = ||r|| q, instead of unit rows. A positive factor per row changes neither the order nor the ties of its scores, and every bound above is
linear in the query, so it holds for r with ||q|| replaced by an upper bound on ||r|| (its fp32 norm inflated by
gamma_D) and no input deviation (r is the input itself); this saves an fp64 norm pass and a normalising pass over
the query matrix. Rows whose fp32 norm lies outside [2^-20, 2^20] (where fp32 products could overflow or lose
accuracy to subnormals) send their chunk to the unit-row path; the fp64 stage always scores unit rows.

Top-1 selection (k = 1, every stage): instead of a top-k, one pass takes the maximum of each block of 64 scores;
the row maximum v is the largest of them, and only the blocks whose maximum reaches the threshold T above are
read entry by entry (``retrieval_int8.select_top1``; floats compared through their bits as integers, rows with
T <= 0 left to ``_select``). The candidate set is the same {S >= T}.

The top-1's own score narrows wide windows (k = 1; rows whose window opens 8 or more blocks of 64): the column
holding a row's maximum stage score is scored in fp32, and its score minus the fp32 bound, L, is a lower bound on
the top-1's reference score; an item whose upper bound S_j + E stays below L cannot hold the top-1, so T becomes
the larger of v - 2E and L - E. The stage's error is mostly quantisation noise, not a shift of the whole row, so L
lies near v and the window is about halved. On the benchmark's full-rank clustered features
(benchmarks/retrieval.py, 4,096 queries) this took the int8 stage from ~175 candidates per query (most rows over
the cap, sent to full fp32 rows, so "auto" demoted int8) to 32, and bf16 from 10 to 5.2 (4.3 with L asked for by
every row); int8 then stays and is the faster stage there too.

Low-rank galleries (junction outputs A h have rank <= m < D): with enough queries, the half stage runs in the
gallery's dominant r-dim subspace U (pivoted block Gram-Schmidt of a sample of gallery rows in fp32, r <= 0.8 D,
then a fixed random rotation that spreads each row's energy over its coordinates for int8): x = U^T q,
y_j = U^T g_j in fp32, and q.g_j = x.y_j + q.(g_j - U y_j) exactly, so the measured max ||g_j - U y_j|| joins E(q)
together with the projection's own rounding (``_Projection``, ``_blocked_matmul``). Queries outside the span
(another model's features) stay exact: the term is bounded with ||q|| = 1. The fp32 and fp64 re-scoring use the
original D-dim rows. The gallery's preparation (fp32 copy, candidate-stage copy, low-rank basis and the measured
deviations) is in ``compat_core.retrieval.space``. An fp32 pass in the same coordinates (r <= D/2: at most about
half the full product's arithmetic; the same bound with no output rounding) is the candidate stage of "auto" where
no half product beats fp32.

"auto" checks its choice on the live call (``compat_core.retrieval.live``): after a warm chunk per worker, probe
chunks alternate between the candidate stage and the fp32 stage (in low-rank coordinates where r <= D/2 and the
candidate stage is not already that), each timed on its worker's CPU clock; a candidate stage more than 10 % slower
in two readings of each side hands every chunk not yet started to the fp32 stage. Every chunk is exact on either
stage, so the check computes nothing twice.

The fp64 reference score of (q, g_j) is ``sum_i q_i * (g_ji / ||g_j||)`` with q = query / ||query|| evaluated in
float64; it equals any other fp64 brute force except at fp64 near-ties (relative gaps ~1e-15), where the order is
this evaluation's. Exact ties (identical gallery rows) go to the lowest gallery index.

Assumption: half-precision matrix products accumulate in fp32 (true for oneDNN AMX/AVX512-BF16 kernels and for
cuBLAS with fp32 output, which is requested on CUDA).

The chunked search is in ``compat_core.retrieval.kernel``, the candidate sets (thresholds, selection, re-scoring)
in ``compat_core.retrieval.candidates``; this module holds the public entry points and the metrics built on them.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from compat_core.hardware.torch_settings import ieee_fp32 as _ieee_fp32
from compat_core.hardware.torch_settings import one_thread
from compat_core.retrieval import pruned as retrieval_pruned
from compat_core.retrieval.kernel import _PARALLEL_PAIRS, _default_chunk, _finish_exact, _Queries, _Result, _search
from compat_core.retrieval.space import _direct_space, _half_dtype_for, _inverse_norms, _with_stage

__all__ = [
    "nearest_neighbours",
    "recall_at_1",
    "recall_at_k",
    "mean_average_precision",
    "class_mean_gallery",
    "PRECISIONS",
    "PreparedGallery",
    "search_prepared",
    "search_candidates",
]

PRECISIONS = ("auto", "int8", "half", "bf16", "fp16", "fp32", "fp64")


# ----------------------------------------------------------------------------------------------------------------
# input checks


def _as_matrix(name: str, value, device: torch.device | None = None) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or numpy array, got {type(value).__name__}")
    if value.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D (rows, dim) array, got shape {tuple(value.shape)}")
    if not value.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point array, got dtype {value.dtype}")
    if value.shape[0] == 0 or value.shape[1] == 0:
        raise ValueError(f"{name}: expected a non-empty array, got shape {tuple(value.shape)}")
    if device is not None and value.device != device:
        value = value.to(device)
    return value.detach()


def _as_labels(name: str, value, expected_len: int) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    labels = np.asarray(value)
    if labels.ndim != 1 or labels.shape[0] != expected_len:
        raise ValueError(f"{name}: expected shape ({expected_len},), got {labels.shape}")
    return labels


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")


def _check_same_dim(query: torch.Tensor, gallery: torch.Tensor) -> None:
    if query.shape[1] != gallery.shape[1]:
        raise ValueError(
            f"query/gallery: feature dimensions differ ({query.shape[1]} vs {gallery.shape[1]})")


def nearest_neighbours(query, gallery, k: int = 1, chunk_size: int | None = None, precision: str = "auto",
                       return_scores: bool = True):
    """Exact cosine top-k: for each query row, the k gallery rows of highest cosine similarity.

    query (Nq, D), gallery (Ng, D): float tensors (CPU or CUDA; the gallery's device is used) or numpy arrays;
    rows are L2-normalised inside. Returns ``(indices, scores)``: indices (Nq, k) int64, 0-based gallery rows in
    descending similarity, exact ties broken by the lowest index; scores (Nq, k) float64 cosine similarities (None
    when ``return_scores`` is False, which skips the final fp64 scoring where it is not needed for k = 1).
    ``precision``: "auto" (the candidate-pass arithmetic measured fastest on this machine by
    ``compat_core.hardware.calibration``: int8, bf16, fp16 or fp32), "int8"/"half"/"bf16"/"fp16" (force that candidate
    stage), "fp32", "fp64" (brute force). The ranking is the same for every choice.
    ``chunk_size``: queries per block (default: a block of scores stays within its stage's budget, 4-33 million
    entries).
    With k = 1 and "auto", large searches group the gallery (spherical k-means) and search only the groups whose
    proven bound can reach a query's best score, where an estimate on a sample of the gallery and a cost model
    from the calibration say it pays (``compat_core.retrieval.pruned``); the answer is the same.
    """
    _check_precision(precision)
    gallery = _as_matrix("gallery", gallery)
    query = _as_matrix("query", query, gallery.device)
    _check_same_dim(query, gallery)
    if k == 1 and precision == "auto":
        with _ieee_fp32():                  # the bounds' fp32 products are IEEE fp32 products
            index, score, _ = retrieval_pruned.search_top1(query, gallery, _group_search(chunk_size),
                                                           want_scores=return_scores)
        return index.unsqueeze(1), None if score is None else score.unsqueeze(1)
    return _whole_gallery(query, gallery, k, chunk_size, precision, return_scores)


def _whole_gallery(query: torch.Tensor, gallery: torch.Tensor, k: int, chunk_size: int | None, precision: str,
                   return_scores: bool):
    """The exact kernel over the whole gallery (checked inputs): ``nearest_neighbours`` without pruning."""
    with torch.inference_mode(), _ieee_fp32():
        space = _direct_space(gallery, precision, query.shape[0])
        queries = _Queries("query", query, raw=True)
        result = _search(space, queries, k, precision, chunk_size, return_scores,
                         rebuild=lambda fallback: _with_stage(space, _half_dtype_for(fallback, gallery.device)))
    return result.index, result.score


def _group_search(chunk_size: int | None):
    """The exact kernel over the whole gallery as the pruned search calls it where pruning does not pay: top-1
    with its fp64 score ("auto" stage, with its live check)."""
    def search(query_rows: torch.Tensor, gallery_rows: torch.Tensor, want_scores: bool, whole: bool = True):
        return _whole_gallery(query_rows, gallery_rows, 1, chunk_size, "auto", want_scores)
    return search


class PreparedGallery:
    """A gallery prepared once for many searches (a search service): :func:`search_prepared` skips the per-call
    preparation (fp64 norms, stage copies, their measured deviations) that dominates single-query calls of
    :func:`nearest_neighbours` on large galleries. Read-only once built, so threads may search it at once.

    gallery (Ng, D): float tensor or numpy array; precision: as in :func:`nearest_neighbours`.
    """

    def __init__(self, gallery, precision: str = "auto") -> None:
        _check_precision(precision)
        self.gallery = _as_matrix("gallery", gallery)
        self.precision = precision
        with torch.inference_mode(), _ieee_fp32():
            self._space = _direct_space(self.gallery, precision, 0)

    @property
    def size(self) -> int:
        return int(self.gallery.shape[0])

    @property
    def dim(self) -> int:
        return int(self.gallery.shape[1])

    def _rebuild(self, fallback: str):
        # "auto" left the int8 stage for these data: keep the other stage for the next searches too
        self._space = _with_stage(self._space, _half_dtype_for(fallback, self.gallery.device))
        return self._space


def search_prepared(query, prepared: PreparedGallery, k: int = 1, chunk_size: int | None = None,
                    return_scores: bool = True):
    """:func:`nearest_neighbours` on a :class:`PreparedGallery`: the same exact top-k (indices (Nq, k) int64,
    lowest index among exact ties; fp64 cosine scores (Nq, k) or None), the gallery's preparation reused."""
    if not isinstance(prepared, PreparedGallery):
        raise TypeError(f"prepared: expected a PreparedGallery, got {type(prepared).__name__}")
    query = _as_matrix("query", query, prepared.gallery.device)
    _check_same_dim(query, prepared.gallery)
    space = prepared._space
    with torch.inference_mode(), _ieee_fp32():
        queries = _Queries("query", query, raw=True)
        result = _search(space, queries, k, prepared.precision, chunk_size, return_scores, rebuild=prepared._rebuild)
    return result.index, result.score


def search_candidates(query, prepared: PreparedGallery, candidates, k: int = 1):
    """Exact top-k of each query row among its own candidate gallery rows (an approximate stage's output).

    candidates (Nq, C) int64 gallery rows, -1 for none; every row needs at least k distinct valid candidates
    (ValueError otherwise). Scores are the fp64 reference scores of :func:`search_prepared`, bit for bit, ordered
    by (score descending, gallery index ascending), so a candidate set holding the exact top-k gives exactly
    :func:`search_prepared`'s answer. Returns (indices (Nq, k) int64, fp64 cosine scores (Nq, k))."""
    if not isinstance(prepared, PreparedGallery):
        raise TypeError(f"prepared: expected a PreparedGallery, got {type(prepared).__name__}")
    query = _as_matrix("query", query, prepared.gallery.device)
    _check_same_dim(query, prepared.gallery)
    cand = torch.as_tensor(np.asarray(candidates), dtype=torch.long, device=query.device)
    if cand.ndim != 2 or cand.shape[0] != query.shape[0]:
        raise ValueError(f"candidates: expected shape ({query.shape[0]}, C), got {tuple(cand.shape)}")
    if bool((cand >= prepared.size).any()) or bool((cand < -1).any()):
        raise ValueError(f"candidates: expected gallery rows in 0..{prepared.size - 1} or -1")
    # ascending rows with duplicates and padding (-1) moved to the end: the fp64 stage's stable sort then breaks
    # exact ties by the lowest gallery row
    cand = torch.where(cand < 0, prepared.size, cand).sort(dim=1).values
    repeated = torch.zeros_like(cand, dtype=torch.bool)
    repeated[:, 1:] = cand[:, 1:] == cand[:, :-1]
    cand = torch.where(repeated | (cand >= prepared.size), -1, cand)
    cand = torch.where(cand < 0, prepared.size, cand).sort(dim=1).values
    cand = torch.where(cand >= prepared.size, -1, cand)
    short = (cand >= 0).sum(dim=1) < k
    if bool(short.any()):
        raise ValueError(f"candidates: query row {int(torch.nonzero(short)[0, 0])} has fewer than k = {k} "
                         "distinct gallery rows")
    # few pairs: one thread (the kernel's re-scoring rule), as thread hand-offs cost more than the products
    small = query.device.type == "cpu" and cand.numel() < _PARALLEL_PAIRS
    with torch.inference_mode(), _ieee_fp32(), one_thread() if small else contextlib.nullcontext():
        queries = _Queries("query", query, raw=True)
        result = _Result(queries.count, k, query.device, True)
        _finish_exact(prepared._space, queries, cand, torch.arange(queries.count, device=query.device), k, result)
    return result.index, result.score


def recall_at_k(query, query_labels, gallery, gallery_labels, k: int, chunk_size: int | None = None,
                precision: str = "auto") -> float:
    """1:N Recall@k as a fraction in [0, 1]: share of queries with a same-label item among their k nearest
    gallery rows by cosine similarity (ties at the k-th place resolved by the lowest gallery index)."""
    query = _as_matrix("query", query)
    gallery = _as_matrix("gallery", gallery)
    q_labels = _as_labels("query_labels", query_labels, query.shape[0])
    g_labels = _as_labels("gallery_labels", gallery_labels, gallery.shape[0])
    if k == 1 and precision == "auto":
        # the gallery's classes as groups: searched only where a proven bound can reach the best score found
        _check_same_dim(query, gallery)
        with _ieee_fp32():
            top1, _, _ = retrieval_pruned.search_top1(query.to(gallery.device), gallery,
                                                      _group_search(chunk_size), labels=g_labels)
        index = top1.unsqueeze(1)
    else:
        index, _ = nearest_neighbours(query, gallery, k, chunk_size, precision, return_scores=False)
    retrieved = g_labels[index.cpu().numpy()]
    return float(np.mean(np.any(retrieved == q_labels[:, None], axis=1)))


def recall_at_1(query, query_labels, gallery, gallery_labels, chunk_size: int | None = None,
                precision: str = "auto") -> float:
    """1:N Recall@1 as a fraction in [0, 1]: share of queries whose most cosine-similar gallery row (lowest index
    among exact ties) has the query's label. query (Nq, D), gallery (Ng, D), labels (Nq,) and (Ng,)."""
    return recall_at_k(query, query_labels, gallery, gallery_labels, 1, chunk_size, precision)


def mean_average_precision(query, query_labels, gallery, gallery_labels, chunk_size: int | None = None,
                           no_relevant: str = "skip") -> float:
    """Re-identification mAP as a fraction in [0, 1], ranking the whole gallery by fp64 cosine similarity.

    AP of a query = mean over its R relevant (same-label) gallery items of precision at each one's 1-based rank,
    the ranking ordered by (similarity desc, gallery index asc). Queries without any relevant gallery item have no
    AP: ``no_relevant="skip"`` leaves them out of the mean (as the Market-1501 protocol does), ``"zero"`` counts
    them as 0. Raises ValueError when every query is skipped.
    """
    if no_relevant not in ("skip", "zero"):
        raise ValueError(f"no_relevant: expected 'skip' or 'zero', got {no_relevant!r}")
    gallery = _as_matrix("gallery", gallery)
    query = _as_matrix("query", query, gallery.device)
    _check_same_dim(query, gallery)
    q_np = _as_labels("query_labels", query_labels, query.shape[0])
    g_np = _as_labels("gallery_labels", gallery_labels, gallery.shape[0])
    # integer codes let labels of any type (strings included) be compared on the device
    _, codes = np.unique(np.concatenate([q_np, g_np]), return_inverse=True)
    q_labels = torch.as_tensor(codes[:len(q_np)], device=gallery.device)
    g_labels = torch.as_tensor(codes[len(q_np):], device=gallery.device)
    chunk = chunk_size if chunk_size is not None else _default_chunk(gallery.shape[0])
    if chunk < 1:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size}")
    with torch.inference_mode():
        gallery64 = gallery.double() * _inverse_norms("gallery", gallery)[:, None]
        queries = _Queries("query", query)
        ap_values = []
        for start in range(0, query.shape[0], chunk):
            stop = min(query.shape[0], start + chunk)
            scores = queries.fp64(torch.arange(start, stop, device=gallery.device)) @ gallery64.t()
            order = torch.sort(scores, dim=1, descending=True, stable=True).indices
            relevant = (g_labels[order] == q_labels[start:stop, None]).double()
            hits = torch.cumsum(relevant, dim=1)
            ranks = torch.arange(1, gallery.shape[0] + 1, device=gallery.device, dtype=torch.float64)
            total = relevant.sum(dim=1)
            ap = (relevant * hits / ranks).sum(dim=1) / total.clamp(min=1)
            if no_relevant == "skip":
                ap = ap[total > 0]
            ap_values.append(ap)
        all_ap = torch.cat(ap_values)
    if all_ap.numel() == 0:
        raise ValueError("query_labels: no query has a relevant gallery item; mAP is undefined")
    return float(all_ap.mean())


def class_mean_gallery(features, labels) -> tuple[torch.Tensor, np.ndarray]:
    """Templates for the ``gallery: class_means`` protocol.

    features (N, D), labels (N,). Each feature is L2-normalised, averaged per class, and the mean re-normalised.
    Returns (templates (C, D) float32 unit rows, template_labels (C,) sorted distinct labels).
    """
    features = _as_matrix("features", features)
    labels_np = _as_labels("labels", labels, features.shape[0])
    classes, inverse = np.unique(labels_np, return_inverse=True)
    with torch.inference_mode():
        unit = features.double() * _inverse_norms("features", features)[:, None]
        sums = torch.zeros((len(classes), features.shape[1]), dtype=torch.float64, device=features.device)
        sums.index_add_(0, torch.as_tensor(inverse, device=features.device), unit)
        norms = torch.linalg.vector_norm(sums, dim=1)
        if bool((norms <= 0).any()):
            bad = classes[int(torch.nonzero(norms <= 0)[0, 0])]
            raise ValueError(f"features: the normalised features of class {bad!r} sum to zero; no mean direction")
        templates = (sums / norms[:, None]).float()
    return templates, classes

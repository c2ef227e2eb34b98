"""Exact cosine retrieval (1:N Recall@k, mAP); the exact linear-head bridge (SPEC §7) that searches with it is in
``compat_core.retrieval_bridge``, 1:1 verification in ``compat_core.verification``.

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
``compat_core.retrieval_int8``.

Raw query rows (int8 stage, fp32 input): the stage ranks the query rows as given, r = ||r|| q, instead of unit
rows. A positive factor per row changes neither the order nor the ties of its scores, and every bound above is
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
deviations) is in ``compat_core.retrieval_space``.

The fp64 reference score of (q, g_j) is ``sum_i q_i * (g_ji / ||g_j||)`` with q = query / ||query|| evaluated in
float64; it equals any other fp64 brute force except at fp64 near-ties (relative gaps ~1e-15), where the order is
this evaluation's. Exact ties (identical gallery rows) go to the lowest gallery index.

Assumption: half-precision matrix products accumulate in fp32 (true for oneDNN AMX/AVX512-BF16 kernels and for
cuBLAS with fp32 output, which is requested on CUDA).
"""
from __future__ import annotations

import contextlib
import math
import time
import warnings
from typing import Callable

import numpy as np
import torch

from compat_core import retrieval_pruned
from compat_core.calibration import fastest_matmul
from compat_core.retrieval_int8 import SLACK as _SLACK
from compat_core.retrieval_int8 import U32 as _U32
from compat_core.retrieval_int8 import gamma as _gamma
from compat_core.retrieval_int8 import int8_stage as _int8_stage
from compat_core.retrieval_int8 import int8_top1_candidates
from compat_core.retrieval_int8 import norm32_upper as _norm32_upper
from compat_core.retrieval_int8 import pad_candidates as _pad_candidates
from compat_core.retrieval_int8 import select_top1
from compat_core.retrieval_space import (_direct_space, _half_dtype_for, _inverse_norms, _project_queries, _Space,
                                         _with_stage)
from compat_core.torch_settings import ieee_fp32 as _ieee_fp32
from compat_core.torch_settings import one_thread as _one_thread
from compat_core.torch_settings import run_chunks

__all__ = [
    "nearest_neighbours",
    "recall_at_1",
    "recall_at_k",
    "mean_average_precision",
    "class_mean_gallery",
    "PRECISIONS",
    "PreparedGallery",
    "search_prepared",
]

PRECISIONS = ("auto", "int8", "half", "bf16", "fp16", "fp32", "fp64")
_MAX_CANDIDATES = 256          # wider candidate sets are cheaper as a full fp32 row than as gathered rows
_GATHER_VS_DENSE = 32          # a gathered candidate costs about as much as this many gallery rows of a dense product
# "auto" with an int8 stage: when the first chunk leaves more than Ng / this many rows per query to re-scoring,
# the int8 window (~7x bf16's) is too wide for these data and the rest runs on the next-fastest stage
_INT8_DEMOTE_FRACTION = 64
_INT8_PROBE_QUERIES = 512      # size of that first chunk
_LIVE_CHECK_CHUNKS = 8         # the live check runs on searches of at least this many first chunks
_LIVE_MARGIN = 1.1             # a stage slower than the kernel's fp32 stage by more than this is left
_GATHER_BUDGET = 1 << 22       # elements per gathered (rows x candidates x D) block: bounds re-scoring memory
_SCORE_BUDGET = 1 << 26        # elements of one (query chunk x gallery) score block
# int8 with k = 1: the query chunk is projected and quantised at once, its products and selection run in smaller
# blocks (``retrieval_int8.int8_top1_candidates``); k > 1 keeps int8 score blocks of that smaller size
_INT8_SCORE_BUDGET = 5 << 20
_INT8_TOP1_SCORE_BUDGET = 1 << 25
_HALF_SCORE_BUDGET = 10 << 20   # bf16 / fp16 score blocks, for the same reasons: measured on one core at Ng = 10,000,
                                # D = 1023, 1024-query chunks take the bf16 product from 6.1 s to 5.0 s per 50,000
_PARALLEL_PAIRS = 1 << 16      # candidate pairs per chunk from which re-scoring uses the thread pool
_UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 0.0}


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


# ----------------------------------------------------------------------------------------------------------------
# the kernel


def _stage_bound(dev_x: torch.Tensor, norm_x: torch.Tensor, y_norm: float, y_dev: float, dim: int,
                 absolute: float = 0.0, ref_norm: float = 1.0 + 1e-12) -> torch.Tensor:
    """Input-rounding + fp32-accumulation part of E(q) (module docstring), fp64 (n,); ``ref_norm`` bounds the
    reference query's norm (1 + 1e-12 for unit rows, ||U||_2 for projected ones)."""
    gamma = _gamma(dim, _U32)
    bound = dev_x * y_norm + ref_norm * y_dev + gamma * norm_x * y_norm + absolute
    return bound * _SLACK


def _round_down(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Largest ``dtype`` value <= each fp64 value, so a comparison in ``dtype`` never drops a candidate."""
    if dtype == torch.float64:
        return values
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.floor(values).clamp(info.min, info.max).to(dtype)
    rounded = values.to(dtype)
    too_big = rounded.double() > values
    if bool(too_big.any()):
        int_type = torch.int16 if dtype in (torch.bfloat16, torch.float16) else torch.int32
        bits = rounded.view(int_type)
        # sign-magnitude: stepping down is -1 on the bits of a positive value, +1 on those of a negative one
        positive = bits > 0
        stepped = torch.where(positive, bits - 1, bits + 1)
        smallest_negative = torch.iinfo(int_type).min + 1          # -0 bits + 1: the negative subnormal
        stepped = torch.where(bits == 0, torch.full_like(bits, smallest_negative), stepped)
        rounded = torch.where(too_big, stepped.view(dtype), rounded)
    return rounded


_ORDERED_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
                torch.float64: torch.int64}


_TOP_PROBE = 16                # rows whose candidates all lie in their top 16 skip the threshold pass


def _select(scores: torch.Tensor, bound: torch.Tensor, k: int, cap: int | None, out_unit: float = 0.0):
    """Candidates {S >= v_k - u|v_k| - 2E} of each row; rows with more than ``cap`` come back separately.

    ``out_unit`` is the unit roundoff of the stored scores (rounding is monotone, so it costs u|v_k| once; see
    the module docstring; 0 for exact integer scores). Returns (rows_ok, candidates (n_ok, w) int64 padded with
    -1, ascending index order, rows_wide).

    Comparing the whole block against the threshold costs more than finding the top entries, so one top-16 pass
    (about the cost of a top-2) settles every row whose 16th score is already below its threshold: its candidates
    are its top entries at or above it. Only the other rows are compared with their threshold over the whole row.
    Floats are ranked through their bits read as integers (non-negative floats order like them, and an integer
    top-k is several times faster, bf16 especially); rows whose top entries include a negative value (or -0) take
    a float top-k instead.
    """
    width = scores.shape[1]
    probe = min(width, max(k + 1, _TOP_PROBE))
    floating = scores.dtype.is_floating_point
    keys = scores.view(_ORDERED_INT[scores.dtype]) if floating else scores
    top = keys.topk(probe, dim=1, sorted=True)
    values, indices = top.values, top.indices
    if floating:
        misordered = torch.nonzero(values[:, -1] < 0).squeeze(1)      # a negative float among the top entries
        values = values.view(scores.dtype)
        if misordered.numel():
            exact = scores[misordered].topk(probe, dim=1, sorted=True)
            values[misordered] = exact.values
            indices[misordered] = exact.indices
    with _one_thread():        # below: per-row vectors and the few open rows, small operations
        return _select_from_top(scores, values, indices, probe, bound, k, cap, out_unit)


def _select_from_top(scores: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, probe: int,
                     bound: torch.Tensor, k: int, cap: int | None, out_unit: float):
    """``_select`` after its top-``probe`` pass: thresholds, settled rows, and the full comparison of open rows."""
    width = scores.shape[1]
    kth = values[:, k - 1].double()
    # the 1e-12 term absorbs the fp64 rounding of this expression itself
    threshold64 = kth - out_unit * kth.abs() - 2.0 * bound - 1e-12 * (1.0 + kth.abs())
    threshold = _round_down(threshold64, scores.dtype)
    if probe == width:
        complete = torch.ones_like(kth, dtype=torch.bool)
    else:
        complete = values[:, -1] < threshold
    rows_settled = torch.nonzero(complete).squeeze(1)
    rows_open = torch.nonzero(~complete).squeeze(1)
    inside = values[rows_settled] >= threshold[rows_settled].unsqueeze(1)
    beyond = torch.iinfo(torch.long).max
    settled_cand = torch.where(inside, indices[rows_settled], torch.full_like(indices[rows_settled], beyond))
    settled_cand = torch.sort(settled_cand, dim=1).values
    settled_cand = settled_cand[:, :max(k, int(inside.sum(dim=1).max()) if inside.numel() else k)]
    settled_cand = settled_cand.masked_fill(settled_cand == beyond, -1)
    mask = scores[rows_open] >= threshold[rows_open].unsqueeze(1)
    row, column = torch.nonzero(mask, as_tuple=True)
    counts = torch.bincount(row, minlength=rows_open.numel())
    fits = torch.ones_like(counts, dtype=torch.bool) if cap is None else counts <= cap
    keep = fits[row]
    open_cand = _pad_candidates(row[keep], column[keep], counts.masked_fill(~fits, 0))[fits]
    rows_open_ok = rows_open[fits]
    width_out = max(settled_cand.shape[1], open_cand.shape[1])
    candidates = torch.full((rows_settled.numel() + rows_open_ok.numel(), width_out), -1, dtype=torch.long,
                            device=scores.device)
    candidates[:rows_settled.numel(), :settled_cand.shape[1]] = settled_cand
    candidates[rows_settled.numel():, :open_cand.shape[1]] = open_cand
    return torch.cat([rows_settled, rows_open_ok]), candidates, rows_open[~fits]


def _select_top1(scores: torch.Tensor, bound: torch.Tensor, cap: int | None, out_unit: float = 0.0,
                 lower: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None):
    """``_select`` for k = 1 by block maxima (``retrieval_int8.select_top1``); the rows it leaves over (float
    scores whose threshold is <= 0) go through ``_select``. Same return value as ``_select``.
    ``lower(rows, columns)``: lower bounds on reference scores (``_exact_lower``) that narrow the threshold."""
    rows, cand, wide, other = select_top1(scores, bound, cap, out_unit, _round_down, lower)
    if other.numel() == 0:
        return rows, cand, wide
    with _one_thread():
        rows2, cand2, wide2 = _select(scores[other], bound[other], 1, cap, out_unit)
        width = max(cand.shape[1], cand2.shape[1])
        merged = torch.full((rows.numel() + rows2.numel(), width), -1, dtype=torch.long, device=cand.device)
        merged[:rows.numel(), :cand.shape[1]] = cand
        merged[rows.numel():, :cand2.shape[1]] = cand2
        return torch.cat([rows, other[rows2]]), merged, torch.cat([wide, other[wide2]])


def _gathered_scores(query_rows: torch.Tensor, candidates: torch.Tensor, rows_of: Callable,
                     same_reduction: bool) -> torch.Tensor:
    """Scores of each query row against its padded candidates (-inf on padding), in blocks of bounded memory.

    ``same_reduction``: reduce every candidate with the identical elementwise-product-and-sum (identical gallery
    rows then tie bit for bit, which the fp64 stage needs); otherwise a batched matrix product (faster; the fp32
    bound holds for any summation order).
    """
    count, width = candidates.shape
    dim = query_rows.shape[1]
    out = torch.full((count, width), -math.inf, dtype=query_rows.dtype, device=query_rows.device)
    if width == 0 or count == 0:
        return out
    # rows in order of their last valid position (filtering leaves gaps), so each block is padded only to its
    # own widest row
    positions = torch.arange(1, width + 1, device=candidates.device)
    counts = torch.where(candidates >= 0, positions, torch.zeros_like(positions)).max(dim=1).values
    order = torch.argsort(counts)
    counts_sorted = counts[order].tolist()
    buffer = torch.empty((_GATHER_BUDGET // dim + width, dim), dtype=query_rows.dtype, device=query_rows.device)
    start = 0
    while start < count:
        stop = min(count, start + max(1, _GATHER_BUDGET // (max(1, counts_sorted[start]) * dim)))
        stop = min(stop, start + max(1, _GATHER_BUDGET // (max(1, counts_sorted[stop - 1]) * dim)))
        block_width = max(1, counts_sorted[stop - 1])
        rows = order[start:stop]
        block = candidates[rows, :block_width]
        flat = block.clamp(min=0).reshape(-1)
        # one reused gather buffer: fresh large allocations cost page faults that dominate the gather
        vectors = rows_of(flat, buffer[:flat.numel()]).view(stop - start, block_width, dim)
        if same_reduction:
            scores = (vectors * query_rows[rows].unsqueeze(1)).sum(dim=-1)
        else:
            scores = torch.bmm(vectors, query_rows[rows].unsqueeze(2)).squeeze(2)
        out[rows, :block_width] = scores.masked_fill(block < 0, -math.inf)
        start = stop
    return out


def _candidate_scores32(query_rows: torch.Tensor, candidates: torch.Tensor, gallery32: torch.Tensor) -> torch.Tensor:
    """fp32 scores of each query row against its padded candidates (-inf on padding) as one sampled product:
    only the (candidate, row) entries of gallery32 @ query_rows^T are computed, each an fp32 dot product (the
    fp32 bound holds in any summation order), without copying candidate rows.

    The pattern is gallery-major (CSR rows = gallery items): the pairs that share a gallery row are computed
    one after another, so each gallery row is read from memory once per call while the chunk's query rows stay
    in cache; query-major order read a random gallery row per pair. Measured on the benchmark's full-rank data
    (int8 stage, ~32 candidates per query, 50,000 queries, 2 threads): 0.45 s query-major, 0.22 s gallery-major."""
    count, width = candidates.shape
    valid = candidates >= 0
    if count == 0 or width == 0 or not bool(valid.any()):
        return torch.full((count, width), -math.inf, dtype=torch.float32, device=query_rows.device)
    size = gallery32.shape[0]
    row, position = torch.nonzero(valid, as_tuple=True)
    column = candidates[row, position]
    # gallery-major, queries ascending within: ``nonzero`` lists the pairs row-major, so a stable sort by column
    # alone keeps that order (measured 2.0 ms in int32 vs 4.5 ms for an argsort of column * count + row at
    # 107,000 pairs)
    order = torch.sort(column.to(torch.int32) if size < 2 ** 31 else column, stable=True).indices
    try:
        crow = torch.zeros(size + 1, dtype=torch.long, device=candidates.device)
        torch.cumsum(torch.bincount(column, minlength=size), 0, out=crow[1:])
        with warnings.catch_warnings():   # "CSR support is in beta": the sampled product is what is used of it
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta", category=UserWarning)
            pattern = torch.sparse_csr_tensor(crow, row[order], torch.zeros(order.numel(), dtype=torch.float32,
                                                                           device=candidates.device),
                                              size=(size, count), check_invariants=False)
        values = torch.sparse.sampled_addmm(pattern, gallery32, query_rows.t(), beta=0.0).values()
    except (RuntimeError, NotImplementedError):   # a backend without sampled products: gathered rows
        return _gathered_scores(query_rows, candidates,
                                lambda index, out: torch.index_select(gallery32, 0, index, out=out),
                                same_reduction=False)
    out = torch.full((count, width), -math.inf, dtype=torch.float32, device=query_rows.device)
    out.view(-1)[(row * width + position)[order]] = values       # one flat index: cheaper than two gathered ones
    return out


def _filter(scores: torch.Tensor, candidates: torch.Tensor, bound: torch.Tensor, k: int) -> torch.Tensor:
    """Drop candidates that cannot reach the top-k given scores within ``bound``. The survivors are moved to the
    front of their row in ascending index order, padded with -1 to the widest row: the fp64 stage gathers every
    position up to a row's last survivor, so leaving the gaps cost it ~17x more rows on wide int8 windows."""
    kth = scores.topk(k, dim=1).values[:, k - 1] if k > 1 else scores.max(dim=1).values
    keep = (scores.double() >= (kth.double() - 2.0 * bound).unsqueeze(1)) & (candidates >= 0)
    if keep.numel() == 0:
        return candidates
    # a stable sort of "dropped" flags moves the kept entries forward without reordering them
    order = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices
    width = max(k, int(keep.sum(dim=1).max()))
    kept = torch.gather(torch.where(keep, candidates, torch.full_like(candidates, -1)), 1, order[:, :width])
    return kept


class _Result:
    def __init__(self, count: int, k: int, device: torch.device, want_scores: bool) -> None:
        self.index = torch.full((count, k), -1, dtype=torch.long, device=device)
        self.score = torch.full((count, k), math.nan, dtype=torch.float64, device=device) if want_scores else None


class _Queries:
    """Query rows as the stages need them: fp32 unit rows for the fast stages, fp64 reference rows on demand.

    ``raw``: the int8 stage will take the raw fp32 rows (``raw_rows``), so the rows are checked by one fp32 norm
    pass (fp64 only for rows it cannot vouch for) and the fp64 inverse norms are computed per chunk or per
    re-scored row, when a stage asks for them, instead of in a pass over every row (it cost about as much as a
    tenth of the int8 product)."""

    _RAW_RANGE = (2.0 ** -20, 2.0 ** 20)   # raw fp32 rows with norms in here neither overflow nor lose accuracy
                                            # to subnormals in the stage's products

    def __init__(self, name: str, rows: torch.Tensor, raw: bool = False) -> None:
        self.rows = rows
        self.count = rows.shape[0]
        self.inverse64 = None
        self.norm32 = None          # fp64 upper bounds on the fp32 rows' norms (raw mode)
        self.raw_ok = None          # per row: usable raw (raw mode)
        if not (raw and rows.dtype == torch.float32):
            self.inverse64 = _inverse_norms(name, rows)
            return
        norms = torch.linalg.vector_norm(rows, dim=1)
        low, high = self._RAW_RANGE
        self.raw_ok = (norms >= low) & (norms <= high)
        doubtful = torch.nonzero(~self.raw_ok).squeeze(1)
        if doubtful.numel():
            # zero, non-finite, or merely out of the fp32 range: the fp64 norms decide (and name the first bad row)
            try:
                _inverse_norms(name, rows[doubtful])
            except ValueError:
                norms64 = torch.linalg.vector_norm(rows[doubtful], dim=1, dtype=torch.float64)
                first = int(doubtful[torch.nonzero(~(norms64 > 0) | ~torch.isfinite(norms64))[0, 0]])
                raise ValueError(f"{name}: row {first} has zero or non-finite norm; cosine similarity is undefined")
        self.norm32 = norms.double() * (1.0 + 2.0 * _gamma(rows.shape[1], _U32))

    def raw_rows(self, start: int, stop: int) -> torch.Tensor | None:
        """The fp32 rows start..stop-1 as given (not normalised), or None when some row's norm is out of range."""
        if self.raw_ok is None or not bool(self.raw_ok[start:stop].all()):
            return None
        return self.rows[start:stop].contiguous()

    def _inverse(self, rows: torch.Tensor) -> torch.Tensor:
        return 1.0 / torch.linalg.vector_norm(rows, dim=1, dtype=torch.float64)

    def fp32(self, start: int, stop: int) -> torch.Tensor:
        # per component: input conversion, the fp32 inverse norm and the product each round once (<= 3 u32)
        inverse = self.inverse64[start:stop] if self.inverse64 is not None else self._inverse(self.rows[start:stop])
        return self.rows[start:stop].float() * inverse.float()[:, None]

    def fp64(self, index: torch.Tensor) -> torch.Tensor:
        rows = self.rows[index]
        inverse = self.inverse64[index] if self.inverse64 is not None else self._inverse(rows)
        return rows.double() * inverse[:, None]


def _search_chunk(space: _Space, queries: _Queries, start: int, stop: int, k: int, want_scores: bool,
                  start_stage: str, result: _Result) -> float:
    """Exact top-k of query rows start..stop-1; writes those rows of ``result``. Returns the mean number of
    gallery rows per query that the candidate stage left to fp32 re-scoring (full rows count as Ng; 0 without
    a candidate stage)."""
    if start_stage == "fp64":
        _full_fp64(space, queries, torch.arange(start, stop, device=result.index.device), k, result)
        return
    dim = space.dim
    int8 = start_stage == "half" and space.half_dtype == torch.int8
    q32 = queries.raw_rows(start, stop) if int8 else None
    if q32 is not None:
        # the int8 stage ranks the raw fp32 rows r: a positive factor per row changes neither the order nor the
        # ties of a row, and every bound below holds for r with ||r|| <= norm32 (the unit-row bounds scaled by
        # ||r||; r is the exact input, so no input deviation); the fp64 stage still scores unit rows
        norm32 = queries.norm32[start:stop]
        dev32 = torch.zeros_like(norm32)
        ref = norm32
    else:
        q32 = queries.fp32(start, stop)
        norm32 = _norm32_upper(q32)
        dev32 = 3.0 * _U32 * (1.0 + 1e-12) * torch.ones_like(norm32)      # ||q32 - q||, q the fp64 unit row
        ref = 1.0 + 1e-12
    bound32 = _stage_bound(dev32, norm32, space.norm32_max, space.dev32_max, dim, ref_norm=ref)
    lower = _exact_lower(q32, space.stage32, bound32)
    single_ok = k == 1 and not want_scores
    offset = start
    if start_stage == "half":
        if space.projection is None:
            x32, dev_x, ref_norm, half_dim, residual = q32, dev32, ref, dim, 0.0
        else:
            x32, dev_x = _project_queries(q32, norm32, dev32, space.projection)
            ref_norm, half_dim = space.projection.basis_norm * ref, space.projection.basis.shape[1]
            residual = ref * space.projection.residual_max          # |q.(g - U y)| <= ||q|| ||res||
        cap = max(k + 1, min(_MAX_CANDIDATES, space.size // _GATHER_VS_DENSE)) + k
        if space.half_dtype == torch.int8 and k == 1:
            scores = None
            rows, cand, fp32_rows = int8_top1_candidates(x32, dev_x, space, ref_norm, residual, cap, _round_down,
                                                         lower)
        elif space.half_dtype == torch.int8:
            scores, bound_h, out_unit = _int8_stage(x32, dev_x, space, ref_norm, residual)
        else:
            qh = x32.to(space.half_dtype)
            qh32 = qh.float()
            dev_h = _norm32_upper(qh32 - x32) + dev_x                     # the difference is exact in fp32
            bound_h = _stage_bound(dev_h, _norm32_upper(qh32), space.norm_half_max, space.dev_half_max, half_dim,
                                   absolute=2.0 ** -24 + residual,        # subnormal outputs: absolute rounding
                                   ref_norm=ref_norm)
            scores, out_unit = _half_scores(qh, space.half_t)
            del qh, qh32
        del x32
        # (cap: wider candidate sets are cheaper as full fp32 rows, one dense product, than as gathered rows)
        if scores is not None and k == 1:
            rows, cand, fp32_rows = _select_top1(scores, bound_h, cap, out_unit, lower)
        elif scores is not None:
            rows, cand, fp32_rows = _select(scores, bound_h, k, cap, out_unit)
        del scores
        pairs = int((cand >= 0).sum())
        rescored = (pairs + fp32_rows.numel() * space.size) / max(1, stop - start)
        # a few candidates per row: many small operations, on one thread; wide windows (int8 on full-rank rows,
        # ~100,000 pairs per chunk) give each operation enough work for the thread pool
        serial = _one_thread() if pairs < _PARALLEL_PAIRS else contextlib.nullcontext()
        with serial:
            if single_ok:
                rows, cand = _take_singles(rows, cand, result, offset)
            if rows.numel():
                # half-precision candidates: re-score in fp32 and narrow them with the fp32 bound
                s32 = _candidate_scores32(q32[rows], cand, space.stage32)
                cand = _filter(s32, cand, bound32[rows], k)
                if single_ok:
                    rows, cand = _take_singles(rows, cand, result, offset)
                _finish_exact(space, queries, cand, rows + offset, k, result)
    else:
        fp32_rows = torch.arange(stop - start, device=q32.device)
        rescored = 0.0
    if fp32_rows.numel():
        # full fp32 rows against a transposed view: the fp32 BLAS takes it at near full speed
        scores = q32[fp32_rows] @ space.stage32.t()
        if k == 1:
            local, cand, wide = _select_top1(scores, bound32[fp32_rows], _MAX_CANDIDATES + k)
        else:
            local, cand, wide = _select(scores, bound32[fp32_rows], k, _MAX_CANDIDATES + k)
        del scores
        rows = fp32_rows[local]
        if single_ok:
            rows, cand = _take_singles(rows, cand, result, offset)
        _finish_exact(space, queries, cand, rows + offset, k, result)
        _full_fp64(space, queries, fp32_rows[wide] + offset, k, result)
    return rescored


def _exact_lower(q32: torch.Tensor, stage32: torch.Tensor, bound32: torch.Tensor):
    """``lower(rows, columns)``: fp64 lower bounds on the reference scores of the pairs (q32 row, gallery column):
    their fp32 dot products minus the fp32 bound ``bound32`` of each row (any summation order; gamma_D)."""
    def lower(rows: torch.Tensor | slice, columns: torch.Tensor) -> torch.Tensor:
        # row-wise dot products as a product and a sum (gamma_D like any order; measured ~1.5x faster than bmm
        # of 1 x D by D x 1 matrices)
        scores = (q32[rows] * torch.index_select(stage32, 0, columns)).sum(dim=1)
        return scores.double() - bound32[rows]
    return lower


def _take_singles(rows: torch.Tensor, cand: torch.Tensor, result: "_Result", offset: int):
    """Rows with exactly one candidate left are answered (top-1): no other item can reach its score."""
    single = (cand >= 0).sum(dim=1) == 1
    if bool(single.any()):
        result.index[offset + rows[single], 0] = cand[single].max(dim=1).values    # padding is -1
    keep = ~single
    return rows[keep], cand[keep]


def _half_scores(qh: torch.Tensor, half_t: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Half-precision products; fp32 output where the backend offers it (CUDA), else rounded to the half dtype."""
    if qh.device.type == "cuda":
        try:
            return torch.mm(qh, half_t, out_dtype=torch.float32), 0.0
        except (TypeError, RuntimeError):
            # without an fp32 output, forbid reduced-precision (half) split-K accumulation the bound excludes
            matmul = torch.backends.cuda.matmul
            saved = (matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction)
            matmul.allow_fp16_reduced_precision_reduction = False
            matmul.allow_bf16_reduced_precision_reduction = False
            try:
                return qh @ half_t, _UNIT_ROUNDOFF[qh.dtype]
            finally:
                matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction = saved
    return qh @ half_t, _UNIT_ROUNDOFF[qh.dtype]


def _finish_exact(space: _Space, queries: _Queries, cand: torch.Tensor, rows: torch.Tensor, k: int,
                  result: _Result) -> None:
    """Score the surviving candidates in fp64 and order them by (score desc, gallery index asc).

    ``rows``: absolute query indices."""
    if rows.numel() == 0:
        return
    s64 = _gathered_scores(queries.fp64(rows), cand, space.exact_rows, same_reduction=True)
    # candidates ascend in index along each row (padding last with -inf), so a stable sort breaks ties by index
    order = torch.sort(s64, dim=1, descending=True, stable=True).indices[:, :k]
    result.index[rows] = torch.gather(cand, 1, order)
    if result.score is not None:
        result.score[rows] = torch.gather(s64, 1, order)


def _full_fp64(space: _Space, queries: _Queries, rows: torch.Tensor, k: int, result: _Result) -> None:
    """Fallback (and precision='fp64'): full fp64 rows, then the exact gathered evaluation on near-ties.

    ``rows``: absolute query indices."""
    if rows.numel() == 0:
        return
    # two fp64 evaluations of the same unit-vector products differ by at most 2 gamma_D ||q|| ||g||
    bound_value = 2.0 * _gamma(space.dim, 2.0 ** -53) * (1.0 + 1e-12) * space.norm64_max * _SLACK
    step = max(1, _SCORE_BUDGET // space.size)
    block = max(1, (1 << 22) // space.dim)
    for start in range(0, rows.numel(), step):
        part = rows[start:start + step]
        q64 = queries.fp64(part)
        scores = torch.empty((part.numel(), space.size), dtype=torch.float64, device=q64.device)
        for g0 in range(0, space.size, block):
            g1 = min(space.size, g0 + block)
            scores[:, g0:g1] = q64 @ space.exact_rows(torch.arange(g0, g1, device=q64.device)).t()
        bound = torch.full((part.numel(),), bound_value, dtype=torch.float64, device=q64.device)
        local, cand, _ = _select(scores, bound, k, None)
        del scores
        _finish_exact(space, queries, cand, part[local], k, result)


def _start_stage(space: _Space, precision: str) -> str:
    if precision == "fp64":
        return "fp64"
    if space.half_t is not None:
        return "half"
    return "fp32"


def _default_chunk(gallery_size: int, stage: torch.dtype | None = None, k: int = 1) -> int:
    """Queries per chunk: the score block of the candidate stage ``stage`` (None: fp32 rows) within its budget."""
    int8 = _INT8_TOP1_SCORE_BUDGET if k == 1 else _INT8_SCORE_BUDGET
    budget = {torch.int8: int8, None: _SCORE_BUDGET}.get(stage, _HALF_SCORE_BUDGET)
    return int(max(16, min(4096, budget // max(1, gallery_size))))


def _search(space: _Space, queries: _Queries, k: int, precision: str, chunk_size: int | None,
            want_scores: bool, rebuild: Callable[[str], _Space] | None = None) -> _Result:
    """Exact top-k of every query, chunk by chunk. ``rebuild(precision)``: the same gallery prepared for another
    candidate stage, used when "auto" chose int8 and the first chunk shows its window re-scores too much."""
    if not 1 <= k <= space.size:
        raise ValueError(f"k: expected 1 <= k <= gallery size ({space.size}), got {k}")
    chunk = chunk_size if chunk_size is not None else _default_chunk(space.size, space.half_dtype, k)
    if chunk < 1:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size}")
    stage = _start_stage(space, precision)
    result = _Result(queries.count, k, space.stage32.device, want_scores)
    # "auto" on int8: a small first chunk tells whether these data suit the int8 window before most work is done
    probing = precision == "auto" and rebuild is not None and space.half_dtype == torch.int8
    # "auto" on any reduced-precision stage: an early chunk is also timed against the fp32 stage on the same
    # rows, and a stage that turns out slower on this call (a calibration from another load, data that widen its
    # window) hands the rest to the fp32 stage
    checking = (precision == "auto" and rebuild is not None and space.half_dtype is not None
                and queries.count >= _LIVE_CHECK_CHUNKS * min(chunk, _INT8_PROBE_QUERIES))
    start = 0
    if probing or checking:
        stop = min(queries.count, start + min(chunk, _INT8_PROBE_QUERIES))
        rescored = _search_chunk(space, queries, start, stop, k, want_scores, stage, result)
        fallback = None
        if probing and rescored * _INT8_DEMOTE_FRACTION > space.size:
            fallback = fastest_matmul(space.stage32.device, exclude=("int8",))
        elif checking:
            # the first chunk pays one-time costs (kernel selection and JIT of the half product, buffers), so the
            # second one is timed
            start, stop = stop, min(queries.count, stop + min(chunk, _INT8_PROBE_QUERIES))
            began = time.perf_counter()
            _search_chunk(space, queries, start, stop, k, want_scores, stage, result)
            fp32_space = rebuild("fp32")
            if _slower_than_fp32(space, queries, start, stop, time.perf_counter() - began, k, want_scores,
                                 fp32_space):
                space, stage = fp32_space, _start_stage(fp32_space, precision)
                if chunk_size is None:
                    chunk = _default_chunk(space.size, space.half_dtype, k)
        if fallback is not None:
            space = rebuild(fallback)
            stage = _start_stage(space, precision)
            if chunk_size is None:
                chunk = _default_chunk(space.size, space.half_dtype, k)
        start = stop
    bounds = [(first, min(queries.count, first + chunk)) for first in range(start, queries.count, chunk)]
    run_chunks(lambda first, stop: _search_chunk(space, queries, first, stop, k, want_scores, stage, result),
               bounds, space.stage32.device)
    return result


def _slower_than_fp32(space: _Space, queries: _Queries, start: int, stop: int, stage_s: float, k: int,
                      want_scores: bool, fp32_space: _Space) -> bool:
    """Whether the candidate stage's ``stage_s`` seconds on query rows start..stop-1 exceed ``_LIVE_MARGIN`` times
    the kernel's fp32 stage (``fp32_space``: the full fp32 product and its narrow window; the exact counterpart of
    a plain fp32 loop) on the same rows, timed now. Only a stage measured slower than the path that would replace
    it is left; a slow first reading on a busy machine is taken again on both sides (the faster of two each)."""
    def seconds(where: _Space, stage: str) -> float:
        began = time.perf_counter()
        _search_chunk(where, queries, start, stop, k, want_scores, stage,
                      _Result(queries.count, k, where.stage32.device, want_scores))
        return time.perf_counter() - began

    fp32_s = seconds(fp32_space, "fp32")
    if stage_s <= _LIVE_MARGIN * fp32_s:
        return False
    stage_s = min(stage_s, seconds(space, "half"))
    return stage_s > _LIVE_MARGIN * min(fp32_s, seconds(fp32_space, "fp32"))


def nearest_neighbours(query, gallery, k: int = 1, chunk_size: int | None = None, precision: str = "auto",
                       return_scores: bool = True):
    """Exact cosine top-k: for each query row, the k gallery rows of highest cosine similarity.

    query (Nq, D), gallery (Ng, D): float tensors (CPU or CUDA; the gallery's device is used) or numpy arrays;
    rows are L2-normalised inside. Returns ``(indices, scores)``: indices (Nq, k) int64, 0-based gallery rows in
    descending similarity, exact ties broken by the lowest index; scores (Nq, k) float64 cosine similarities (None
    when ``return_scores`` is False, which skips the final fp64 scoring where it is not needed for k = 1).
    ``precision``: "auto" (the candidate-pass arithmetic measured fastest on this machine by
    ``compat_core.calibration``: int8, bf16, fp16 or fp32), "int8"/"half"/"bf16"/"fp16" (force that candidate
    stage), "fp32", "fp64" (brute force). The ranking is the same for every choice.
    ``chunk_size``: queries per block (default: a block of scores stays under 2**26 entries).
    """
    _check_precision(precision)
    gallery = _as_matrix("gallery", gallery)
    query = _as_matrix("query", query, gallery.device)
    _check_same_dim(query, gallery)
    with torch.inference_mode(), _ieee_fp32():
        space = _direct_space(gallery, precision, query.shape[0])
        queries = _Queries("query", query, raw=space.half_dtype == torch.int8)
        result = _search(space, queries, k, precision, chunk_size, return_scores,
                         rebuild=lambda fallback: _with_stage(space, _half_dtype_for(fallback, gallery.device)))
    return result.index, result.score


def _group_search(chunk_size: int | None):
    """The exact kernel as the pruned search calls it on one gallery group: top-1 with its fp64 score."""
    def search(query_rows: torch.Tensor, gallery_rows: torch.Tensor, want_scores: bool, whole: bool = False):
        # a group's call names the calibrated stage: it would otherwise repeat the live check, which the pruned
        # search's own timed trial covers; the whole gallery and int8 stay "auto" (live check, int8 window check)
        stage = fastest_matmul(gallery_rows.device)
        precision = "auto" if whole or stage == "int8" else stage
        return nearest_neighbours(query_rows, gallery_rows, 1, chunk_size, precision, return_scores=want_scores)
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
        queries = _Queries("query", query, raw=space.half_dtype == torch.int8)
        result = _search(space, queries, k, prepared.precision, chunk_size, return_scores, rebuild=prepared._rebuild)
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
        top1, _ = retrieval_pruned.search_top1(query.to(gallery.device), gallery, _group_search(chunk_size),
                                               labels=g_labels)
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

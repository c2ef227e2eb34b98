"""The exact top-k search of the retrieval kernel, chunk by chunk: query rows as the stages need them, the
candidate stage (int8, bf16/fp16 or fp32 rows), fp32 re-scoring, the fp64 finish and fallback, the default chunk
sizes, and the "auto" checks that leave a stage too wide or too slow for the data at hand. Why every answer is
exact is argued in ``compat_core.retrieval.search``'s docstring.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Callable

import torch

from compat_core.hardware.calibration import fastest_matmul
from compat_core.hardware.torch_settings import balanced_chunks, chunk_workers, even_chunks, run_chunks
from compat_core.hardware.torch_settings import one_thread as _one_thread
from compat_core.retrieval.candidates import (
    _candidate_scores32,
    _filter,
    _pair_scores64,
    _round_down,
    _select,
    _select_top1,
    _stage_bound,
)
from compat_core.retrieval.int8 import SLACK as _SLACK
from compat_core.retrieval.int8 import U32 as _U32
from compat_core.retrieval.int8 import gamma as _gamma
from compat_core.retrieval.int8 import int8_stage as _int8_stage
from compat_core.retrieval.int8 import int8_top1_candidates
from compat_core.retrieval.int8 import norm32_upper as _norm32_upper
from compat_core.retrieval.live import CANDIDATE, FP32, LiveCheck, alternating_plan
from compat_core.retrieval.space import (
    LOW_RANK_FP32,
    LOW_RANK_FP32_MAX_FRACTION,
    _inverse_norms,
    _project_queries,
    _Space,
)

_MAX_CANDIDATES = 256          # wider candidate sets are cheaper as a full fp32 row than as gathered rows
_GATHER_VS_DENSE = 32          # a gathered candidate costs about as much as this many gallery rows of a dense product
# "auto" with an int8 stage: when the first chunk leaves more than Ng / this many rows per query to re-scoring,
# the int8 window (~7x bf16's) is too wide for these data and the rest runs on the next-fastest stage
_INT8_DEMOTE_FRACTION = 64
_INT8_PROBE_QUERIES = 512      # size of that first chunk
_LIVE_CHECK_CHUNKS = 8         # the live check runs on searches of at least this many first chunks
_LIVE_MARGIN = 1.1             # a stage slower than the kernel's fp32 stage by more than this is left
_LIVE_PAIRS = 2                # readings of each side that must all say "slower" before the stage is left
_SCORE_BUDGET = 1 << 22        # elements of one fp32 (query chunk x gallery) score block: measured on 2 cores at
                               # D = 1023, fp32 stage, 1 << 22 against 1 << 26: 20,000 x 5,000 0.66 vs 0.71 s,
                               # 50,000 x 10,000 3.11 vs 3.40 s, 49,320 x 3,288 (demo features) 1.06 vs 1.21 s
# int8 with k = 1: the query chunk is projected and quantised at once, its products and selection run in smaller
# blocks (``retrieval_int8.int8_top1_candidates``); k > 1 keeps int8 score blocks of that smaller size
_INT8_SCORE_BUDGET = 5 << 20
_INT8_TOP1_SCORE_BUDGET = 1 << 25
_HALF_SCORE_BUDGET = 10 << 20   # bf16 / fp16 score blocks, for the same reasons: measured on one core at Ng = 10,000,
                                # D = 1023, 1024-query chunks take the bf16 product from 6.1 s to 5.0 s per 50,000
_PARALLEL_PAIRS = 1 << 16      # candidate pairs per chunk from which re-scoring uses the thread pool
_UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 0.0}


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
    # fp16's range (65504) would overflow on raw rows of large norm: it keeps unit rows
    fp16 = start_stage == "half" and space.half_dtype == torch.float16
    q32, norm32, dev32, ref = _chunk_queries(queries, start, stop, raw=not fp16)
    bound32 = _stage_bound(dev32, norm32, space.norm32_max, space.dev32_max, space.dim, ref_norm=ref)
    single_ok = k == 1 and not want_scores
    if start_stage == "half":
        lower = _exact_lower(q32, space.stage32, bound32)
        rows, cand, fp32_rows = _half_candidates(space, q32, norm32, dev32, ref, k, lower)
        pairs = int((cand >= 0).sum())
        rescored = (pairs + fp32_rows.numel() * space.size) / max(1, stop - start)
        _rescore_candidates(space, queries, q32, bound32, rows, cand, pairs, k, single_ok, result, start)
    else:
        fp32_rows = torch.arange(stop - start, device=q32.device)
        rescored = 0.0
    if fp32_rows.numel():
        _search_fp32_rows(space, queries, q32, bound32, fp32_rows, k, single_ok, result, start)
    return rescored


def _chunk_queries(queries: _Queries, start: int, stop: int, raw: bool):
    """(q32, norm32, dev32, ref) of query rows start..stop-1: the fp32 rows the stages rank, fp64 upper bounds on
    their norms and on their deviation from the exact rows, and the reference norm of the stage bounds."""
    q32 = queries.raw_rows(start, stop) if raw else None
    if q32 is not None:
        # the stages rank the raw fp32 rows r: a positive factor per row changes neither the order nor the ties of
        # a row, and every bound below holds for r with ||r|| <= norm32 (the unit-row bounds scaled by ||r||; r is
        # the exact input, so no input deviation); the fp64 stage still scores unit rows
        norm32 = queries.norm32[start:stop]
        return q32, norm32, torch.zeros_like(norm32), norm32
    q32 = queries.fp32(start, stop)
    norm32 = _norm32_upper(q32)
    dev32 = 3.0 * _U32 * (1.0 + 1e-12) * torch.ones_like(norm32)      # ||q32 - q||, q the fp64 unit row
    return q32, norm32, dev32, 1.0 + 1e-12


def _half_candidates(space: _Space, q32: torch.Tensor, norm32: torch.Tensor, dev32: torch.Tensor, ref,
                     k: int, lower: Callable):
    """The candidate stage (int8, bf16 or fp16 products, on the low-rank coordinates when the space has a basis):
    (rows with candidates, their candidates padded with -1, rows too wide for candidates: full fp32 rows)."""
    if space.projection is None:
        x32, dev_x, ref_norm, half_dim, residual = q32, dev32, ref, space.dim, 0.0
    else:
        x32, dev_x = _project_queries(q32, norm32, dev32, space.projection)
        ref_norm, half_dim = space.projection.basis_norm * ref, space.projection.basis.shape[1]
        residual = ref * space.projection.residual_max          # |q.(g - U y)| <= ||q|| ||res||
    # (cap: wider candidate sets are cheaper as full fp32 rows, one dense product, than as gathered rows)
    cap = max(k + 1, min(_MAX_CANDIDATES, space.size // _GATHER_VS_DENSE)) + k
    if space.half_dtype == torch.int8 and k == 1:
        return int8_top1_candidates(x32, dev_x, space, ref_norm, residual, cap, _round_down, lower)
    if space.half_dtype == torch.int8:
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
    if k == 1:
        return _select_top1(scores, bound_h, cap, out_unit, lower)
    return _select(scores, bound_h, k, cap, out_unit)


def _rescore_candidates(space: _Space, queries: _Queries, q32: torch.Tensor, bound32: torch.Tensor,
                        rows: torch.Tensor, cand: torch.Tensor, pairs: int, k: int, single_ok: bool,
                        result: _Result, offset: int) -> None:
    """The candidate stage's candidates re-scored in fp32, narrowed with the fp32 bound and finished exactly (rows
    left with a single candidate are answered at once when only the top-1 index is asked for)."""
    # a few candidates per row: many small operations, on one thread; wide windows (int8 on full-rank rows,
    # ~100,000 pairs per chunk) give each operation enough work for the thread pool
    serial = _one_thread() if pairs < _PARALLEL_PAIRS else contextlib.nullcontext()
    with serial:
        if single_ok:
            rows, cand = _take_singles(rows, cand, result, offset)
        if rows.numel():
            # half-precision candidates: re-score in fp32 and narrow them with the fp32 bound
            s32 = _candidate_scores32(q32, cand, space.stage32, rows)
            cand = _filter(s32, cand, bound32[rows], k)
            if single_ok:
                rows, cand = _take_singles(rows, cand, result, offset)
            _finish_exact(space, queries, cand, rows + offset, k, result)


def _search_fp32_rows(space: _Space, queries: _Queries, q32: torch.Tensor, bound32: torch.Tensor,
                      fp32_rows: torch.Tensor, k: int, single_ok: bool, result: _Result, offset: int) -> None:
    """Chunk rows ``fp32_rows`` (0-based in the chunk) against the whole gallery in fp32, their candidates finished
    exactly; rows still too wide go to the fp64 stage."""
    # full fp32 rows against a transposed view: the fp32 BLAS takes it at near full speed
    # every row (no candidate stage, or all of them too wide for it): no copy of the chunk's rows; the wide rows
    # of the top-1 selection come in two runs, so only sorted, as many as the chunk's, they are 0..n-1
    fp32_rows = torch.sort(fp32_rows).values
    every = fp32_rows.numel() == q32.shape[0]
    scores = (q32 if every else q32[fp32_rows]) @ space.stage32.t()
    row_bound = bound32 if every else bound32[fp32_rows]
    if k == 1:
        local, cand, wide = _select_top1(scores, row_bound, _MAX_CANDIDATES + k)
    else:
        local, cand, wide = _select(scores, row_bound, k, _MAX_CANDIDATES + k)
    del scores
    rows = fp32_rows[local]
    if single_ok:
        rows, cand = _take_singles(rows, cand, result, offset)
    _finish_exact(space, queries, cand, rows + offset, k, result)
    _full_fp64(space, queries, fp32_rows[wide] + offset, k, result)


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
    pair_row, position = torch.nonzero(cand >= 0, as_tuple=True)
    s64 = torch.full(cand.shape, -math.inf, dtype=torch.float64, device=cand.device)
    s64[pair_row, position] = _pair_scores64(queries.fp64(rows), space.exact_rows, pair_row, cand[pair_row, position])
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
    # "auto" on any reduced-precision stage: early chunks time it against the fp32 stage, and a stage that turns
    # out slower on this call (a calibration from another load, data that widen its window) hands the chunks not
    # yet started to the fp32 stage
    checking = (precision == "auto" and rebuild is not None and space.half_dtype is not None
                and queries.count >= _LIVE_CHECK_CHUNKS * min(chunk, _INT8_PROBE_QUERIES))
    start = 0
    if probing:
        stop = min(queries.count, start + min(chunk, _INT8_PROBE_QUERIES))
        rescored = _search_chunk(space, queries, start, stop, k, want_scores, stage, result)
        start = stop
        if rescored * _INT8_DEMOTE_FRACTION > space.size:
            space = rebuild(fastest_matmul(space.stage32.device, exclude=("int8",)))
            stage = _start_stage(space, precision)
            checking = False
            if chunk_size is None:
                chunk = _default_chunk(space.size, space.half_dtype, k)
    device = space.stage32.device
    check = None
    if checking:
        # the live check runs inside the parallel search (``compat_core.retrieval.live``): after a warm chunk per
        # worker, probe chunks alternate between the candidate stage and the fp32 stage, each timed on its
        # worker's clock; chunks started after a decision run on the stage it chose (exact either way)
        warm = min(chunk_workers(device), _LIVE_CHECK_CHUNKS - 2 * _LIVE_PAIRS)   # all within the 8 probe chunks
        probes, plan = alternating_plan(start, queries.count, min(chunk, _INT8_PROBE_QUERIES), warm, _LIVE_PAIRS,
                                        spare=chunk_workers(device))
        check = LiveCheck(plan, _LIVE_MARGIN, _LIVE_PAIRS)
        bounds = probes + balanced_chunks(probes[-1][1], queries.count, chunk, device)
        fp32_space = rebuild(LOW_RANK_FP32 if _low_rank_fp32_pays(space) else "fp32")
        fp32_stage = _start_stage(fp32_space, precision)
    else:
        bounds = balanced_chunks(start, queries.count, chunk, device)

    def work(first: int, stop: int) -> None:
        name = CANDIDATE if check is None else check.stage_for((first, stop))
        where, where_stage = (space, stage) if name == CANDIDATE else (fp32_space, fp32_stage)
        timed = check is not None and check.timed((first, stop), name)
        if name == FP32 and not timed and chunk_size is None:
            # chunks sized for the candidate stage, run on the fp32 stage: in its own (smaller) score blocks
            for part in even_chunks(first, stop, -(-(stop - first) // _default_chunk(where.size, None, k))):
                _search_chunk(where, queries, *part, k, want_scores, where_stage, result)
            return
        began = _clock(device)
        _search_chunk(where, queries, first, stop, k, want_scores, where_stage, result)
        if timed:
            check.record(name, (_clock(device) - began) / (stop - first))

    run_chunks(work, bounds, device)
    return result


def _low_rank_fp32_pays(space: _Space) -> bool:
    """Whether the live check's fp32 side runs in the gallery's low-rank coordinates: an fp32 product in r <= D/2
    dims (plus the queries' projection, r D per query) costs at most about half the full one, and the window
    grows only by the measured residual (<= 2^-10), so fp32 there is the faster exact counterpart of a plain
    fp32 loop. Where the candidate stage is that pass already (no faster half product), the full fp32 product."""
    return (space.projection is not None and space.half_dtype != torch.float32
            and space.projection.basis.shape[1] <= int(LOW_RANK_FP32_MAX_FRACTION * space.dim))


def _clock(device: torch.device) -> float:
    """Seconds for the live check: the calling thread's CPU time on CPU (a chunk runs on one thread, and CPU time
    does not count the slices a busy machine gives to other processes), wall time on an accelerator."""
    return time.thread_time() if torch.device(device).type == "cpu" else time.perf_counter()

"""The int8 candidate stage of the exact retrieval kernel (``compat_core.retrieval.search``): quantisation with a proven
error bound, the exact int32 products, and the top-1 candidate selection over them.

Why the stage is sound (the full argument is in ``compat_core.retrieval.search``'s module docstring). Gallery rows y_j are
quantised under one common scale t (b_j = round(y_j / t)), a query row x per row (a = round(x / s)). The products
P_j = a . b_j are exact in int32 (127^2 D < 2^31), so with the real query r that the search ranks for (a unit row,
or the raw fp32 row: any positive per-query factor leaves the order and the ties of a row unchanged) and its
reference score r.g_j,
    |s t P_j - r.g_j| <= ||s a - r'|| max_j ||t b_j|| + ||r'|| max_j ||t b_j - y_j|| + |r.(g_j - U y_j)| =: E
(r' = U^T r the query's coordinates, U = I without a low-rank basis). s t > 0 is common to the row, so P orders the
row like s t P, and every item that can hold the top-1 has P_j >= max P - 2E / (s t): the candidate set.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

U32 = 2.0 ** -24               # fp32 unit roundoff
SLACK = 1.0 + 1e-9             # covers the fp64 rounding in evaluating a bound itself
INT8_LIMIT = 127
INT8_MAX_DIM = (2 ** 31 - 1) // (INT8_LIMIT * INT8_LIMIT)   # int32 accumulation of D products stays exact


def gamma(dim: int, unit: float) -> float:
    """Accumulation error factor gamma_n = n u / (1 - n u) of an n-term sum in a format of unit roundoff u."""
    return dim * unit / (1.0 - dim * unit)


def norm32_upper(rows: torch.Tensor) -> torch.Tensor:
    """Upper bound (fp64) on the exact L2 norms of fp32 rows, from an fp32 evaluation (sum of squares: gamma_D
    relative error; the square root halves it and rounds once more)."""
    return torch.linalg.vector_norm(rows, dim=1).double() * (1.0 + 2.0 * gamma(rows.shape[1], U32))


def quantize_rows(rows: torch.Tensor, common_max: float | None = None):
    """Symmetric int8 codes a = round(x / s) of fp32 rows, s = max|x| / 127 per row (or ``common_max`` / 127 for
    every row: the gallery's common scale), and an upper bound (fp64, (n,)) on ||s a - x|| from fp32 arithmetic
    only (fp64 here would cost more than the int8 product). Returns (codes int8, s (n,) fp32, bound).

    With p = fl32(s a) and e = fl32(x - p) (what is computed): |p - s a| <= u|s a| and |e - (x - p)| <= u|x - p|
    per component, so ||x - p|| <= ||e|| / (1 - u) and, with d = x - s a, ||d|| <= ||x - p|| + u ||s a||
    <= ||x - p|| + u (||x|| + ||d||), i.e. ||d|| <= (||e|| / (1 - u) + u ||x||) / (1 - u); ||e|| is bounded from
    its fp32 evaluation (``norm32_upper``), ||x|| by sqrt(D) max|x| (u ||x|| is ~1e-7 of the bound: a norm pass
    over the rows for it cost ~1/3 of the quantisation)."""
    if common_max is None:
        amax = torch.linalg.vector_norm(rows, ord=math.inf, dim=1)
        amax = torch.where(amax > 0, amax, torch.ones_like(amax))
    else:
        amax = torch.full((rows.shape[0],), common_max if common_max > 0 else 1.0, dtype=torch.float32,
                          device=rows.device)
    scale = amax / INT8_LIMIT
    # |x| * fl(127 / amax) <= 127 (1 + u)^2 < 127.5, so the rounded codes need no clamp; s a is what the bound
    # measures, whatever codes result
    codes = torch.round(rows * (INT8_LIMIT / amax)[:, None])
    error = torch.addcmul(rows, codes, scale[:, None], value=-1.0)       # fl(x - s a), fused or not
    norm_upper = amax.double() * (math.sqrt(rows.shape[1]) * (1.0 + 1e-12))             # >= ||x||
    deviation = (norm32_upper(error) / (1.0 - U32) + U32 * norm_upper) / (1.0 - U32)
    return codes.to(torch.int8), scale, deviation


def int8_stage(x32: torch.Tensor, dev_x: torch.Tensor, space, ref_norm, residual):
    """Candidate scores of fp32 query rows ``x32`` by int8 products, and their bound in the same units.

    Query rows are quantised per row (a = round(x / s)); P_j = a . b_j is exact in int32, so the stage has no
    accumulation and no output rounding: with the reference query r (||r|| <= ref_norm, ||x - r|| <= dev_x) and
    the exact stage product z_j = (s a).(t b_j) = s t P_j, |z_j - r.g_j| <= ||s a - r|| max||t b|| + ref_norm
    max||t b - g|| + residual =: E (``residual`` bounds the low-rank projection's r.(g - U y)). s t > 0 is common
    to the row, so P orders the row like z (ties included) and the bound in P units is E / (s t).
    ``ref_norm`` and ``residual``: floats or fp64 (n,) per-row bounds (raw, unnormalised query rows).
    Returns (P (n, Ng) int32, bound (n,) fp64 in P units, out_unit 0.0).
    """
    codes, unit, bound = _query_codes(x32, dev_x, space, ref_norm, residual)
    return _products(codes, space), bound, 0.0


def _query_codes(x32: torch.Tensor, dev_x: torch.Tensor, space, ref_norm, residual):
    """int8 codes of the query rows, the unit s t of their products (fp64 (n,)) and the bound E / (s t) in P units
    (``int8_stage``'s docstring)."""
    codes, scale, deviation = quantize_rows(x32)
    bound = ((deviation + dev_x) * space.norm_half_max + ref_norm * space.dev_half_max + residual) * SLACK
    unit = scale.double() * float(space.half_scale)
    return codes, unit, bound / unit * SLACK


def _products(codes: torch.Tensor, space, out: torch.Tensor | None = None) -> torch.Tensor:
    """Exact int32 products P (n, Ng) of query codes with the gallery codes. On CUDA the codes are zero-padded to
    ``torch._int_mm``'s shape rules (columns to the gallery's padded width, at least 17 rows); zeros add nothing."""
    count = codes.shape[0]
    if codes.device.type == "cuda":
        codes = torch.nn.functional.pad(codes, (0, space.half_t.shape[1] - codes.shape[1], 0, max(0, 17 - count)))
    if out is not None:
        out = out[:codes.shape[0]]
    return torch._int_mm(codes, space.half_t.t(), out=out)[:count, :space.size]


INT8_BLOCK_SCORES = 5 << 20    # int32 scores per product block of ``int8_top1_candidates``


def int8_top1_candidates(x32: torch.Tensor, dev_x: torch.Tensor, space, ref_norm, residual, cap: int | None,
                         round_down: Callable[[torch.Tensor, torch.dtype], torch.Tensor],
                         lower: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None):
    """``int8_stage`` then ``select_top1`` on blocks of query rows: the quantisation (and its bound), the products
    and the selection run per block of at most ``INT8_BLOCK_SCORES`` scores, so that each block stays in cache
    between its passes (and under glibc's 32 MiB mmap threshold, so its memory is reused rather than page-faulted
    in anew; measured on 2 threads: quantising 50,000 x 1023 rows 0.10 s in 524-row blocks, 0.24-0.31 s in
    3,355-row chunks). Measured on one core at Ng = 10,000, r = 512: the int8 product takes 1.3 s per 50,000
    queries in 512-row blocks, 2.3 s in blocks of 1,024 rows or more.
    ``lower(rows, columns)``: fp64 lower bounds on the reference scores of the pairs (row of ``x32``, column) in
    real units (``select_top1``'s ``lower`` before the conversion to P units done here).
    Returns (rows_ok, candidates, rows_wide) as ``select_top1``."""
    count = x32.shape[0]
    step = max(16, INT8_BLOCK_SCORES // max(1, space.size))

    def block_rows(value, start: int, stop: int):
        return value[start:stop] if isinstance(value, torch.Tensor) else value

    def lower_in_units(start: int, unit: torch.Tensor):
        if lower is None:
            return None
        def in_units(rows, columns):
            absolute = slice(start, start + unit.shape[0]) if isinstance(rows, slice) else rows + start
            return lower(absolute, columns) / unit[rows]
        return in_units

    found_rows, found_cand, found_wide = [], [], []
    # one product buffer for all blocks: a fresh one per block was measured to cost up to half the product
    # (page faults when the allocator returns it to the system)
    buffer_rows = max(min(step, count), 17 if x32.device.type == "cuda" else 0)
    buffer = torch.empty((buffer_rows, space.half_t.shape[0]), dtype=torch.int32, device=x32.device)
    for start in range(0, count, step):
        stop = min(count, start + step)
        codes, unit, bound = _query_codes(x32[start:stop], block_rows(dev_x, start, stop), space,
                                          block_rows(ref_norm, start, stop), block_rows(residual, start, stop))
        products = _products(codes, space, out=buffer)
        rows, cand, wide, _ = select_top1(products, bound, cap, 0.0, round_down, lower_in_units(start, unit))
        found_rows.append(rows + start)
        found_cand.append(cand)
        found_wide.append(wide + start)
    width = max(c.shape[1] for c in found_cand)
    candidates = torch.full((sum(c.shape[0] for c in found_cand), width), -1, dtype=torch.long, device=x32.device)
    at = 0
    for cand in found_cand:
        candidates[at:at + cand.shape[0], :cand.shape[1]] = cand
        at += cand.shape[0]
    return torch.cat(found_rows), candidates, torch.cat(found_wide)


SELECT_BLOCK = 64              # columns per block maximum in ``select_top1``
LOWER_MIN_OPEN_BLOCKS = 8      # ``select_top1`` asks for the lower bound L of rows with at least this many open blocks
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def select_top1(scores: torch.Tensor, bound: torch.Tensor, cap: int | None, out_unit: float,
                round_down: Callable[[torch.Tensor, torch.dtype], torch.Tensor],
                lower: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None):
    """Top-1 candidates {S_j >= T} of each row, T = v - u|v| - 2 bound - 1e-12 (1 + |v|) rounded down to the
    scores' type (v the row maximum, u = ``out_unit``; ``bound`` fp64 (n,) in score units): the threshold of
    ``retrieval_candidates._select`` with k = 1, so the candidate sets are identical; only the way they are found differs.

    Returns (rows_ok, candidates (n_ok, w) int64 padded with -1, ascending index order, rows_wide: rows with more
    than ``cap`` candidates, rows_other: rows left to ``_select``). Exact int32 scores are compared directly.
    Float scores are compared through their bits read as integers, which order non-negative floats like the
    floats and put every negative float (and -0) below them; so a row is handled here only when its threshold is
    > +0 (then no negative entry can be a candidate, and no entry equal to T is missed), else it is left over.

    ``lower(rows, columns)``: for rows (m,) (or ``slice(None)``: all) and the column of each one's maximum (m,),
    fp64 (m,) lower bounds on the reference score of that item in score units (its exact score minus its fp32
    error). The top-1's reference score is at least L, and item j's is at most S_j + bound (plus output rounding:
    S_j = round(z_j) is monotone in z_j), so only {S_j >= round_down(L - bound)} can hold it; T becomes the larger
    of the two thresholds. Where the stage's error is mostly quantisation rather than a shift of the whole row, L
    sits near v and the window is about halved (measured on the benchmark's full-rank data: the int8 stage's
    candidates per query 175 -> 32).
    It is asked for only where the window with v - 2 bound opens ``LOWER_MIN_OPEN_BLOCKS`` blocks or more.

    Why not a top-k: one pass takes the maximum of every block of ``SELECT_BLOCK`` columns (the row maximum is
    the maximum of its blocks); only blocks whose maximum reaches the threshold can hold candidates, and those few
    are gathered and compared entry by entry. Measured on one CPU core per 50,000 x 10,000 int32 scores: block
    maxima 0.045 s, a top-16 0.78 s, a full comparison pass 0.24 s.
    """
    count = scores.shape[0]
    floating = scores.dtype.is_floating_point
    keys = scores.view(_BITS[scores.dtype]) if floating else scores
    block_max, main = _block_maxima(keys)
    best_key = block_max.amax(dim=1)
    threshold, handled = _top1_thresholds(scores, keys, block_max, best_key, bound, out_unit, round_down, lower)
    row, column, counts, position = _open_entries(keys, block_max, main, threshold, handled)
    fits = handled if cap is None else handled & (counts <= cap)
    if bool(fits.all()):             # the usual case: no boolean selections (each a pass of its own)
        candidates = pad_candidates(row, column, counts, position)
    else:
        keep = fits[row]
        candidates = pad_candidates(row[keep], column[keep], counts.masked_fill(~fits, 0),
                                    None if position is None else position[keep])[fits]
    every = torch.arange(count, device=scores.device)
    return every[fits], candidates, every[handled & ~fits], every[~handled]


def _block_maxima(keys: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(maximum of every block of ``SELECT_BLOCK`` columns of each row, the last one narrower when the width is no
    multiple of it; columns covered by full blocks)."""
    size = keys.shape[1]
    main = size // SELECT_BLOCK * SELECT_BLOCK
    parts = []
    if main:
        parts.append(keys[:, :main].unflatten(1, (main // SELECT_BLOCK, SELECT_BLOCK)).amax(dim=2))
    if main < size:
        parts.append(keys[:, main:].amax(dim=1, keepdim=True))          # the last, narrower block
    return (torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]), main


def _top1_thresholds(scores: torch.Tensor, keys: torch.Tensor, block_max: torch.Tensor, best_key: torch.Tensor,
                     bound: torch.Tensor, out_unit: float,
                     round_down: Callable[[torch.Tensor, torch.dtype], torch.Tensor],
                     lower: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None):
    """(threshold T of each row as a key, rows handled here): see :func:`select_top1`; a row left over gets the
    largest key as its threshold, so that none of its entries is taken."""
    floating = scores.dtype.is_floating_point
    if floating:
        # a row whose largest key is negative holds only negative floats (or -0): its maximum is not best_key
        best = torch.where(best_key >= 0, best_key, torch.zeros_like(best_key)).view(scores.dtype).double()
    else:
        best = best_key.double()
    margin = 1e-12 * (1.0 + best.abs())          # absorbs the fp64 rounding of the threshold expressions
    threshold64 = best - out_unit * best.abs() - 2.0 * bound
    if lower is not None:
        # only rows with a wide window: scoring a row's best item (a random gallery row read) costs about as much
        # as re-scoring ~25 candidates, so narrow windows (junction features: ~3 candidates) are left as they are
        plain = round_down(threshold64 - margin, scores.dtype)
        plain = plain.view(keys.dtype) if floating else plain
        wide = torch.nonzero((block_max >= plain.unsqueeze(1)).sum(dim=1) >= LOWER_MIN_OPEN_BLOCKS).squeeze(1)
        if wide.numel():
            columns = _row_argmax(keys, block_max, wide, keys.shape[1])
            # every row: a slice, so that the query rows need no gather
            low = lower(slice(None) if wide.numel() == scores.shape[0] else wide, columns)
            threshold64[wide] = torch.maximum(threshold64[wide], low - bound[wide])
    threshold = round_down(threshold64 - margin, scores.dtype)
    if floating:
        threshold = threshold.view(keys.dtype)
        handled = (best_key >= 0) & (threshold > 0)                    # bits > 0: a float > +0
        threshold = torch.where(handled, threshold, torch.full_like(threshold, torch.iinfo(keys.dtype).max))
    else:
        handled = torch.ones_like(best_key, dtype=torch.bool)
    return threshold, handled


def _open_entries(keys: torch.Tensor, block_max: torch.Tensor, main: int, threshold: torch.Tensor,
                  handled: torch.Tensor):
    """(row, column, candidates per row, position of each entry in its row or None) of the entries >= the row's
    threshold in handled rows; columns ascend within a row (``position`` given when the last block's hits come
    after the others in the lists)."""
    count, size = keys.shape
    # the open full blocks (the narrower last one is compared whole below); each one's columns are gathered as a
    # contiguous slice of the block view (several times faster than single entries), and one pass over the hits
    # gives both row and column
    block_row, block = torch.nonzero((block_max[:, :main // SELECT_BLOCK] >= threshold.unsqueeze(1))
                                     & handled.unsqueeze(1), as_tuple=True)
    values = keys[:, :main].unflatten(1, (main // SELECT_BLOCK, SELECT_BLOCK))[block_row, block]
    which, offset = torch.nonzero(values >= threshold[block_row].unsqueeze(1), as_tuple=True)
    row = block_row[which]
    column = block[which] * SELECT_BLOCK + offset        # row-major over (block, offset): columns ascend in a row
    counts = torch.bincount(row, minlength=count)
    position = None
    if main < size:
        # the narrower last block: compared whole (fewer than SELECT_BLOCK columns per row), its hits placed
        # after the row's others (their columns are larger)
        tail_row, tail_offset = torch.nonzero((keys[:, main:] >= threshold.unsqueeze(1)) & handled.unsqueeze(1),
                                              as_tuple=True)
        tail_counts = torch.bincount(tail_row, minlength=count)
        position = torch.cat([_ranks(row, counts), counts[tail_row] + _ranks(tail_row, tail_counts)])
        row = torch.cat([row, tail_row])
        column = torch.cat([column, tail_offset + main])
        counts = counts + tail_counts
    return row, column, counts, position


def _row_argmax(keys: torch.Tensor, block_max: torch.Tensor, rows: torch.Tensor, size: int) -> torch.Tensor:
    """Column of a maximum of each of ``rows`` (m,) from its block maxima: its first best block, read entry by
    entry."""
    block = block_max[rows].argmax(dim=1)
    columns = (block.unsqueeze(1) * SELECT_BLOCK + torch.arange(SELECT_BLOCK, device=keys.device)).clamp(max=size - 1)
    offset = keys[rows.unsqueeze(1), columns].argmax(dim=1, keepdim=True)
    return columns.gather(1, offset).squeeze(1)


def _ranks(row: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rank of each entry among the entries of its row, for ``row`` (m,) sorted ascending and ``counts`` the
    entries per row (``bincount(row)``)."""
    starts = torch.cumsum(counts, 0) - counts
    return torch.arange(row.numel(), device=row.device) - starts[row]


def pad_candidates(row: torch.Tensor, column: torch.Tensor, counts: torch.Tensor,
                   position: torch.Tensor | None = None) -> torch.Tensor:
    """(n, max count) table of the columns of each row, padded with -1: entry i at ``position[i]`` of its row
    (default: ``row`` sorted ascending, entries in order)."""
    width = int(counts.max()) if counts.numel() else 0
    padded = torch.full((counts.shape[0], width), -1, dtype=torch.long, device=counts.device)
    if width == 0:
        return padded
    padded[row, _ranks(row, counts) if position is None else position] = column
    return padded

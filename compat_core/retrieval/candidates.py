"""Candidate sets of the exact retrieval kernel: the stage bound E(q), rounding thresholds down to a stage's grid,
selecting the candidates {S >= T} of each query row (top-k and top-1), re-scoring them in fp32 or fp64, and
filtering the survivors. Why these sets contain the exact answer is argued in ``compat_core.retrieval.search``'s docstring.
"""
from __future__ import annotations

import math
import threading
import warnings
from typing import Callable

import torch

from compat_core.hardware.torch_settings import one_thread as _one_thread
from compat_core.retrieval.int8 import SLACK as _SLACK
from compat_core.retrieval.int8 import U32 as _U32
from compat_core.retrieval.int8 import gamma as _gamma
from compat_core.retrieval.int8 import pad_candidates as _pad_candidates
from compat_core.retrieval.int8 import select_top1
from compat_core.retrieval.row_reduction import aligned_rows, same_shape_blocks

_GATHER_BUDGET = 1 << 22       # elements per gathered (rows x candidates x D) block: bounds re-scoring memory
_KEPT_BUFFER = 1 << 19         # fp64 pair buffers up to this many elements (4 MiB) are kept per thread: a fresh one
                               # costs its page faults on every call (measured 1.8-3.7 ms vs 0.5 ms reused for
                               # 512 x 512), which dominated re-ranking a few candidates per query
_BUFFERS = threading.local()


def _stage_bound(dev_x: torch.Tensor, norm_x: torch.Tensor, y_norm: float, y_dev: float, dim: int,
                 absolute: float = 0.0, ref_norm: float = 1.0 + 1e-12) -> torch.Tensor:
    """Input-rounding + fp32-accumulation part of E(q) (``compat_core.retrieval.search`` docstring), fp64 (n,); ``ref_norm`` bounds the
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
    ``compat_core.retrieval.search``'s docstring; 0 for exact integer scores). Returns (rows_ok, candidates (n_ok, w) int64 padded with
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


def _gathered_scores(query_rows: torch.Tensor, candidates: torch.Tensor, rows_of: Callable) -> torch.Tensor:
    """Scores of each query row against its padded candidates (-inf on padding), in blocks of bounded memory, as
    batched matrix products (the fp32 bound holds for any summation order; the fp64 stage's identical-reduction
    scores are ``_pair_scores64``)."""
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
        scores = torch.bmm(vectors, query_rows[rows].unsqueeze(2)).squeeze(2)
        out[rows, :block_width] = scores.masked_fill(block < 0, -math.inf)
        start = stop
    return out


def _pair_scores64(query64: torch.Tensor, rows_of: Callable, pair_row: torch.Tensor,
                   pair_column: torch.Tensor) -> torch.Tensor:
    """fp64 reference scores of the (query row, gallery row) pairs: ``query64[pair_row[i]]`` against gallery row
    ``pair_column[i]`` (``rows_of(index, out)``: fp64 unit gallery rows), (P,).

    Every pair is reduced by the identical elementwise product and inner-dimension sum (in blocks of one shape, on
    aligned rows: ``compat_core.retrieval.row_reduction``), so identical gallery rows tie bit for bit (the lowest index then
    wins). Only valid pairs are gathered, in blocks of bounded memory into
    two reused buffers, with the products taken in place: padding and fresh large temporaries cost the padded
    (rows x width x D) evaluation most of its time on rows with a few candidates each."""
    count = pair_row.numel()
    dim = query64.shape[1]
    out = torch.empty(count, dtype=query64.dtype, device=query64.device)
    if count == 0:
        return out
    block = max(1, min(count, _GATHER_BUDGET // dim))
    gallery_buffer, query_buffer = _pair_buffers(block, dim, query64.dtype, query64.device)
    for start in same_shape_blocks(count, block, query64.device):
        stop = min(count, start + block)
        vectors = rows_of(pair_column[start:stop], gallery_buffer[:stop - start])
        vectors.mul_(torch.index_select(query64, 0, pair_row[start:stop], out=query_buffer[:stop - start]))
        torch.sum(aligned_rows(vectors), dim=1, out=out[start:stop])
    return out


def _pair_buffers(rows: int, dim: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two (rows, dim) scratch buffers: this thread's kept ones when small enough (CPU), else fresh ones."""
    if device.type != "cpu" or rows * dim > _KEPT_BUFFER:
        return (torch.empty((rows, dim), dtype=dtype, device=device),
                torch.empty((rows, dim), dtype=dtype, device=device))
    kept = getattr(_BUFFERS, "pair", None)
    if kept is None or kept[0].dtype != dtype or kept[0].numel() < rows * dim:
        with torch.inference_mode(False):   # a normal tensor: usable in and outside inference mode
            kept = (torch.empty(_KEPT_BUFFER, dtype=dtype), torch.empty(_KEPT_BUFFER, dtype=dtype))
        _BUFFERS.pair = kept
    return kept[0][:rows * dim].view(rows, dim), kept[1][:rows * dim].view(rows, dim)


def _candidate_scores32(query_rows: torch.Tensor, candidates: torch.Tensor, gallery32: torch.Tensor,
                        row_index: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 scores of each query row against its padded candidates (-inf on padding) as one sampled product:
    only the (candidate, row) entries of gallery32 @ query_rows^T are computed, each an fp32 dot product (the
    fp32 bound holds in any summation order), without copying candidate rows.
    ``row_index`` (ascending): candidates' row i belongs to ``query_rows[row_index[i]]`` (the chunk's rows are
    read in place instead of gathered; default: row i).

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
    query_of = row if row_index is None else row_index[row]
    # gallery-major, queries ascending within: ``nonzero`` lists the pairs row-major, so a stable sort by column
    # alone keeps that order (measured 2.0 ms in int32 vs 4.5 ms for an argsort of column * count + row at
    # 107,000 pairs)
    order = torch.sort(column.to(torch.int32) if size < 2 ** 31 else column, stable=True).indices
    try:
        crow = torch.zeros(size + 1, dtype=torch.long, device=candidates.device)
        torch.cumsum(torch.bincount(column, minlength=size), 0, out=crow[1:])
        with warnings.catch_warnings():   # "CSR support is in beta": the sampled product is what is used of it
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta", category=UserWarning)
            # torch 2.11 warns once per process that invariant checks are off, which check_invariants=False asks
            warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled",
                                    category=UserWarning)
            pattern = torch.sparse_csr_tensor(crow, query_of[order], torch.zeros(order.numel(), dtype=torch.float32,
                                                                                device=candidates.device),
                                              size=(size, query_rows.shape[0]), check_invariants=False)
        values = torch.sparse.sampled_addmm(pattern, gallery32, query_rows.t(), beta=0.0).values()
    except (RuntimeError, NotImplementedError):   # a backend without sampled products: gathered rows
        if row_index is not None:
            query_rows = query_rows[row_index]
        return _gathered_scores(query_rows, candidates,
                                lambda index, out: torch.index_select(gallery32, 0, index, out=out))
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

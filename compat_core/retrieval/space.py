"""The searchable gallery of the exact retrieval kernel (``compat_core.retrieval.search``): its fp32 copy, the candidate
stage's copy (bf16 / fp16 rows, or int8 codes under one common scale) and the measured deviations that enter the
kernel's bound E(q); for low-rank galleries, the dominant subspace U, the coordinates U^T g and the measured
residuals, and the projection of query rows into it."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch

from compat_core.hardware.calibration import fastest_matmul
from compat_core.hardware.device import fast_matmul_dtype
from compat_core.hardware.torch_settings import one_thread as _one_thread
from compat_core.retrieval.int8 import INT8_MAX_DIM as _INT8_MAX_DIM
from compat_core.retrieval.int8 import SLACK as _SLACK
from compat_core.retrieval.int8 import U32 as _U32
from compat_core.retrieval.int8 import gamma as _gamma
from compat_core.retrieval.int8 import norm32_upper as _norm32_upper
from compat_core.retrieval.int8 import quantize_rows as _quantize_rows
from compat_core.retrieval.row_reduction import aligned_rows, same_shape_blocks

_NORM_BLOCK_ROWS = 256         # rows per block of ``_inverse_norms``'s fp64 conversion
_CANDIDATE_STAGES = ("auto", "int8", "half", "bf16", "fp16")   # precisions with a reduced-precision first pass
LOW_RANK_FP32 = "fp32-low-rank"   # internal: an fp32 candidate stage in the gallery's low-rank coordinates


def _inverse_norms(name: str, rows: torch.Tensor) -> torch.Tensor:
    """1 / L2 norm per row, fp64; zero rows have no direction and are refused.

    Rows of a narrower type are converted to fp64 block by block, on one thread: one conversion of the whole
    matrix allocates a fresh fp64 copy whose page faults cost 3x the norms themselves (measured on 20,000 x 1023
    fp32 rows, one thread: 0.17 s whole, 0.05 s in blocks of 256 rows). Every block has the same shape (the last
    one overlaps its predecessor), and rows are aligned on accelerators (``compat_core.retrieval.row_reduction``), so every
    row is reduced by the same code path and identical rows get identical norms."""
    count, block = rows.shape[0], _NORM_BLOCK_ROWS
    if rows.dtype == torch.float64 or count <= block:
        norms = torch.linalg.vector_norm(aligned_rows(rows), dim=1, dtype=torch.float64)
    else:
        norms = torch.empty(count, dtype=torch.float64, device=rows.device)
        with _one_thread():         # short sections: on two threads under load each waited for a descheduled one
            for start in same_shape_blocks(count, block):
                norms[start:start + block] = torch.linalg.vector_norm(aligned_rows(rows[start:start + block]),
                                                                      dim=1, dtype=torch.float64)
    bad = ~(norms > 0) | ~torch.isfinite(norms)
    if bool(bad.any()):
        first = int(torch.nonzero(bad)[0, 0])
        raise ValueError(f"{name}: row {first} has zero or non-finite norm; cosine similarity is undefined")
    return 1.0 / norms


def _half_dtype_for(precision: str, device: torch.device) -> torch.dtype | None:
    if precision == "bf16":
        return torch.bfloat16
    if precision == "fp16":
        return torch.float16
    if precision == "half":
        return fast_matmul_dtype(device) or torch.bfloat16
    if precision == "int8":
        return torch.int8
    if precision == LOW_RANK_FP32:
        return torch.float32
    if precision == "auto":
        # the arithmetic measured fastest on this machine (compat_core.hardware.calibration), fp32 when nothing beats it
        return {"int8": torch.int8, "bf16": torch.bfloat16, "fp16": torch.float16}.get(fastest_matmul(device))
    return None


@dataclass
class _Space:
    """A gallery prepared for search: stage copies, their measured deviation from the fp64 reference vectors."""

    size: int
    dim: int
    exact_rows: Callable[[torch.Tensor], torch.Tensor]   # gallery indices -> fp64 reference vectors
    stage32: torch.Tensor            # (Ng, D) fp32
    norm32_max: float                # max ||stage32_j||
    dev32_max: float                 # max ||stage32_j - g_j||
    norm64_max: float                # max ||g_j||
    half_t: torch.Tensor | None      # (D, Ng) half, contiguous (a transposed view halves AMX speed); int8: (Ng, D)
    half_dtype: torch.dtype | None   # bf16 / fp16 / int8 (the candidate stage's arithmetic)
    norm_half_max: float             # max ||stage row||: int8 rows as the real vectors t_j b_j
    dev_half_max: float              # max ||stage row - g_j||
    half_scale: torch.Tensor | None = None    # int8 only: 0-dim fp32 common scale t of the codes
    projection: "_Projection | None" = None   # set: the half stage runs in a rank-r subspace (see _low_rank)


@dataclass
class _Projection:
    """Orthonormal-ish basis U (D, r) of the gallery's dominant subspace; the half stage scores x.y with
    x = U^T q, y_j = fp32 coordinates of g_j, and q.g_j = x.y_j + q.(g_j - U y_j) exactly (U, y_j taken as the
    real numbers stored), so |q.g_j - x.y_j| <= ||q|| * residual_max."""

    basis: torch.Tensor              # (D, r) fp32, U
    basis_norm: float                # upper bound on ||U||_2 (so ||U^T q|| <= basis_norm for unit q)
    basis_frobenius: float           # upper bound on ||U||_F
    residual_max: float              # upper bound on max_j ||g_j - U y_j|| (exact arithmetic)
    coords: torch.Tensor             # (Ng, r) fp32 y_j, kept so that another candidate stage can be built from them


def _with_stage(space: _Space, half_dtype: torch.dtype | None) -> _Space:
    """The same gallery with another candidate stage (``half_dtype``; None: fp32 only), reusing its fp32 copy and,
    where it has one, its low-rank basis and coordinates (used when "auto" leaves the int8 stage). ``float32``
    with a low-rank basis: an fp32 candidate pass in the r-dim coordinates (the live check's fp32 side)."""
    if space.projection is not None and half_dtype is not None:
        projected = _build_space(space.projection.coords, 0.0, 1.0, space.exact_rows, half_dtype)
        if projected.half_t is not None:
            return replace(space, **_stage_fields(projected))
    return _build_space(space.stage32, space.dev32_max, space.norm64_max, space.exact_rows, half_dtype)


def _stage_fields(projected: _Space) -> dict:
    """The candidate-stage fields of a space built on low-rank coordinates, for the full gallery's space (its
    ||y_h - y|| is measured against the fp32 coordinates y, the reference in r dims)."""
    return {"half_t": projected.half_t, "half_dtype": projected.half_dtype, "half_scale": projected.half_scale,
            "norm_half_max": projected.norm_half_max, "dev_half_max": projected.dev_half_max}


def _build_space(stage32: torch.Tensor, dev32_max: float, norm64_max: float,
                 exact_rows: Callable[..., torch.Tensor], half_dtype: torch.dtype | None) -> _Space:
    """Wrap the fp32 gallery copy; make the half copy and bound its deviation, all in fp32, block by block.

    ``dev32_max`` bounds ||stage32_j - g_j|| and ``norm64_max`` bounds ||g_j|| (g_j the fp64 reference rows).
    A half row rounded from its fp32 row differs from it exactly representably in fp32, so its deviation from
    g_j is at most ||half_j - stage32_j|| (evaluated in fp32, inflated by its own rounding bound) + dev32_max.
    """
    size, dim = stage32.shape
    if half_dtype == torch.int8:
        return _build_int8_space(stage32, dev32_max, norm64_max, exact_rows)
    norm32 = norm_half = dev_half = 0.0
    half = torch.empty((size, dim), dtype=half_dtype, device=stage32.device) if half_dtype is not None else None
    block = max(1, (1 << 22) // dim)
    for start in range(0, size, block):
        rows = stage32[start:start + block]
        norm32 = max(norm32, float(_norm32_upper(rows).max()))
        if half is not None:
            half[start:start + block] = rows
            half32 = half[start:start + block].float()
            norm_half = max(norm_half, float(_norm32_upper(half32).max()))
            dev_half = max(dev_half, float(_norm32_upper(half32 - rows).max()))
    if half is not None and not (math.isfinite(norm_half) and math.isfinite(dev_half)
                                 and (half_dtype != torch.float16 or norm_half < 1e3)):
        # out of the half format's range (fp16 overflows at 65504): no half stage for this gallery
        half, half_dtype = None, None
    half_t = half.t().contiguous() if half is not None else None
    return _Space(size, dim, exact_rows, stage32, norm32 * _SLACK, dev32_max * _SLACK, norm64_max * _SLACK,
                  half_t, half_dtype, norm_half * _SLACK, (dev_half + dev32_max) * _SLACK)


def _build_int8_space(stage32: torch.Tensor, dev32_max: float, norm64_max: float,
                      exact_rows: Callable[..., torch.Tensor]) -> _Space:
    """The gallery with an int8 candidate stage: codes b_j under one common scale t (so that the exact int32
    products P_j = a . b_j rank a query's row by themselves: no per-row rescaling pass over the score block) and
    the measured maxima of ||t b_j|| and ||t b_j - g_j|| (<= ||t b_j - stage32_j|| + dev32_max). On CUDA the codes
    are zero-padded to multiples of 8 (``torch._int_mm``'s shape rule; zero columns add nothing to the products)."""
    size, dim = stage32.shape
    device = stage32.device
    pad = (lambda n: -(-n // 8) * 8) if device.type == "cuda" else (lambda n: n)
    codes = torch.zeros((pad(size), pad(dim)), dtype=torch.int8, device=device)
    amax = float(stage32.abs().amax())
    scale = None
    norm32 = norm_int8 = dev_int8 = 0.0
    block = max(1, (1 << 21) // dim)
    for start in range(0, size, block):
        rows = stage32[start:start + block]
        row_norm = _norm32_upper(rows)
        norm32 = max(norm32, float(row_norm.max()))
        part, part_scale, part_dev = _quantize_rows(rows, amax)
        codes[start:start + block, :dim] = part
        scale = part_scale[0]
        norm_int8 = max(norm_int8, float((row_norm + part_dev).max()))      # ||t b|| <= ||y|| + ||t b - y||
        dev_int8 = max(dev_int8, float(part_dev.max()))
    usable = dim <= _INT8_MAX_DIM and math.isfinite(norm_int8) and math.isfinite(dev_int8)
    return _Space(size, dim, exact_rows, stage32, norm32 * _SLACK, dev32_max * _SLACK, norm64_max * _SLACK,
                  codes if usable else None, torch.int8 if usable else None, norm_int8 * _SLACK,
                  (dev_int8 + dev32_max) * _SLACK, half_scale=scale if usable else None)


def _direct_space(gallery: torch.Tensor, precision: str, query_count: int = 0) -> _Space:
    """Gallery rows prepared for search; with at least ``_LOW_RANK_MIN_QUERIES_PER_DIM`` x D queries to amortise
    it, the half stage moves to the gallery's dominant subspace when that is small (``_low_rank``)."""
    inverse = _inverse_norms("gallery", gallery)

    def exact_rows(index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            return gallery[index].double() * inverse[index].unsqueeze(-1)
        # the same roundings (exact conversion, one product) with one temporary, in the gallery's dtype, not three
        return out.copy_(torch.index_select(gallery, 0, index)).mul_(inverse[index].unsqueeze(-1))

    # per component the fp32 copy rounds three times (input conversion, fp32 inverse norm, product): <= 3 u32
    stage32 = (gallery.float() * inverse.float()[:, None]).contiguous()
    half_dtype = _half_dtype_for(precision, gallery.device)
    dev32 = 3.0 * _U32 * (1.0 + 1e-12)
    # "auto" where no half product beats fp32: a gallery of rank <= D/2 still gets an fp32 candidate pass in its
    # low-rank coordinates (at most about half the full product's arithmetic)
    low_rank_dtype = torch.float32 if half_dtype is None and precision == "auto" else half_dtype
    if (low_rank_dtype is not None and precision in _CANDIDATE_STAGES
            and query_count >= _LOW_RANK_MIN_QUERIES_PER_DIM * gallery.shape[1]):
        # the full-D half copy is made only if the low-rank stage does not apply
        space = _build_space(stage32, dev32, 1.0 + 1e-12, exact_rows, None)
        _low_rank(space, gallery, inverse, low_rank_dtype,
                  LOW_RANK_FP32_MAX_FRACTION if low_rank_dtype == torch.float32 else _LOW_RANK_MAX_FRACTION)
        if space.projection is not None:
            return space
    return _build_space(stage32, dev32, 1.0 + 1e-12, exact_rows, half_dtype)


_LOW_RANK_MAX_FRACTION = 0.8   # above r = 0.8 D the projection and residual cost more than they save
LOW_RANK_FP32_MAX_FRACTION = 0.5   # an fp32 pass in r dims (plus the queries' projection) pays up to r = D / 2
_LOW_RANK_MIN_DIM = 64         # tiny D: nothing to save
_LOW_RANK_MIN_QUERIES_PER_DIM = 32  # fewer queries do not repay the basis search and the gallery pass
_LOW_RANK_RMS_RESIDUAL = 2.0 ** -14   # target rms ||g - U y||: far inside bf16's ~2^-8 candidate window
_LOW_RANK_MAX_RESIDUAL = 2.0 ** -10   # measured worst row above this: the bound would widen the window, skip
_BASIS_BLOCK = 32             # sample rows orthogonalised per step of ``_dominant_basis``
_ROTATION_SEED = 20261124      # fixed: the same gallery always gets the same int8 coordinates
_PROJECTION_BLOCK = 512        # fp32 accumulation length per partial product of U^T q (error gamma_512, not gamma_D)


def _low_rank(space: _Space, gallery: torch.Tensor, inverse: torch.Tensor, half_dtype: torch.dtype,
              max_fraction: float = _LOW_RANK_MAX_FRACTION) -> None:
    """Switch the half stage of ``space`` to the gallery's dominant r-dim subspace when r <= ``max_fraction`` D.

    Junction features f = A h (A: D x m, bias-free) have rank <= m < D, so the half product can run in r dims.
    U comes from a pivoted block Gram-Schmidt of (a stride subset of) the unit gallery rows in fp32
    (``_dominant_basis``: ~0.07 s at D = 1023, where an eigendecomposition took ~2 s); r is where the rms residual
    of the sample falls to <= 2^-14. Exactness does not depend on U being good: the residuals of
    all gallery rows are measured in fp64 and enter the candidate bound (``_Projection``).
    """
    size, dim = space.size, space.dim
    if dim < _LOW_RANK_MIN_DIM:
        return
    max_rank = int(max_fraction * dim)
    sample_rows = min(size, max_rank + 64)       # more rows than any accepted rank, so the sample spans it
    pick = torch.linspace(0, size - 1, sample_rows, device=gallery.device).round().long()
    # fp32 is enough for the search (its noise, ~1e-7 per component, is far below the 2^-14 target, and U is
    # stored in fp32 anyway) and measured twice as fast as fp64: 0.07 vs 0.13 s on full-rank rows
    sample = (gallery[pick].double() * inverse[pick, None]).float()
    basis64 = _dominant_basis(sample, max_rank)
    del sample
    if basis64 is None:
        return
    basis64 = basis64.double()
    rank = basis64.shape[1]
    # coordinates in a greedy basis put most of a row's energy in its first few components, which would set
    # the int8 scale; a fixed random rotation of the basis spreads it evenly (a smaller scale, a smaller
    # quantisation error; float stages do not care, and one basis for all lets "auto" change stage without
    # recomputing it); the bound below measures whatever basis results
    generator = torch.Generator(device="cpu").manual_seed(_ROTATION_SEED)
    mixing = torch.randn(rank, rank, generator=generator, dtype=torch.float64).to(basis64.device)
    with _one_thread():
        basis64 = basis64 @ torch.linalg.qr(mixing).Q
    basis = basis64.float().contiguous()                                      # (D, r)
    basis64 = basis.double()
    # ||U||_2^2 = ||U^T U||_2 <= 1 + ||U^T U - I||_F; the fp64 evaluation errs by <= gamma_D(fp64) ||U||_F^2
    frobenius = float(torch.linalg.vector_norm(basis64)) * (1.0 + 1e-12)
    off_identity = float(torch.linalg.matrix_norm(basis64.t() @ basis64 - torch.eye(rank, dtype=torch.float64,
                                                                                       device=basis.device)))
    basis_norm = math.sqrt(1.0 + off_identity + 2.0 * _gamma(dim, 2.0 ** -53) * frobenius ** 2) * _SLACK
    coords = torch.empty((size, rank), dtype=torch.float32, device=gallery.device)
    basis_t = basis.t().contiguous()
    residual = 0.0
    block = max(1, (1 << 21) // dim)
    for start in range(0, size, block):
        stop = min(size, start + block)
        coords[start:stop] = space.stage32[start:stop] @ basis
        rebuilt, gamma = _blocked_matmul(coords[start:stop], basis_t)
        # ||g - U y|| <= ||g - g32|| + ||fl(g32 - P) - (g32 - P)|| + ||fl(g32 - P)|| + ||P - U y||, with P the
        # blocked fp32 U y: componentwise |P - U y| <= gamma (|y|^T |U^T|), in norm <= gamma ||y|| ||U||_F
        rows = space.stage32[start:stop] - rebuilt
        bound = (space.dev32_max + _norm32_upper(rows) * (1.0 + 2.0 * _U32)
                 + gamma * _norm32_upper(coords[start:stop]) * frobenius)
        residual = max(residual, float(bound.max()))
        if residual > _LOW_RANK_MAX_RESIDUAL:
            return
    projected = _build_space(coords, 0.0, 1.0, space.exact_rows, half_dtype)
    if projected.half_t is None:
        return
    for name, value in _stage_fields(projected).items():
        setattr(space, name, value)
    space.projection = _Projection(basis, basis_norm, frobenius, residual * _SLACK, coords)


def _dominant_basis(sample: torch.Tensor, max_rank: int) -> torch.Tensor | None:
    """Orthonormal basis (D, r) of the span of the unit rows ``sample`` (n, D) up to an rms residual of
    ``_LOW_RANK_RMS_RESIDUAL``, or None when that needs more than ``max_rank`` directions.

    Pivoted block Gram-Schmidt: each step takes the ``_BASIS_BLOCK`` rows of largest residual, orthonormalises
    their residuals through the eigendecomposition of their small Gram matrix (directions of negligible energy
    dropped), orthogonalises them once more against the basis so far ("twice is enough"), and removes them from
    every residual. Only speed depends on its quality: the kernel measures the residual of every gallery row.
    The (n, D) residual updates use the thread pool, the small per-block eigendecompositions one thread
    (measured at n = 882, D = 1023, 2 threads, fp64: 0.19 s all on one thread, 0.12 s so, on full-rank rows).
    Computed in the dtype of ``sample``.
    """
    count = sample.shape[0]
    residual = sample.clone()
    energy = (residual * residual).sum(dim=1)
    target = count * _LOW_RANK_RMS_RESIDUAL ** 2
    negligible = _LOW_RANK_RMS_RESIDUAL ** 2 / 4.0
    blocks: list[torch.Tensor] = []
    rank = 0
    while float(energy.sum()) > target:
        with _one_thread():
            pick = torch.topk(energy, min(_BASIS_BLOCK, count)).indices
            rows = residual[pick]
            values, vectors = torch.linalg.eigh(rows @ rows.t())
            keep = values > negligible
            if not bool(keep.any()):
                break
            directions = (vectors[:, keep].t() @ rows) / torch.sqrt(values[keep])[:, None]       # (b, D)
        if blocks:
            basis = torch.cat(blocks)
            directions = directions - (directions @ basis.t()) @ basis
        with _one_thread():
            # re-normalise (and re-orthogonalise within the block) after the projection
            values, vectors = torch.linalg.eigh(directions @ directions.t())
            keep = values > 0.5
            directions = (vectors[:, keep].t() @ directions) / torch.sqrt(values[keep])[:, None]
        rank += directions.shape[0]
        if rank > max_rank:
            return None
        blocks.append(directions)
        residual -= (residual @ directions.t()) @ directions
        energy = (residual * residual).sum(dim=1)
    if not blocks:
        return None
    return torch.cat(blocks).t().contiguous()


def _blocked_matmul(left: torch.Tensor, right: torch.Tensor) -> tuple[torch.Tensor, float]:
    """fp32 ``left @ right`` as partial products over blocks of ``_PROJECTION_BLOCK`` inner indices summed in
    fp32, and its accumulation bound gamma: |result - exact|_ij <= gamma (|left| |right|)_ij in any BLAS order
    (a single product over D would carry gamma_D, ``_PROJECTION_BLOCK / D`` times worse)."""
    inner = left.shape[1]
    result = None
    for start in range(0, inner, _PROJECTION_BLOCK):
        part = left[:, start:start + _PROJECTION_BLOCK] @ right[start:start + _PROJECTION_BLOCK]
        result = part if result is None else result.add_(part)
    blocks = -(-inner // _PROJECTION_BLOCK)
    return result, _gamma(min(inner, _PROJECTION_BLOCK) + blocks, _U32)


def _project_queries(q32: torch.Tensor, norm32: torch.Tensor, dev32: torch.Tensor, projection: _Projection):
    """x = U^T q32 (fp32, blocked) and an upper bound on ||x - U^T q|| (q the fp64 unit row): ||U||_2 ||q32 - q||
    for the input plus the accumulation error gamma (|q32|^T |U|)_i per component, <= gamma ||q32|| ||U||_F."""
    x32, gamma = _blocked_matmul(q32, projection.basis)
    return x32, projection.basis_norm * dev32 + gamma * norm32 * projection.basis_frobenius

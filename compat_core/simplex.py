"""d-Simplex fixed classifier (SPEC §3) and the class-slot convention that goes with it.

The prototype matrix ``W`` has one row per pre-allocated class slot, ``K`` rows of dimension ``K - 1``::

    W0 = [I_{K-1}; alpha * 1^T],  alpha = (1 - sqrt(K)) / (K - 1)
    W  = rownorm(W0 - colmean(W0))

Every entry of the centred matrix is known in closed form, so nothing larger than the requested rows is ever
built: column ``j`` of ``W0`` holds a 1 (row ``j``), ``alpha`` (last row) and zeros, hence its mean is
``m = (1 + alpha) / K`` for every column. After centring, all rows have the same norm ``r`` (that is what the choice
of ``alpha`` buys), so per-row normalisation divides everything by ``r``:

    W[i, j] = (delta_ij - m) / r            for i < K - 1
    W[K-1, j] = (alpha - m) / r
    r^2 = (1 - m)^2 + (K - 2) m^2

Slots: third-party pre-trained models use slots left to right (``pretrain_slot(y) = y``), fine-tuning classes use
slots right to left (``finetune_slot(y, K) = K - 1 - y``), so the two families never collide while slots remain
(:mod:`compat_core.slots`, torch-free, re-exported here).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from compat_core.slots import SlotMapper, finetune_slot, pretrain_slot
from compat_core.validation import check_int

NORMS = ("row", "frobenius", "row_eps")

# Appendix D of the 2026 paper adds this to the Frobenius norm before dividing; kept so "frobenius" reproduces it.
_APPENDIX_D_EPS = 1e-8


def _check_num_slots(K: int) -> int:
    # a d-Simplex needs two vertices
    return check_int("K (number of class slots)", K, 2)


def _entry_constants(K: int, norm: str) -> tuple[float, float, float]:
    """Return (diagonal, off-diagonal, last-row) entry values of the normalised prototype matrix, in float64."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    alpha = (1.0 - math.sqrt(K)) / (K - 1)
    col_mean = (1.0 + alpha) / K
    row_norm = math.sqrt((1.0 - col_mean) ** 2 + (K - 2) * col_mean**2)
    if norm == "row":
        scale = 1.0 / row_norm
    elif norm == "row_eps":
        # the public IAM-CL2R code divides each row by its norm + 1e-8 (models/__init__.py:114): exact parity only
        scale = 1.0 / (row_norm + _APPENDIX_D_EPS)
    else:
        # Frobenius norm of the centred matrix: K rows of equal norm r.
        scale = 1.0 / (row_norm * math.sqrt(K) + _APPENDIX_D_EPS)
    return (1.0 - col_mean) * scale, -col_mean * scale, (alpha - col_mean) * scale


def dsimplex(
    K: int, norm: str = "row", dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> torch.Tensor:
    """d-Simplex prototypes, shape ``(K, K - 1)``; row ``k`` is the fixed prototype of class slot ``k``.

    ``norm="row"`` (default): unit rows, pairwise cosine exactly ``-1/(K-1)``, rows (and columns) summing to zero.
    ``norm="frobenius"``: the 2026 paper's Appendix D, the same matrix divided by its Frobenius norm (+1e-8), i.e.
    every row has norm ``1/sqrt(K)``. ``norm="row_eps"``: rows divided by their norm + 1e-8, as the public
    IAM-CL2R code builds them (rows of norm 1 - 1e-8; for step-by-step parity with it). Memory: only the output itself (K=22000 in fp32 is 1.9 GB).
    """
    K = _check_num_slots(K)
    diag, off, last = _entry_constants(K, norm)
    prototypes = torch.full((K, K - 1), off, dtype=dtype, device=device)
    prototypes[: K - 1].diagonal().fill_(diag)
    prototypes[K - 1].fill_(last)
    return prototypes


def dsimplex_rows(
    K: int,
    rows: Sequence[int] | np.ndarray | torch.Tensor,
    norm: str = "row",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Rows ``rows`` (0-based slot indices) of ``dsimplex(K, norm)``, shape ``(len(rows), K - 1)``.

    Lets callers (and tests) inspect a few prototypes of a huge simplex (K=22000) without building all of it.
    """
    K = _check_num_slots(K)
    diag, off, last = _entry_constants(K, norm)
    index = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= K):
        raise ValueError(f"rows must be slot indices in [0, {K}), got range [{int(index.min())}, {int(index.max())}]")
    out = torch.full((index.numel(), K - 1), off, dtype=dtype, device=device)
    index = index.to(out.device)
    is_last = index == K - 1
    positions = torch.arange(index.numel(), device=out.device)
    out[positions[~is_last], index[~is_last]] = diag
    out[is_last] = last
    return out


def dsimplex_logits(projection: torch.Tensor, K: int, norm: str = "row") -> torch.Tensor:
    """``projection @ dsimplex(K, norm).T`` without building the prototype matrix: ``(B, K-1) -> (B, K)``.

    Uses the closed form of the entries: logit_k = diag*x_k + off*(sum(x) - x_k) for k < K-1 and
    last*sum(x) for the last slot; O(B*K) time and memory, differentiable, same dtype as ``projection``.
    """
    K = _check_num_slots(K)
    if projection.ndim != 2 or projection.shape[1] != K - 1:
        raise ValueError(f"projection must have shape (B, {K - 1}) for K={K}, got {tuple(projection.shape)}")
    diag, off, last = _entry_constants(K, norm)
    total = projection.sum(dim=1, keepdim=True)
    head = (diag - off) * projection + off * total
    return torch.cat([head, last * total], dim=1)


__all__ = [
    "NORMS",
    "SlotMapper",
    "dsimplex",
    "dsimplex_logits",
    "dsimplex_rows",
    "finetune_slot",
    "pretrain_slot",
]

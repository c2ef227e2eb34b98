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
slots right to left (``finetune_slot(y, K) = K - 1 - y``), so the two families never collide while slots remain.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np
import torch

from compat_core.validation import as_label_array, check_int

NORMS = ("row", "frobenius")

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
    every row has norm ``1/sqrt(K)``. Memory: only the output itself (K=22000 in fp32 is 1.9 GB).
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


# ----------------------------------------------------------------------------------------------------------------
# Class slots
# ----------------------------------------------------------------------------------------------------------------


def pretrain_slot(y):
    """Slot of pre-training class ``y`` (0-based): ``y`` itself (slots fill left to right). Same type as ``y``."""
    return y


def finetune_slot(y, K: int):
    """Slot of fine-tuning class ``y`` (0-based) among ``K`` slots: ``K - 1 - y`` (slots fill right to left).

    Accepts an int, a numpy array or a tensor and returns the same kind; raises ``ValueError`` when ``y`` lies
    outside ``[0, K)``.
    """
    K = _check_num_slots(K)
    values = y.detach().cpu().numpy() if isinstance(y, torch.Tensor) else np.asarray(y)
    if values.size and (values.min() < 0 or values.max() >= K):
        raise ValueError(
            f"fine-tuning class labels must lie in [0, {K}) for K={K} slots, got range [{values.min()}, {values.max()}]"
        )
    return K - 1 - y


def _short_list(values: Iterable[int], limit: int = 10) -> str:
    values = sorted(set(int(v) for v in values))
    shown = ", ".join(str(v) for v in values[:limit])
    return f"[{shown}{', ...' if len(values) > limit else ''}] ({len(values)} in all)"


class SlotMapper:
    """Maps 0-based dataset labels to d-Simplex slots and refuses any collision.

    Pre-training labels (third-party models; nested pools share their leading labels) take slots left to right,
    ``slot = label``; fine-tuning labels take slots right to left, ``slot = K - 1 - label``. Construction raises
    ``ValueError`` naming the labels when a slot falls outside ``[0, K)`` or a pre-training and a fine-tuning label
    would share a slot. Labels must be declared before they are mapped, so every slot in use was checked.
    """

    def __init__(
        self,
        num_slots: int,
        pretrain_labels: Iterable[int] | np.ndarray | torch.Tensor = (),
        finetune_labels: Iterable[int] | np.ndarray | torch.Tensor = (),
    ) -> None:
        self.num_slots = _check_num_slots(num_slots)
        K = self.num_slots
        self.pretrain_labels = np.unique(as_label_array("pretrain_labels", pretrain_labels))
        self.finetune_labels = np.unique(as_label_array("finetune_labels", finetune_labels))
        too_big_pre = self.pretrain_labels[self.pretrain_labels >= K]
        if too_big_pre.size:
            raise ValueError(
                f"pretrain_labels {_short_list(too_big_pre)} map to slots outside [0, {K}) (K={K} slots)"
            )
        too_big_fine = self.finetune_labels[self.finetune_labels >= K]
        if too_big_fine.size:
            raise ValueError(
                f"finetune_labels {_short_list(too_big_fine)} map to slots "
                f"{_short_list(K - 1 - too_big_fine)} outside [0, {K}) (K={K} slots)"
            )
        clashing_slots = np.intersect1d(self.pretrain_labels, K - 1 - self.finetune_labels)
        if clashing_slots.size:
            raise ValueError(
                f"slot overlap between pre-training and fine-tuning classes (K={K}): slots "
                f"{_short_list(clashing_slots)} are claimed by pretrain_labels {_short_list(clashing_slots)} and by "
                f"finetune_labels {_short_list(K - 1 - clashing_slots)}; use a larger K or fewer classes"
            )

    @property
    def num_free_slots(self) -> int:
        """Slots neither pre-training nor fine-tuning classes use yet."""
        return self.num_slots - self.pretrain_labels.size - self.finetune_labels.size

    def with_labels(
        self,
        pretrain_labels: Iterable[int] | np.ndarray | torch.Tensor = (),
        finetune_labels: Iterable[int] | np.ndarray | torch.Tensor = (),
    ) -> "SlotMapper":
        """A new mapper with extra labels declared (a replacement model's larger pool, a new task's classes)."""
        return SlotMapper(
            self.num_slots,
            np.concatenate([self.pretrain_labels, as_label_array("pretrain_labels", pretrain_labels)]),
            np.concatenate([self.finetune_labels, as_label_array("finetune_labels", finetune_labels)]),
        )

    def _map(self, labels, declared: np.ndarray, role: str, to_slot):
        values = as_label_array(f"{role} labels", labels if not isinstance(labels, (int, np.integer)) else [labels])
        unknown = np.setdiff1d(values, declared)
        if unknown.size:
            raise ValueError(
                f"{role} labels {_short_list(unknown)} were not declared to this SlotMapper "
                f"(declare them with with_labels({role}_labels=...) so their slots are checked)"
            )
        if isinstance(labels, torch.Tensor):
            return to_slot(labels)
        if isinstance(labels, (int, np.integer)):
            return int(to_slot(int(labels)))
        return to_slot(np.asarray(labels, dtype=np.int64))

    def pretrain_slots(self, labels):
        """Slots of pre-training labels (int, numpy array or tensor in, same kind out)."""
        return self._map(labels, self.pretrain_labels, "pretrain", pretrain_slot)

    def finetune_slots(self, labels):
        """Slots of fine-tuning labels (int, numpy array or tensor in, same kind out)."""
        return self._map(labels, self.finetune_labels, "finetune", lambda y: finetune_slot(y, self.num_slots))

    def __repr__(self) -> str:
        return (
            f"SlotMapper(num_slots={self.num_slots}, pretrain={self.pretrain_labels.size} labels, "
            f"finetune={self.finetune_labels.size} labels)"
        )


__all__ = [
    "NORMS",
    "SlotMapper",
    "dsimplex",
    "dsimplex_logits",
    "dsimplex_rows",
    "finetune_slot",
    "pretrain_slot",
]

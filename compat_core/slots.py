"""The class-slot convention of the d-Simplex classifier (SPEC §3), without torch.

Third-party pre-trained models use slots left to right (``pretrain_slot(y) = y``), fine-tuning classes use slots
right to left (``finetune_slot(y, K) = K - 1 - y``), so the two families never collide while slots remain;
:class:`SlotMapper` refuses any collision. Labels may be ints, numpy arrays or torch tensors (same kind out); torch
is never imported here, so planning code maps slots without it.
"""
from __future__ import annotations

import sys
from typing import Iterable

import numpy as np

from compat_core.validation import as_label_array, check_int


def _check_num_slots(K: int) -> int:
    # a d-Simplex needs two vertices
    return check_int("K (number of class slots)", K, 2)


def _is_tensor(value) -> bool:
    torch = sys.modules.get("torch")  # a tensor exists only once torch is imported
    return torch is not None and isinstance(value, torch.Tensor)


def pretrain_slot(y):
    """Slot of pre-training class ``y`` (0-based): ``y`` itself (slots fill left to right). Same type as ``y``."""
    return y


def finetune_slot(y, K: int):
    """Slot of fine-tuning class ``y`` (0-based) among ``K`` slots: ``K - 1 - y`` (slots fill right to left).

    Accepts an int, a numpy array or a tensor and returns the same kind; raises ``ValueError`` when ``y`` lies
    outside ``[0, K)``.
    """
    K = _check_num_slots(K)
    values = y.detach().cpu().numpy() if _is_tensor(y) else np.asarray(y)
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
        pretrain_labels: Iterable[int] | np.ndarray = (),
        finetune_labels: Iterable[int] | np.ndarray = (),
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
        pretrain_labels: Iterable[int] | np.ndarray = (),
        finetune_labels: Iterable[int] | np.ndarray = (),
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
        if _is_tensor(labels):
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


__all__ = ["SlotMapper", "finetune_slot", "pretrain_slot"]

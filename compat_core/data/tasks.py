"""Task sequences for lifelong learning: initial classes + equal increments, a seeded class order, the open-set guard.

Increments are written as the papers write them: ``10+6x15`` is 10 initial classes then 6 tasks of 15
(CIFAR100, 7 tasks); ``16x512`` is 16 tasks of 512 identities (CelebA). Task indices are 0-based in code.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from compat_core.validation import as_int_vector

INCREMENTS_GRAMMAR = "TERM ('+' TERM)*, where TERM is N (one task of N classes) or RxN (R tasks of N classes), N, R >= 1"
_TERM = re.compile(r"^\s*(\d+)\s*(?:[xX\u00d7]\s*(\d+)\s*)?$")


def parse_increments(spec: str) -> list[int]:
    """Task sizes (classes per task, in order) of an increments spec, e.g. ``"10+6x15" -> [10, 15, 15, 15, 15, 15, 15]``.

    Grammar: :data:`INCREMENTS_GRAMMAR`. Raises ValueError naming the text and the grammar on bad syntax.
    """
    if not isinstance(spec, str):
        raise ValueError(f"increments must be a string like '10+6x15' ({INCREMENTS_GRAMMAR}), got {spec!r}")
    if not spec.strip():
        raise ValueError(f"increments spec is empty; expected {INCREMENTS_GRAMMAR}, e.g. '10+6x15'")
    sizes: list[int] = []
    for term in spec.split("+"):
        match = _TERM.match(term)
        if match is None:
            raise ValueError(
                f"increments spec {spec!r}: cannot parse term {term.strip()!r}; expected {INCREMENTS_GRAMMAR}, "
                f"e.g. '10+6x15', '16x512', '10+30x3'"
            )
        first, second = match.groups()
        repeat, size = (int(first), int(second)) if second is not None else (1, int(first))
        if repeat < 1 or size < 1:
            raise ValueError(
                f"increments spec {spec!r}: term {term.strip()!r} must have at least one task of at least one class"
            )
        sizes.extend([size] * repeat)
    return sizes


@dataclass(frozen=True)
class TaskSequence:
    """A class-incremental sequence. ``tasks[t]`` holds the dataset class ids first trained at task ``t`` (0-based);
    ``class_order`` is the whole order the tasks were cut from (it may hold unused classes at its end)."""

    tasks: list[np.ndarray]
    class_order: np.ndarray
    increments: list[int]
    spec: str

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    @property
    def num_classes(self) -> int:
        """Classes used by all tasks together."""
        return int(sum(self.increments))



def _class_ids(class_ids, field_name: str) -> np.ndarray:
    return as_int_vector(field_name, class_ids, items="integer class ids")


def build_task_sequence(class_ids, spec: str, seed: int = 0, order: str = "seeded") -> TaskSequence:
    """Cut a class order into the tasks of ``spec``.

    class_ids: 1-D distinct ints (the class pool). order: ``"seeded"`` shuffles the *sorted* pool with ``seed``
    (so the input order does not matter); ``"given"`` keeps the order as passed (a published class order).
    Raises ValueError when the spec needs more classes than the pool holds; extra classes stay unused.
    """
    sizes = parse_increments(spec)
    ids = _class_ids(class_ids, "class_ids")
    unique, counts = np.unique(ids, return_counts=True)
    if np.any(counts > 1):
        raise ValueError(f"class_ids must be distinct; repeated: {unique[counts > 1][:20].tolist()}")
    needed = sum(sizes)
    if needed > ids.size:
        raise ValueError(
            f"increments {spec!r} need {needed} classes ({len(sizes)} tasks) but the class pool has only {ids.size}"
        )
    if order == "seeded":
        class_order = np.random.default_rng(seed).permutation(unique)
    elif order == "given":
        class_order = ids.copy()
    else:
        raise ValueError(f"order must be 'seeded' or 'given', got {order!r}")
    bounds = np.cumsum([0, *sizes])
    tasks = [class_order[bounds[t]: bounds[t + 1]].copy() for t in range(len(sizes))]
    return TaskSequence(tasks=tasks, class_order=class_order, increments=sizes, spec=spec)


def check_open_set(train_classes, test_classes, train_name: str = "training", test_name: str = "test") -> None:
    """The open-set guard: raise ValueError listing every class id present in both sets (first 20 shown).

    Apply it to *fine* labels: coarse concepts may be shared on purpose (glyph test pool).
    """
    train = np.unique(_class_ids(np.ravel(np.asarray(train_classes)), f"{train_name} classes"))
    test = np.unique(_class_ids(np.ravel(np.asarray(test_classes)), f"{test_name} classes"))
    overlap = np.intersect1d(train, test)
    if overlap.size:
        shown = overlap[:20].tolist()
        more = f" (and {overlap.size - 20} more)" if overlap.size > 20 else ""
        raise ValueError(
            f"open-set violation: {overlap.size} class id(s) appear in both the {train_name} and the {test_name} "
            f"classes: {shown}{more}; training and test classes must be disjoint"
        )


def select_class_samples(labels, class_ids) -> np.ndarray:
    """Sorted int64 indices of the samples whose label is in ``class_ids`` (e.g. one task's training data)."""
    labels = _class_ids(labels, "labels")
    wanted = _class_ids(np.ravel(np.asarray(class_ids)), "class_ids")
    return np.flatnonzero(np.isin(labels, wanted)).astype(np.int64)


__all__ = [
    "INCREMENTS_GRAMMAR",
    "TaskSequence",
    "build_task_sequence",
    "check_open_set",
    "parse_increments",
    "select_class_samples",
]

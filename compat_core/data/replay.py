"""Replay memory (a per-class quota of exemplars) and the reference half-memory / half-task batch sampler.

The memory is a plain record of sample indices (or any int64 sample keys), labels, classifier slots and the
0-based task that stored each sample, so later stages can write it as a shard and read it back unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from compat_core.validation import as_int_vector, check_int

_FIELDS = ("indices", "labels", "slots", "source_task")


@dataclass(frozen=True)
class ReplayMemory:
    """Exemplars kept for replay. All fields are int64 ``(M,)``: ``indices`` (sample index or key into the
    training source), ``labels`` (dataset class id), ``slots`` (classifier slot / d-Simplex column), ``source_task``
    (0-based task whose data the sample came from)."""

    indices: np.ndarray
    labels: np.ndarray
    slots: np.ndarray
    source_task: np.ndarray

    def __post_init__(self) -> None:
        arrays = {name: as_int_vector(f"ReplayMemory.{name}", getattr(self, name)) for name in _FIELDS}
        lengths = {name: array.shape[0] for name, array in arrays.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"ReplayMemory fields must have equal lengths, got {lengths}")
        for name, array in arrays.items():
            array.flags.writeable = False  # a frozen record must not change under a shard writer
            object.__setattr__(self, name, array)

    @classmethod
    def empty(cls) -> "ReplayMemory":
        nothing = np.zeros(0, dtype=np.int64)
        return cls(nothing, nothing, nothing, nothing)

    def __len__(self) -> int:
        return int(self.indices.shape[0])

    def classes(self) -> np.ndarray:
        """Sorted class ids present in memory."""
        return np.unique(self.labels)

    def per_class_counts(self) -> dict[int, int]:
        """Class id -> number of stored samples."""
        classes, counts = np.unique(self.labels, return_counts=True)
        return {int(c): int(n) for c, n in zip(classes, counts)}

    def to_dict(self) -> dict[str, list[int]]:
        """Plain lists of Python ints (JSON / Parquet friendly)."""
        return {name: [int(v) for v in getattr(self, name)] for name in _FIELDS}

    @classmethod
    def from_dict(cls, data: dict) -> "ReplayMemory":
        """Inverse of :meth:`to_dict`; raises KeyError naming a missing field."""
        missing = [name for name in _FIELDS if name not in data]
        if missing:
            raise KeyError(f"replay memory record lacks field(s) {missing}; expected {list(_FIELDS)}")
        return cls(*(np.asarray(data[name], dtype=np.int64) for name in _FIELDS))


def _herding_order(features: np.ndarray, count: int, normalize: bool) -> np.ndarray:
    """iCaRL herding (Rebuffi et al. 2017, Alg. 4): greedily pick the sample that keeps the running mean of the
    picked features closest (Euclidean) to the class mean; each sample at most once, ties to the lowest row."""
    feats = np.asarray(features, dtype=np.float64)
    if normalize:
        # iCaRL's feature map is L2-normalised; the class mean is taken over normalised features.
        feats = feats / np.maximum(np.linalg.norm(feats, axis=1, keepdims=True), 1e-12)
    target = feats.mean(axis=0)
    available = np.ones(feats.shape[0], dtype=bool)
    running = np.zeros_like(target)
    picked = []
    for k in range(1, count + 1):
        candidates = (running[None, :] + feats) / k
        distance = np.linalg.norm(target[None, :] - candidates, axis=1)
        distance[~available] = np.inf
        choice = int(np.argmin(distance))
        picked.append(choice)
        available[choice] = False
        running += feats[choice]
    return np.asarray(picked, dtype=np.int64)


def update_memory(
    memory: ReplayMemory | None,
    indices,
    labels,
    slots,
    task: int,
    per_class: int,
    strategy: str = "random",
    seed: int = 0,
    features: np.ndarray | None = None,
    normalize_features: bool = True,
) -> ReplayMemory:
    """Add up to ``per_class`` exemplars of every class in ``labels`` (the data of ``task``) to ``memory``.

    indices, labels, slots: int ``(N,)`` for the task's samples (sample index/key, class id, classifier slot).
    strategy: ``random`` (seeded by ``(seed, task)``, the papers' default) or ``herding`` (iCaRL, needs
    ``features`` ``(N, D)`` rows aligned with ``indices``). Classes with fewer samples keep all of them. Stored
    classes keep their exemplars (a fixed quota per class, as the reference's ``fixed_memory``); a class already in
    memory raises ValueError because class-incremental tasks never repeat a class.
    """
    memory = ReplayMemory.empty() if memory is None else memory
    indices = as_int_vector("indices", indices)
    labels = as_int_vector("labels", labels)
    slots = as_int_vector("slots", slots)
    if not (indices.shape == labels.shape == slots.shape):
        raise ValueError(
            f"indices, labels and slots must have equal lengths, got {indices.shape[0]}, {labels.shape[0]}, "
            f"{slots.shape[0]}"
        )
    per_class = check_int("per_class (samples per class)", per_class, 1)
    task = check_int("task (0-based index)", task, 0)
    if strategy not in ("random", "herding"):
        raise ValueError(f"strategy must be 'random' or 'herding', got {strategy!r}")
    if strategy == "herding":
        if features is None:
            raise ValueError("strategy 'herding' needs features (N, D) aligned with indices")
        features = np.asarray(features)
        if features.ndim != 2 or features.shape[0] != indices.shape[0]:
            raise ValueError(f"features must have shape ({indices.shape[0]}, D), got {features.shape}")
    repeated = np.intersect1d(np.unique(labels), memory.classes())
    if repeated.size:
        raise ValueError(
            f"classes {repeated[:20].tolist()} already have exemplars in memory; a task must bring new classes"
        )

    rng = np.random.default_rng([int(seed), int(task)])
    chosen = []
    for label in np.unique(labels):
        rows = np.flatnonzero(labels == label)
        take = min(int(per_class), rows.size)
        if strategy == "random":
            chosen.append(rows[rng.permutation(rows.size)[:take]])
        else:
            chosen.append(rows[_herding_order(features[rows], take, normalize_features)])
    picked = np.concatenate(chosen) if chosen else np.zeros(0, dtype=np.int64)
    return ReplayMemory(
        indices=np.concatenate([memory.indices, indices[picked]]),
        labels=np.concatenate([memory.labels, labels[picked]]),
        slots=np.concatenate([memory.slots, slots[picked]]),
        source_task=np.concatenate([memory.source_task, np.full(picked.size, int(task), dtype=np.int64)]),
    )


def half_and_half_num_batches(
    num_task: int, num_memory: int, batch_size: int, epoch_length: str = "task", drop_last: bool = True
) -> int:
    """Batches per epoch of :func:`half_and_half_batches` (for progress bars and schedules)."""
    _check_batch_size(batch_size)
    if num_memory == 0:
        full, rest = divmod(num_task, batch_size)
        return full + (1 if rest and (not drop_last or full == 0) else 0)
    if epoch_length == "reference":
        return max(1, (num_task + num_memory) // batch_size)
    if epoch_length != "task":
        raise ValueError(f"epoch_length must be 'task' or 'reference', got {epoch_length!r}")
    full, rest = divmod(num_task, batch_size // 2)
    return full + (1 if rest and (not drop_last or full == 0) else 0)


def _check_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 2 \
            or batch_size % 2:
        raise ValueError(f"batch_size must be an even integer >= 2 (half memory, half task), got {batch_size!r}")


def half_and_half_batches(
    task_indices,
    memory_indices,
    batch_size: int,
    seed: int = 0,
    epochs: int = 1,
    first_epoch: int = 0,
    epoch_length: str = "task",
    drop_last: bool = True,
) -> Iterator[np.ndarray]:
    """Yield int64 index batches, each ``batch[:h]`` from memory and ``batch[h:]`` from the task (``h = len // 2``).

    Epoch definition (``epoch_length``):
    - ``"task"`` (default): one epoch is one shuffled pass over the task data, ``batch_size // 2`` task samples per
      batch; the memory halves walk through fresh shuffles of the memory, cycling as often as needed, so every
      memory sample is used equally often (+-1). The last batch may be smaller but is still exactly half/half;
      ``drop_last`` drops it unless it is the only batch.
    - ``"reference"``: as the public CL2R / IAM-CL2R code's ``BalancedBatchSampler``: ``(len(task) + len(memory))
      // batch_size`` batches per epoch of ``batch_size // 2`` samples per side, drawn independently across batches
      (so an epoch need not visit every task sample); as the IAM-CL2R sampler, a side is drawn without replacement
      within the batch when it holds more samples than it gives, with replacement when it holds that many or fewer,
      and when task and memory together hold fewer than ``batch_size`` samples, one batch of ``(len(task) +
      len(memory)) // 2`` per side (the CL2R sampler always draws without replacement: the same wherever it runs,
      except for a side of exactly ``batch_size // 2``).
    With an empty memory (first task) batches are plain shuffled task batches of ``batch_size``.
    Randomness is seeded by ``(seed, epoch)`` with ``epoch`` counted from ``first_epoch``, so a run resumed at
    epoch e yields the same batches as an uninterrupted run.
    """
    _check_batch_size(batch_size)
    task = as_int_vector("task_indices", task_indices)
    memory = as_int_vector("memory_indices", memory_indices)
    if task.size == 0:
        raise ValueError("task_indices is empty: a task needs training samples")
    if epoch_length not in ("task", "reference"):
        raise ValueError(f"epoch_length must be 'task' or 'reference', got {epoch_length!r}")
    epochs = check_int("epochs", epochs, 0)
    half = batch_size // 2
    for epoch in range(int(first_epoch), int(first_epoch) + int(epochs)):
        rng = np.random.default_rng([int(seed), epoch])
        if memory.size == 0:
            order = task[rng.permutation(task.size)]
            count = half_and_half_num_batches(task.size, 0, batch_size, drop_last=drop_last)
            for b in range(count):
                yield order[b * batch_size: (b + 1) * batch_size]
            continue
        count = half_and_half_num_batches(task.size, memory.size, batch_size, epoch_length, drop_last)
        if epoch_length == "reference":
            yield from _reference_batches(rng, task, memory, count, batch_size)
            continue
        order = task[rng.permutation(task.size)]
        task_parts = [order[b * half: (b + 1) * half] for b in range(count)]
        needed = sum(part.size for part in task_parts)
        cycles = -(-needed // memory.size)
        memory_stream = np.concatenate([memory[rng.permutation(memory.size)] for _ in range(cycles)])
        start = 0
        for part in task_parts:
            yield np.concatenate([memory_stream[start: start + part.size], part])
            start += part.size


def _reference_batches(rng: np.random.Generator, task: np.ndarray, memory: np.ndarray, count: int,
                       batch_size: int) -> Iterator[np.ndarray]:
    """``count`` batches of the public BalancedBatchSampler's rule (src/iamcl2r/dataset/dataset_utils.py:43-67 of
    the public IAM-CL2R code): ``batch_size // 2`` per side, or half of all samples when they fill no batch; a side
    holding no more samples than it gives is drawn with replacement."""
    per_side = batch_size // 2 if task.size + memory.size >= batch_size else (task.size + memory.size) // 2
    for _ in range(count):
        from_memory = rng.choice(memory, size=per_side, replace=bool(memory.size <= per_side))
        from_task = rng.choice(task, size=per_side, replace=bool(task.size <= per_side))
        yield np.concatenate([from_memory, from_task])


__all__ = ["ReplayMemory", "half_and_half_batches", "half_and_half_num_batches", "update_memory"]

"""The data of one training task (``TaskData``, the held-out ``SelectionSplit``) and how the loop walks it: seeded
batch order per epoch (``epoch_batches``). Numpy only, so ``compat plan`` counts a stage's images with the very
sampler the loop steps through without importing torch; the loader that turns position batches into device batches
is :mod:`pipelines.training.batches`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Mapping, Protocol

import numpy as np

from compat_core.data.source import ImageSource
from compat_core.data.replay import half_and_half_batches
from pipelines.training.settings import TrainConfig

if TYPE_CHECKING:
    import torch


class Sampling(Protocol):
    """What the batch order reads of a method (a :class:`pipelines.methods.objective.Method` or its card): whether its
    batches mix in the replay memory."""

    uses_replay: bool


@dataclass
class SelectionSplit:
    """Held-out split for compatibility-based model selection: an i.i.d. sample of the gallery data (CoReS Sec. 8.2).

    query_indices / gallery_indices: sample indices into ``source`` (classes are ``source.labels``).
    """

    source: ImageSource
    query_indices: np.ndarray
    gallery_indices: np.ndarray

    def __post_init__(self) -> None:
        for name in ("query_indices", "gallery_indices"):
            values = np.asarray(getattr(self, name), dtype=np.int64).reshape(-1)
            if values.size == 0:
                raise ValueError(f"SelectionSplit.{name} must not be empty")
            if values.min() < 0 or values.max() >= len(self.source):
                raise ValueError(f"SelectionSplit.{name} must index {self.source.name} (size {len(self.source)})")
            setattr(self, name, values)


@dataclass
class TaskData:
    """The data of one task.

    source: where images come from. task: 0-based task index. indices: (n,) sample indices of the task's training
    data (for CoReS / PSP / LSP: every sample seen so far). slots: (n,) class slot of each sample (d-Simplex slot or
    learnable-classifier output). memory_indices / memory_slots: the replay memory (same source) or None.
    num_old_classes / num_new_classes: counts of classes before / introduced by this task. initial_state: the
    weights CoReS restarts from (required by methods with ``requires_initial_state``). selection: held-out split
    for ``model_selection: compatibility``. batch_plan: a fixed batch order replacing the sampler, one list of
    position batches per epoch (positions as :func:`epoch_batches` numbers them, every epoch the same number of
    batches); it replays another implementation's order, e.g. the public IAM-CL2R code's in
    ``benchmarks/reference_parity.py``.
    """

    source: ImageSource
    task: int
    indices: np.ndarray
    slots: np.ndarray
    num_old_classes: int
    num_new_classes: int
    memory_indices: np.ndarray | None = None
    memory_slots: np.ndarray | None = None
    initial_state: Mapping[str, torch.Tensor] | None = None
    selection: SelectionSplit | None = None
    batch_plan: list[list[np.ndarray]] | None = None

    def __post_init__(self) -> None:
        for name in ("task", "num_old_classes", "num_new_classes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"TaskData.{name} must be an int >= 0, got {value!r}")
        self.indices, self.slots = self._pair("indices", self.indices, "slots", self.slots)
        if self.indices.size == 0:
            raise ValueError("TaskData.indices must hold at least one training sample")
        if (self.memory_indices is None) != (self.memory_slots is None):
            raise ValueError("TaskData.memory_indices and memory_slots must be given together (or both None)")
        if self.memory_indices is not None:
            self.memory_indices, self.memory_slots = self._pair(
                "memory_indices", self.memory_indices, "memory_slots", self.memory_slots
            )
        if self.batch_plan is not None:
            self.batch_plan = self._checked_plan(self.batch_plan)

    def _checked_plan(self, plan) -> list[list[np.ndarray]]:
        total = self.indices.size + (0 if self.memory_indices is None else self.memory_indices.size)
        epochs = [[np.asarray(b, dtype=np.int64).reshape(-1) for b in epoch] for epoch in plan]
        if not epochs or any(len(epoch) != len(epochs[0]) or not epoch for epoch in epochs):
            raise ValueError("TaskData.batch_plan must hold one non-empty list of batches per epoch, every epoch "
                             f"the same number of batches, got {[len(epoch) for epoch in epochs]}")
        for number, epoch in enumerate(epochs):
            for batch in epoch:
                if batch.size < 2 or batch.min() < 0 or batch.max() >= total:
                    raise ValueError(f"TaskData.batch_plan epoch {number}: a batch must hold >= 2 positions in "
                                     f"[0, {total}) (task samples, then memory), got {batch.tolist()}")
        return epochs

    def _pair(self, index_name: str, indices, slot_name: str, slots) -> tuple[np.ndarray, np.ndarray]:
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        if indices.shape != slots.shape:
            raise ValueError(f"TaskData.{index_name} and {slot_name} must have the same length, got {indices.size} and {slots.size}")
        if indices.size and (indices.min() < 0 or indices.max() >= len(self.source)):
            raise ValueError(f"TaskData.{index_name} must index {self.source.name} (size {len(self.source)})")
        if slots.size and slots.min() < 0:
            raise ValueError(f"TaskData.{slot_name} must be non-negative class slots, got minimum {slots.min()}")
        return indices, slots

    @property
    def has_memory(self) -> bool:
        return self.memory_indices is not None and self.memory_indices.size > 0


def _epoch_seed(seed: int, task: int, epoch: int) -> int:
    return int(np.random.SeedSequence([seed, task, epoch]).generate_state(1)[0])


def _augment_seed(seed: int, task: int) -> int:
    # a stream of its own (tag 1 in the 4th word), so batch order and augmentation never share draws
    return int(np.random.SeedSequence([seed, task, 0, 1]).generate_state(1)[0])


def epoch_batches(data: TaskData, method: Sampling, config: TrainConfig, epoch: int) -> Iterator[np.ndarray]:
    """Batches of positions for one epoch: ``< len(indices)`` are task samples, the rest memory samples.

    Replay methods with a memory use ``half_and_half_batches`` (or a joint shuffle with ``replay_sampling:
    mixed``); others shuffle the task data. A final batch of one sample is dropped (batch norm needs two), and
    with ``training.drop_last`` any final partial batch. ``data.batch_plan`` replaces all of it.
    """
    if data.batch_plan is not None:
        if epoch >= len(data.batch_plan):
            raise ValueError(f"TaskData.batch_plan holds {len(data.batch_plan)} epochs; epoch {epoch} was asked for "
                             f"(training.epochs is larger)")
        yield from data.batch_plan[epoch][: config.steps_per_epoch]
        return
    seed = _epoch_seed(config.seed, data.task, epoch)
    num_task = data.indices.size
    task_positions = np.arange(num_task, dtype=np.int64)
    if method.uses_replay and data.has_memory:
        memory_positions = np.arange(num_task, num_task + data.memory_indices.size, dtype=np.int64)
        if config.replay_sampling == "half_and_half":
            batches: Iterator[np.ndarray] = half_and_half_batches(task_positions, memory_positions, config.batch_size,
                                                                  seed, epoch_length=config.epoch_length)
        else:
            order = np.random.default_rng(seed).permutation(np.concatenate([task_positions, memory_positions]))
            batches = iter(np.array_split(order, range(config.batch_size, order.size, config.batch_size)))
    else:
        order = np.random.default_rng(seed).permutation(task_positions)
        batches = iter(np.array_split(order, range(config.batch_size, order.size, config.batch_size)))
    for count, positions in enumerate(batches):
        if config.steps_per_epoch is not None and count >= config.steps_per_epoch:
            return
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size >= 2 and not (config.drop_last and positions.size < config.batch_size):
            yield positions


def _steps_per_epoch(data: TaskData, method: Sampling, config: TrainConfig) -> int:
    # counted from epoch 0 of the same sampler (sizes do not depend on the epoch's seed)
    return sum(1 for _ in epoch_batches(data, method, config, 0))


def selection_split(holdout: float, pool: ImageSource, indices: np.ndarray,
                    seed: int) -> tuple[np.ndarray, SelectionSplit]:
    """CoReS Sec. 8.2 held-out split: ``holdout`` (``training.selection_holdout``) of the task's samples per class,
    halved into query and gallery; returns (training indices without them, SelectionSplit)."""
    rng = np.random.default_rng(seed)
    labels = np.asarray(pool.labels)[indices]
    held_query, held_gallery = [], []
    for c in np.unique(labels):
        members = indices[labels == c][rng.permutation(int((labels == c).sum()))]
        count = max(2, int(round(holdout * members.size)))
        if count >= members.size:
            continue
        held = members[:count]
        held_query.append(held[: count // 2])
        held_gallery.append(held[count // 2:])
    if not held_query:
        raise ValueError("training.selection_holdout: no class has enough samples for a held-out split")
    query, gallery = np.concatenate(held_query), np.concatenate(held_gallery)
    remaining = np.setdiff1d(indices, np.concatenate([query, gallery]))
    return remaining, SelectionSplit(pool, query, gallery)

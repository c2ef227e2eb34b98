"""The data of one training task (``TaskData``, the held-out ``SelectionSplit``) and how the loop walks it: seeded
batch order per epoch (``epoch_batches``) and the loader that turns position batches into device batches."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping

import numpy as np
import torch
from torch import nn

from compat_core.data.base import ImageSource
from compat_core.data.replay import half_and_half_batches
from compat_core.data.stream import to_device
from compat_core.data.transforms import make_transforms
from compat_core.models.precision import prepare_batch
from pipelines.methods.base import Batch, Method
from pipelines.training.settings import TrainConfig


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
    for ``model_selection: compatibility``.
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


def epoch_batches(data: TaskData, method: Method, config: TrainConfig, epoch: int) -> Iterator[np.ndarray]:
    """Batches of positions for one epoch: ``< len(indices)`` are task samples, the rest memory samples.

    Replay methods with a memory use ``half_and_half_batches`` (or a joint shuffle with ``replay_sampling:
    mixed``); others shuffle the task data. A final batch of one sample is dropped (batch norm needs two).
    """
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
        if positions.size >= 2:
            yield positions


def _steps_per_epoch(data: TaskData, method: Method, config: TrainConfig) -> int:
    # counted from epoch 0 of the same sampler (sizes do not depend on the epoch's seed)
    return sum(1 for _ in epoch_batches(data, method, config, 0))


class _Loader:
    """Turns position batches into device ``Batch`` objects (read uint8 -> device -> transforms)."""

    def __init__(self, data: TaskData, model: nn.Module, device: torch.device, train: bool, augment: bool,
                 seed: int) -> None:
        self.data = data
        self.model = model
        self.device = device
        # augmentation draws from its own generator so that it repeats exactly for a given (seed, task)
        self.transform = make_transforms(data.source, train=train and augment, seed=seed)
        if data.has_memory:
            self.all_indices = np.concatenate([data.indices, data.memory_indices])
            self.all_slots = np.concatenate([data.slots, data.memory_slots])
        else:
            self.all_indices, self.all_slots = data.indices, data.slots
        self.num_task = data.indices.size

    def batch(self, positions: np.ndarray, images: torch.Tensor | None = None,
              rows: tuple[int, int] | None = None) -> Batch:
        """The device batch of ``positions``; ``images`` (uint8, already read, e.g. by the stream) or read here.

        rows: data-parallel training: ``images`` are rows [start, stop) of the global batch ``positions``."""
        if images is None:
            local = positions if rows is None else positions[rows[0] : rows[1]]
            images = torch.from_numpy(np.ascontiguousarray(self.data.source.read(self.all_indices[local])))
        draws = None if rows is None else (*rows, positions.size)
        images = prepare_batch(self.transform(images.to(self.device, non_blocking=True), draws), self.model)
        # pinned + non_blocking on CUDA: the host prepares the next step while this one runs (no sync per step)
        targets = to_device(torch.from_numpy(self.all_slots[positions]), self.device)
        is_memory = to_device(torch.from_numpy(positions >= self.num_task), self.device)
        return Batch(images=images, targets=targets, is_memory=is_memory, rows=rows)

    def memory_batches(self, batch_size: int) -> Iterator[Batch]:
        positions = np.arange(self.num_task, self.all_indices.size, dtype=np.int64)
        for start in range(0, positions.size, batch_size):
            yield self.batch(positions[start : start + batch_size])

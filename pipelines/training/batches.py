"""Device batches of one training task: ``_Loader`` reads the images of a batch of positions (task samples first,
then replay memory, as :func:`pipelines.training.task_data.epoch_batches` numbers them), moves them to the device,
applies the task's transforms and returns a :class:`pipelines.methods.objective.Batch`."""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch
from torch import nn

from compat_core.data.device_decode import decode_on_device
from compat_core.data.encoded import EncodedImages
from compat_core.data.stream import to_device
from compat_core.data.transforms import make_transforms
from compat_core.models.precision import prepare_batch
from pipelines.methods.objective import Batch
from pipelines.training.task_data import TaskData


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

    def batch(self, positions: np.ndarray, images: torch.Tensor | EncodedImages | None = None,
              rows: tuple[int, int] | None = None) -> Batch:
        """The device batch of ``positions``; ``images`` (uint8, already read, e.g. by the stream; or their encoded
        bytes, decoded here on the device: ``training.decode: gpu``) or read here.

        rows: data-parallel training: ``images`` are rows [start, stop) of the global batch ``positions``."""
        if isinstance(images, EncodedImages):
            images = decode_on_device(images.blobs, images.image_shape[0], self.device,
                                      getattr(self.data.source, "name", "source"))
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

    def task_batches(self, batch_size: int) -> Iterator[Batch]:
        positions = np.arange(0, self.num_task, dtype=np.int64)
        for start in range(0, positions.size, batch_size):
            yield self.batch(positions[start : start + batch_size])

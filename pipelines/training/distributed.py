"""Data-parallel training of one stage over the ranks of a ``torch.distributed`` process group (DDP).

Who starts the ranks is not this module's concern (the Ray backend starts them through Ray Train's
``TorchTrainer``, :mod:`cluster.ray.train_stage`); :func:`current` finds the initialised group. The contract that
makes N ranks train like one process:

- Every rank walks the same global batches (the sampler is deterministic) and loads only its rows of each:
  :meth:`DataParallel.rows` gives rank r a contiguous, disjoint slice (``np.array_split`` sizes), so the union over
  ranks is exactly the 1-worker batch. Augmentation draws for the whole batch and keeps the rank's rows
  (``BatchTransform(rows=...)``), so the augmented global batch is the 1-worker one too.
- The model runs under DDP on the local rows; its outputs (and the frozen old model's) are all-gathered, so the
  method computes its loss, unchanged, on the *global* batch on every rank: InfoNCE sees every pair of the global
  batch, masked means (FD over memory samples, BCT's old-class samples) divide by the global counts.
- Gradients: the gather's backward sums, over ranks, the gradient each rank's (identical) loss sends to a rank's
  rows (``N * dL/d rows``); DDP then averages the parameter gradients over the N ranks, which leaves exactly the
  1-worker gradient. Extra trainable modules of a method (adapters, discriminators) see the gathered tensors and
  get identical gradients on every rank without DDP.
- Batch norm: synchronised (``SyncBatchNorm``) on GPUs, where torch supports it; on CPUs each rank normalises by
  its own rows' statistics (torch's SyncBatchNorm is GPU-only), so a backbone with batch norm trained on CPU ranks
  takes slightly different steps from one worker (see docs/data_parallel.md).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DataParallel:
    """This process's place in the data-parallel group: ``rank`` in ``[0, world)``."""

    rank: int
    world: int

    @property
    def leader(self) -> bool:
        """Rank 0 commits the stage's artifacts and emits its records; the other ranks write nothing."""
        return self.rank == 0

    def sizes(self, total: int) -> list[int]:
        """Rows of a global batch of ``total`` per rank (the first ``total % world`` ranks hold one more)."""
        base, extra = divmod(int(total), self.world)
        return [base + (1 if r < extra else 0) for r in range(self.world)]

    def rows(self, total: int) -> tuple[int, int]:
        """``[start, stop)`` of this rank's rows in a global batch of ``total`` rows."""
        sizes = self.sizes(total)
        start = sum(sizes[: self.rank])
        return start, start + sizes[self.rank]

    def check_batches(self, batch_sizes: list[int], key: str) -> None:
        """Refuse (before training) a batch too small to give every rank a row; ``key`` names the setting."""
        smallest = min(batch_sizes) if batch_sizes else 0
        if smallest < self.world:
            raise ValueError(f"{key} = {self.world}: a global batch of {smallest} samples cannot give every worker "
                             f"a sample; raise training.batch_size or lower {key}")

    def agree(self, value: Any) -> Any:
        """Rank 0's ``value`` (a small picklable setting, e.g. the autocast mode) on every rank."""
        holder = [value]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def gather(self, tensor: torch.Tensor, total: int) -> torch.Tensor:
        """The global batch of ``tensor`` (this rank's rows of a batch of ``total``), rank order.

        With a gradient: the backward sums every rank's gradient for this rank's rows (what DDP's averaging
        expects when each rank computes the loss of the whole batch); without: a plain all-gather.
        """
        sizes = self.sizes(total)
        if tensor.requires_grad and torch.is_grad_enabled():
            return _GatherRows.apply(tensor, sizes, self.rank)
        return _gather_rows(tensor.detach(), sizes)


def current() -> DataParallel | None:
    """The data-parallel group of this process (an initialised torch.distributed group of >= 2 ranks) or None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    return DataParallel(dist.get_rank(), world) if world > 1 else None


def is_leader() -> bool:
    """True outside data-parallel training and on rank 0 of it: the process that commits a stage."""
    parallel = current()
    return parallel is None or parallel.leader


# Set by whoever starts the ranks (cluster.ray.train_stage): builds the epoch-checkpoint sink of a data-parallel
# stage from its checkpoint policy (Ray Train's checkpoints instead of one store writer per rank).
_checkpoint_sink_factory: Callable[[Any], Any] | None = None


def use_checkpoint_sink(factory: Callable[[Any], Any] | None) -> None:
    """Install (or with None remove) the checkpoint sink factory of this process's data-parallel stages."""
    global _checkpoint_sink_factory
    _checkpoint_sink_factory = factory


def launcher_checkpoint_sink(policy: Any) -> Any | None:
    """The launcher's checkpoint sink for a data-parallel stage, or None (then the stage uses the run store's)."""
    if _checkpoint_sink_factory is None or current() is None:
        return None
    return _checkpoint_sink_factory(policy)


def _gather_rows(tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    # all_gather needs one shape on every rank: pad the local rows to the largest slice, then drop the padding
    largest = max(sizes)
    padded = tensor.new_zeros((largest, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat([part[:size] for part, size in zip(parts, sizes)])


class _GatherRows(torch.autograd.Function):
    """All-gather of row slices whose backward all-reduces (sums) the gradient and keeps this rank's rows."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, sizes: list[int], rank: int) -> torch.Tensor:
        ctx.sizes, ctx.rank = sizes, rank
        return _gather_rows(tensor, sizes)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        start = sum(ctx.sizes[: ctx.rank])
        return grad[start : start + ctx.sizes[ctx.rank]], None, None


class GlobalBatchModel:
    """Stands in for a model in ``TaskContext``: called on this rank's rows, returns the global batch's outputs.

    forward: what computes the local outputs (the DDP wrapper of the trained model, or the frozen old model).
    model: the plain model, for every other attribute a method reads (``num_slots``, ``classifier``...).
    ``total`` (rows of the current global batch) is set by the training loop before each step.
    """

    def __init__(self, forward: Any, model: nn.Module, parallel: DataParallel) -> None:
        self._forward, self._model, self._parallel = forward, model, parallel
        self.total = 0

    def __call__(self, images: torch.Tensor):
        output = self._forward(images)
        return dataclasses.replace(output, **{field.name: self._parallel.gather(getattr(output, field.name),
                                                                                  self.total)
                                              for field in dataclasses.fields(output)})

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """The global batch's L2-normalised features (what the frozen old model contributes to a loss)."""
        return self._parallel.gather(self._model.features(images), self.total)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def wrap_model(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` under DistributedDataParallel (batch norm synchronised on GPUs); parameters are shared, not copied.

    Rank 0's parameters and buffers are broadcast at construction and its buffers before each forward, so every
    rank holds rank 0's model.
    """
    if device.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        index = device.index if device.index is not None else torch.cuda.current_device()
        return nn.parallel.DistributedDataParallel(model, device_ids=[index])
    return nn.parallel.DistributedDataParallel(model)


def shard_batches(parallel: DataParallel, batches: list[np.ndarray]) -> list[np.ndarray]:
    """This rank's rows of every global batch of positions."""
    local = []
    for positions in batches:
        start, stop = parallel.rows(positions.size)
        local.append(positions[start:stop])
    return local


__all__ = ["DataParallel", "GlobalBatchModel", "current", "is_leader", "launcher_checkpoint_sink",
           "shard_batches", "use_checkpoint_sink", "wrap_model"]

"""Running measures of one task's loop: :class:`LoopStatistics` (steps, throughput, first step, checkpoint writes)
and :class:`InputStall` (device idle time waiting for input batches)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from pipelines.training.records import _Window


@dataclass
class LoopStatistics:
    """Running totals of one task's loop.

    step: optimiser steps done in the task; train_seconds / train_images: step time (input wait included) and
    images over those steps (carried by checkpoints, so a resumed task reports its throughput over all its steps);
    first_step_seconds: from the start of :meth:`Trainer.prepare` to the end of this process's first step;
    checkpoints_written / checkpoint_seconds: saves by this process and the seconds they took.
    """

    step: int = 0
    train_seconds: float = 0.0
    train_images: int = 0
    first_step_seconds: float | None = None
    checkpoints_written: int = 0
    checkpoint_seconds: float = 0.0

    @property
    def images_per_s(self) -> float:
        """Training throughput over the task's steps so far (images per second)."""
        return self.train_images / max(self.train_seconds, 1e-9)

    def add_step(self, images: int, seconds: float) -> None:
        """Count a step's time and images (the step itself is counted when the optimiser steps)."""
        self.train_seconds += seconds
        self.train_images += images

    def add_checkpoint(self, seconds: float) -> None:
        self.checkpoints_written += 1
        self.checkpoint_seconds += seconds

    def checkpoint_extras(self, window: _Window) -> dict[str, Any]:
        """What a checkpoint carries besides the step: throughput totals and the open record window."""
        return {"train_seconds": self.train_seconds, "train_images": self.train_images, "window": window.state()}

    def restore(self, step: int, extras: Mapping[str, Any]) -> None:
        """Take the step and the totals from a checkpoint's position (:meth:`checkpoint_extras`)."""
        self.step = step
        self.train_seconds, self.train_images = extras["train_seconds"], extras["train_images"]


class InputStall:
    """Seconds the device sat idle waiting for input batches (an upper bound).

    After each step a CUDA event marks the end of the work queued so far. When the next batch arrives, the host's wait
    counts as a stall only if that event has already completed, i.e. the accelerator ran out of work before the
    batch came; a wait while queued work still runs costs nothing. On the CPU every wait is a stall.
    """

    def __init__(self, device: torch.device) -> None:
        self.seconds = 0.0
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self._queued = False

    def step_queued(self) -> None:
        if self._event is not None:
            self._event.record()
            self._queued = True

    def batch_arrived(self, waited_seconds: float) -> None:
        if self._event is None or not self._queued or self._event.query():
            self.seconds += max(0.0, waited_seconds)


__all__ = ["InputStall", "LoopStatistics"]

"""What the training loop emits and returns: per-window summaries (``TrainRecord``, accumulated on the device by
``_Window``), the task's ``TrainResult`` and the progress hook's signature."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import nn


@dataclass
class TrainRecord:
    """One training summary (per epoch, or every ``log_every_steps`` steps).

    task/epoch: 0-based; step: optimiser steps done in this task so far; loss / loss_parts: means since the
    previous record (nats); lr at the last step; images_per_s: training throughput since the previous record;
    seconds: wall time since the previous record; metrics: model-selection Recall@1 values (fractions), if any.
    """

    task: int
    epoch: int
    step: int
    loss: float
    loss_parts: dict[str, float]
    lr: float
    images_per_s: float
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class TrainResult:
    """What ``train_task`` returns.

    model: trained model (the selected epoch's weights, on ``config.device``, eval mode). selected_epoch: 0-based.
    images_per_s: mean training throughput over the task. extra_state: adapters the method exports by name
    (compat_core.upgrades.adapters.Adapter; FAN's psi_t). selection: per-epoch model-selection metrics (self / cross Recall@1 fractions), empty for "last".
    """

    model: nn.Module
    records: list[TrainRecord]
    selected_epoch: int
    images_per_s: float
    seconds: float
    extra_state: dict[str, Any] = field(default_factory=dict)
    selection: list[dict[str, float]] = field(default_factory=list)
    resumed_from_epoch: int | None = None  # completed epochs restored from an epoch checkpoint (None: fresh start)
    input_stall_seconds: float = 0.0  # device idle while waiting for input batches (upper bound), seconds
    first_step_seconds: float | None = None  # from train_task's start to the end of the first step, seconds
    peak_device_memory_bytes: int | None = None  # CUDA only: peak allocated by this process during the task
    loop_unix_seconds: tuple[float, float] | None = None  # wall-clock start and end of the training loop (Unix time)
    checkpoint_seconds: float = 0.0  # spent writing epoch checkpoints during the task (inside ``seconds``)
    checkpoints_written: int = 0


ProgressHook = Callable[[int, int, int, float], None]


class _Window:
    """Running sums of the loss and its parts between two records, kept as device tensors.

    ``add`` never reads a value back to the host; ``record`` does once (one device sync per record), and raises
    FloatingPointError when any step of the window had a non-finite loss (checked there, not per step, so that the
    training step does not wait for the accelerator).
    """

    def __init__(self) -> None:
        self.count = 0
        self.loss_sum: torch.Tensor | float = 0.0
        self.nonfinite: torch.Tensor | int = 0
        self.part_sums: dict[str, torch.Tensor | float] = {}
        self.images = 0
        self.seconds = 0.0

    def state(self) -> dict[str, Any]:
        """The sums as plain data / CPU tensors (a checkpoint taken mid-epoch keeps the epoch's record exact)."""
        cpu = lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v  # noqa: E731
        return {"count": self.count, "loss_sum": cpu(self.loss_sum), "nonfinite": cpu(self.nonfinite),
                "part_sums": {k: cpu(v) for k, v in self.part_sums.items()}, "images": self.images,
                "seconds": self.seconds}

    @classmethod
    def from_state(cls, state: Mapping[str, Any], device: torch.device) -> "_Window":
        window = cls()
        on = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
        window.count, window.images, window.seconds = int(state["count"]), int(state["images"]), state["seconds"]
        window.loss_sum, window.nonfinite = on(state["loss_sum"]), on(state["nonfinite"])
        window.part_sums = {k: on(v) for k, v in state["part_sums"].items()}
        return window

    def add(self, loss: torch.Tensor, parts: Mapping[str, Any], images: int, seconds: float) -> None:
        self.count += 1
        loss = loss.detach().float()
        self.loss_sum = self.loss_sum + loss
        self.nonfinite = self.nonfinite + (~torch.isfinite(loss)).int()
        for key, value in parts.items():
            value = value.detach().float() if isinstance(value, torch.Tensor) else float(value)
            self.part_sums[key] = self.part_sums.get(key, 0.0) + value
        self.images += images
        self.seconds += seconds

    def record(self, task: int, epoch: int, step: int, optimizer: torch.optim.Optimizer,
               metrics: Mapping[str, float] | None = None, method_name: str = "") -> TrainRecord:
        count = max(self.count, 1)
        names = list(self.part_sums)
        # one transfer for the loss, the non-finite count and every part
        device = self.loss_sum.device if isinstance(self.loss_sum, torch.Tensor) else None
        # float parts (e.g. a schedule weight) join the device tensors, so one copy reads everything
        values = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=device).reshape(())
                              for v in [self.loss_sum, self.nonfinite, *(self.part_sums[n] for n in names)]])
        host = values.cpu().tolist() if self.count else [math.nan, 0.0] + [0.0] * len(names)
        loss_sum, nonfinite, part_values = host[0], int(host[1]), host[2:]
        parts = {name: value / count for name, value in zip(names, part_values)}
        if nonfinite:
            raise FloatingPointError(
                f"method {method_name!r}: non-finite loss in {nonfinite} of the {self.count} steps ending at step "
                f"{step} (task {task}, epoch {epoch}; mean {loss_sum / count}, parts {parts}); lower training.optimizer.lr"
            )
        return TrainRecord(
            task=task,
            epoch=epoch,
            step=step,
            loss=loss_sum / count if self.count else math.nan,
            loss_parts=parts,
            lr=float(optimizer.param_groups[0]["lr"]),
            images_per_s=self.images / max(self.seconds, 1e-9),
            seconds=self.seconds,
            metrics=dict(metrics or {}),
        )

"""The optimiser and the learning-rate schedule of a task: parameter groups (weight decay on which parameters),
the optimiser of ``training.optimizer`` and the multiplier of each step from ``training.schedule``."""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

from pipelines.training.settings import TrainConfig


def lr_factor(config: TrainConfig, steps_per_epoch: int) -> Callable[[int], float]:
    """The learning-rate multiplier of optimiser step ``step`` (0-based): linear warm-up, then the schedule."""
    total = config.epochs * steps_per_epoch
    warmup = config.warmup_epochs * steps_per_epoch

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if config.schedule.name == "cosine":
            if config.schedule.interval == "epoch":
                progress = (step // steps_per_epoch - config.warmup_epochs) / (config.epochs - config.warmup_epochs)
            else:
                progress = (step - warmup) / max(1, total - warmup)
            floor = config.schedule.min_lr / config.optimizer.lr
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        if config.schedule.name == "step":
            epoch = step // steps_per_epoch
            return config.schedule.gamma ** sum(1 for milestone in config.schedule.milestones if epoch >= milestone)
        return 1.0

    return factor


def parameter_groups(named: list[tuple[str, nn.Parameter]], config: TrainConfig) -> list[dict[str, Any]]:
    """The optimiser's parameter groups of the trained ``(name, parameter)`` pairs: one group, or with
    ``optimizer.weight_decay_exclude: norm_and_bias`` the parameters of fewer than 2 dimensions (normalisation gains
    and shifts, biases) without weight decay first, then the rest."""
    trained = [(name, p) for name, p in named if p.requires_grad]
    if config.optimizer.weight_decay_exclude == "none":
        return [{"params": [p for _, p in trained]}]
    exempt = [p for name, p in trained if p.ndim < 2 or name.endswith("bias")]
    kept = {id(p) for p in exempt}
    return [{"params": exempt, "weight_decay": 0.0}, {"params": [p for _, p in trained if id(p) not in kept]}]


def make_optimizer(parameters: list[nn.Parameter] | list[dict[str, Any]], config: TrainConfig) -> torch.optim.Optimizer:
    """The optimiser of ``config.optimizer`` over ``parameters`` (or parameter groups, :func:`parameter_groups`):
    the fused kernels (one launch for every parameter) on CUDA; on the CPU the default per-parameter path, so CPU
    runs keep their numerics."""
    settings = config.optimizer
    fused = {"fused": True} if torch.device(config.device).type == "cuda" else {}
    if settings.name == "sgd":
        return torch.optim.SGD(parameters, lr=settings.lr, momentum=settings.momentum, weight_decay=settings.weight_decay,
                               **fused)
    return torch.optim.AdamW(parameters, lr=settings.lr, weight_decay=settings.weight_decay, **fused)


__all__ = ["lr_factor", "make_optimizer", "parameter_groups"]

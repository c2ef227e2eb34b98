"""Measured choice of ``training.autocast: auto``: seconds per step of a model on a probe batch in fp32 and under
half-precision autocast (bf16; fp16 on CUDA without bf16), for training (forward, backward, SGD step) or inference,
cached per machine key and workload signature in the calibration file of :mod:`compat_core.hardware.calibration`. The model is
measured on a private copy, so its weights, its batch-norm statistics and the global RNG state are untouched.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable

import torch
from torch import nn

from compat_core.hardware.calibration import (
    _HALF_MARGIN,
    _ROUNDS,
    _now,
    _time_rounds,
    cached_measurement,
    calibration_enabled,
    workload_signature,
)

__all__ = ["PROBE_BATCH", "autocast_choice", "measure_workload"]

_WORKLOAD_BUDGET_S = 6.0                 # rough cap on one workload's timed steps
# Images per timed training step: the choice between fp32 and half is a property of the model's kernels, measured
# in seconds on a small batch; the training batch (320 ViT-B images at 224 px: ~60 GB of fp32 activations on a GPU)
# would cost minutes and its own memory before the first real step.
PROBE_BATCH = 16


def _half_candidate(device: torch.device) -> torch.dtype:
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def _output_loss(output: Any) -> torch.Tensor:
    """A scalar touching every tensor output of ``output`` (a tensor, a tuple, or an object with .features/.logits)."""
    if isinstance(output, torch.Tensor):
        return output.float().square().mean()
    if isinstance(output, (tuple, list)):
        parts = [_output_loss(item) for item in output if isinstance(item, torch.Tensor)]
    else:
        parts = [value.float().square().mean() for value in (getattr(output, "features", None),
                                                             getattr(output, "logits", None))
                 if isinstance(value, torch.Tensor)]
    if not parts:
        raise ValueError(f"model output of type {type(output).__name__} has no tensor to time a step on")
    return sum(parts)


def _has_conv(model: nn.Module) -> bool:
    return any(isinstance(module, nn.Conv2d) for module in model.modules())


def _step_function(model: nn.Module, inputs: torch.Tensor, dtype: torch.dtype | None, train: bool,
                   device: torch.device, channels_last: bool | None = None
                   ) -> tuple[Callable[[], None], Callable[[], None]]:
    """One step of ``model`` (the calibration's private copy) and the untimed preparation that puts the copy and the
    inputs in the step's memory layout: ``channels_last`` (None: with a half dtype for conv nets)."""
    if channels_last is None:
        channels_last = dtype is not None and _has_conv(model)
    channels_last = channels_last and inputs.ndim == 4
    layout = torch.channels_last if channels_last else torch.contiguous_format
    batch = inputs.contiguous(memory_format=layout)

    def prepare() -> None:
        model.to(memory_format=layout)

    context = (lambda: torch.autocast(device_type=device.type, dtype=dtype)) if dtype is not None \
        else contextlib.nullcontext
    if train:
        model.train()
        parameters = [p for p in model.parameters() if p.requires_grad]
        # plain SGD keeps no state: the calibration's memory is one copy of the model, its gradients and a probe batch
        optimizer = torch.optim.SGD(parameters, lr=1e-6)

        def step() -> None:
            with context():
                loss = _output_loss(model(batch))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    else:
        model.eval()

        def step() -> None:
            with torch.no_grad(), context():
                _output_loss(model(batch))
    return step, prepare


def measure_workload(model: nn.Module, example: torch.Tensor, device: torch.device | str, train: bool = True,
                     rounds: int = _ROUNDS) -> dict[str, Any]:
    """Seconds per step of ``model`` on ``example`` in fp32 and under half autocast (interleaved, min of rounds).

    ``example`` is cut to its first ``PROBE_BATCH`` rows, and both paths step ONE private copy of the model (plain
    SGD, no optimiser state), so memory stays bounded by the model, its gradients and the probe's activations whatever
    the training batch. Runs inside ``torch.random.fork_rng``: the caller's model and RNG state are unchanged.
    Returns {"seconds_per_step": {"fp32": s, "bf16"|"fp16": s}, "choice", "measured_at", "probe_batch"}.
    """
    device = torch.device(device)
    half = _half_candidate(device)
    half_name = "bf16" if half == torch.bfloat16 else "fp16"
    devices = [device.index or 0] if device.type == "cuda" else []
    probe = example[:PROBE_BATCH].to(device)
    with torch.random.fork_rng(devices=devices):
        private = copy.deepcopy(model).to(device)
        for parameter in private.parameters():
            parameter.requires_grad_(True)
        steps, layouts = {}, {}
        steps["fp32"], layouts["fp32"] = _step_function(private, probe, None, train, device)
        try:
            steps[half_name], layouts[half_name] = _step_function(private, probe, half, train, device)
            layouts[half_name]()
            steps[half_name]()
        except (RuntimeError, TypeError, NotImplementedError):
            steps.pop(half_name, None)
        first = _time_rounds(steps, device, 1, prepare=layouts)          # warm-up + one timed round
        spare = max(0, min(rounds - 1, int(_WORKLOAD_BUDGET_S / max(sum(first.values()), 1e-9)) - 1))
        more = _time_rounds(steps, device, spare, prepare=layouts) if spare else first
        seconds = {name: min(first[name], more[name]) for name in steps}
        del private, steps, layouts
    choice = "fp32"
    if half_name in seconds and seconds["fp32"] > _HALF_MARGIN * seconds[half_name]:
        choice = half_name
    return {"seconds_per_step": {name: float(f"{value:.4g}") for name, value in seconds.items()}, "choice": choice,
            "measured_at": _now(), "probe_batch": int(probe.shape[0])}


def autocast_choice(device: torch.device | str, model: nn.Module, example: torch.Tensor,
                    train: bool = True) -> torch.dtype | None:
    """The autocast dtype that ``training.autocast: auto`` uses for ``model`` on batches like ``example``: the
    half dtype when its measured step is faster than fp32 (by 2 %), else None (fp32). Measured once per machine
    key and workload signature and cached; None without measuring when calibration is off."""
    if not calibration_enabled():
        return None
    device = torch.device(device)
    example = example[:PROBE_BATCH]  # the cache name, like the measurement, is that of the probe batch
    name = workload_signature(model, example, train)
    entry = cached_measurement(device, "workloads", name, lambda entry: entry.get("choice") in ("fp32", "bf16", "fp16"),
                               lambda: measure_workload(model, example, device, train))
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[entry["choice"]]

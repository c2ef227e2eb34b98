"""Measured choice of ``training.channels_last: auto``: a training step of a convolutional model with its weights and
batches in the contiguous (NCHW) layout against the same step in channels_last (NHWC), under the run's autocast
dtype, cached per machine key (device, cores, threads, torch version) and workload signature (model digest, probe
batch shape, dtype) in the calibration file of :mod:`compat_core.hardware.calibration`. channels_last is chosen only
where its step is faster by a margin. The model is measured on private copies, so its weights, its batch-norm
statistics and the global RNG state are untouched.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from compat_core.hardware.calibration import _now, _time_rounds, cached_measurement, calibration_enabled, \
    training_signature
from compat_core.hardware.workloads import PROBE_BATCH, _step_function

__all__ = ["channels_last_choice", "channels_last_pays", "measure_layouts"]

_ROUNDS = 3            # timed rounds per layout after the warm-up (the minimum is kept)
_MARGIN = 1.02         # channels_last must save at least 2 % of the contiguous step


def measure_layouts(model: nn.Module, example: torch.Tensor, device: torch.device | str,
                    dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Seconds of one training step of ``model`` on ``example[:PROBE_BATCH]`` with weights and batch contiguous and
    in channels_last (two private copies, plain SGD, under autocast ``dtype`` when given, interleaved rounds, the
    minimum kept). Returns {"contiguous_s", "channels_last_s", "probe_batch", "measured_at", "choice": on | off}."""
    device = torch.device(device)
    probe = example[:PROBE_BATCH].to(device)
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        steps, layouts = {}, {}
        for name, channels_last in (("contiguous", False), ("channels_last", True)):
            private = copy.deepcopy(model).to(device).requires_grad_(True)
            steps[name], layouts[name] = _step_function(private, probe, dtype, True, device, channels_last)
            layouts[name]()
        seconds = _time_rounds(steps, device, _ROUNDS)
        del steps, layouts
    measured = {"contiguous_s": float(f"{seconds['contiguous']:.4g}"),
                "channels_last_s": float(f"{seconds['channels_last']:.4g}"), "probe_batch": int(probe.shape[0]),
                "measured_at": _now()}
    return {**measured, "choice": "on" if channels_last_pays(measured) else "off"}


def channels_last_pays(measured: dict[str, Any]) -> bool:
    """Whether the measured channels_last step is faster than the contiguous one by the margin (2 %)."""
    return float(measured["contiguous_s"]) > _MARGIN * float(measured["channels_last_s"])


def channels_last_choice(device: torch.device | str, model: nn.Module, example: torch.Tensor,
                         dtype: torch.dtype | None = None) -> bool:
    """``training.channels_last: auto`` for the convolutional ``model`` on batches like ``example`` under autocast
    ``dtype``: True where :func:`channels_last_pays` on the cached (else measured now) probe. False without
    measuring when calibration is off (``COMPAT_CALIBRATION=off``)."""
    if not calibration_enabled():
        return False
    device, example = torch.device(device), example[:PROBE_BATCH]
    name = training_signature(model, example, dtype)
    entry = cached_measurement(device, "channels_last", name,
                               lambda entry: all(key in entry for key in ("contiguous_s", "channels_last_s")),
                               lambda: measure_layouts(model, example, device, dtype))
    return channels_last_pays(entry)

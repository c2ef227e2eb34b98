"""Measured choice of ``training.compile: auto``: an eager training step of a model against the same step through
``torch.compile``, with the compile time itself measured, cached per machine key (device, cores, threads, torch
version) and workload signature (model digest, probe batch shape, autocast dtype) in the calibration file of
:mod:`compat_core.hardware.calibration`. The decision is taken per stage from the cached seconds: compile only where
``compile_seconds + steps * compiled_step < steps * eager_step`` (the per-step seconds scaled from the probe batch to
the training batch). The model is measured on private copies, so its weights and the global RNG state are untouched.
"""
from __future__ import annotations

import copy
import time
from typing import Any

import torch
from torch import nn

from compat_core.hardware.calibration import _now, _time_rounds, cached_measurement, calibration_enabled, \
    training_signature
from compat_core.hardware.workloads import PROBE_BATCH, _step_function

__all__ = ["compile_choice", "compile_pays", "measure_compile"]

_ROUNDS = 3            # timed rounds per path after the warm-up (the minimum is kept)
_MARGIN = 1.02         # the compiled path must save at least 2 % after its compile time


def _synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_compile(model: nn.Module, example: torch.Tensor, device: torch.device | str,
                    dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Seconds of one training step of ``model`` on ``example[:PROBE_BATCH]``, eager and compiled, and the seconds
    of the compiled path's first step (tracing and code generation: the compile time a stage pays once).

    Runs inside ``torch.random.fork_rng`` on two private copies (plain SGD, as the autocast calibration), under
    autocast ``dtype`` when given. Returns {"eager_s", "compiled_s", "compile_s", "probe_batch", "measured_at"}.
    """
    device = torch.device(device)
    probe = example[:PROBE_BATCH].to(device)
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        eager = copy.deepcopy(model).to(device).requires_grad_(True)
        compiled_copy = copy.deepcopy(model).to(device).requires_grad_(True)
        compiled = torch.compile(compiled_copy)
        eager_step, _ = _step_function(eager, probe, dtype, True, device)
        compiled_step, _ = _step_function(compiled, probe, dtype, True, device)
        _synchronise(device)
        started = time.perf_counter()
        compiled_step()                      # tracing, graph capture and code generation
        _synchronise(device)
        compile_seconds = time.perf_counter() - started
        seconds = _time_rounds({"eager": eager_step, "compiled": compiled_step}, device, _ROUNDS)
        del eager, compiled, compiled_copy
    return {"eager_s": float(f"{seconds['eager']:.4g}"), "compiled_s": float(f"{seconds['compiled']:.4g}"),
            "compile_s": float(f"{compile_seconds:.4g}"), "probe_batch": int(probe.shape[0]), "measured_at": _now()}


def compile_pays(measured: dict[str, Any], steps: int, batch_size: int) -> bool:
    """Whether compiling pays over ``steps`` steps of ``batch_size`` images: the per-step seconds of the probe are
    scaled by ``batch_size / probe_batch`` (a step's work grows with its batch), the compile time is paid once."""
    scale = max(1.0, batch_size / max(1, int(measured["probe_batch"])))
    eager_total = steps * scale * float(measured["eager_s"])
    compiled_total = float(measured["compile_s"]) + steps * scale * float(measured["compiled_s"])
    return eager_total > _MARGIN * compiled_total


def compile_choice(device: torch.device | str, model: nn.Module, example: torch.Tensor, steps: int,
                   batch_size: int, dtype: torch.dtype | None = None) -> bool:
    """``training.compile: auto`` for ``model`` on batches like ``example`` over a stage of ``steps`` steps of
    ``batch_size``: True where :func:`compile_pays` on the cached (else measured now) probe. False without
    measuring when calibration is off (``COMPAT_CALIBRATION=off``)."""
    if not calibration_enabled():
        return False
    device, example = torch.device(device), example[:PROBE_BATCH]
    name = training_signature(model, example, dtype)
    keys = ("eager_s", "compiled_s", "compile_s", "probe_batch")
    entry = cached_measurement(device, "compile", name, lambda entry: all(key in entry for key in keys),
                               lambda: measure_compile(model, example, device, dtype))
    return compile_pays(entry, steps, batch_size)

"""Mixed precision for training and feature extraction: the autocast setting ("auto" / "bf16" / "fp16" / "off"), its
context, the measured choice behind "auto" (``compat_core.hardware.calibration``) and the model preparation that goes with it."""
from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch
from torch import nn

from compat_core.data.source import ImageSource
from compat_core.data.transforms import make_transforms
from compat_core.hardware.compile_probe import compile_choice
from compat_core.hardware.layout_probe import channels_last_choice
from compat_core.hardware.workloads import PROBE_BATCH, autocast_choice
from compat_core.models.precision import autocast_context, has_convolutions, prepare_for_speed
from pipelines.training.settings import autocast_mode

# "auto": bf16/fp16 autocast only where a measured step of this model is faster than fp32 (compat_core.hardware.calibration,
# cached per machine); "bf16"/"fp16": forced; "off": fp32.
_FORCED_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def precision_context(device: torch.device | str, mode: Any):
    """The autocast context of ``mode`` (auto, bf16, fp16 or off) on ``device``; a null context for fp32."""
    mode = autocast_mode(mode)
    device = torch.device(device)
    if mode == "off":
        return contextlib.nullcontext()
    if mode == "auto":
        return autocast_context(device, enabled=True)
    return torch.autocast(device_type=device.type, dtype=_FORCED_DTYPES[mode])


def resolve_autocast(mode: Any, device: torch.device | str, model: nn.Module, example: torch.Tensor,
                     train: bool = True) -> str:
    """Turn "auto" into "bf16"/"fp16"/"off": the measured faster step of ``model`` on batches shaped like
    ``example`` (``compat_core.hardware.calibration.autocast_choice``, cached per machine); other modes are returned as is."""
    mode = autocast_mode(mode)
    if mode != "auto":
        return mode
    dtype = autocast_choice(device, model, example, train=train)
    return {None: "off", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def resolve_compile(mode: str, device: torch.device | str, model: nn.Module, example: torch.Tensor, steps: int,
                    batch_size: int, autocast: Any = "off") -> str:
    """Turn ``training.compile: auto`` into "on"/"off": compiled where the timed probe says it pays over ``steps``
    steps of ``batch_size`` under the resolved ``autocast`` (``compat_core.hardware.compile_probe``, cached per
    machine, shape and torch version); "on"/"off" are returned as is."""
    if mode != "auto":
        return mode
    dtype = _FORCED_DTYPES.get(autocast_mode(autocast))
    return "on" if compile_choice(device, model, example, steps, batch_size, dtype) else "off"


def resolve_channels_last(mode: str, device: torch.device | str, model: nn.Module, example: torch.Tensor | None,
                          autocast: Any = "off") -> str:
    """Turn ``training.channels_last: auto`` into "on"/"off": on where the timed probe of ``model`` in both layouts
    under the resolved ``autocast`` says channels_last is faster (``compat_core.hardware.layout_probe``, cached per
    machine, shape and torch version; ``example`` is needed only then); off without measuring for a model without
    convolutions. "on" for such a model is a ValueError naming the setting; "on"/"off" are otherwise returned as
    is."""
    convolutional = has_convolutions(model)
    if mode == "on" and not convolutional:
        raise ValueError(f"training.channels_last: on needs a convolutional backbone; {type(model).__name__} has no "
                         f"2-D convolution besides a ViT patch embedding; use auto or off")
    if mode != "auto":
        return mode
    if not convolutional:
        return "off"
    dtype = _FORCED_DTYPES.get(autocast_mode(autocast))
    return "on" if channels_last_choice(device, model, example, dtype) else "off"


def example_batch(source: ImageSource, indices: np.ndarray, batch_size: int, device: torch.device) -> torch.Tensor:
    """The calibration's probe batch: ``min(batch_size, PROBE_BATCH)`` images of ``source`` (the first ``indices``,
    cycled when fewer), transformed as for evaluation. Only these images are read and decoded."""
    picked = np.resize(np.asarray(indices, dtype=np.int64), min(int(batch_size), PROBE_BATCH))
    images = torch.from_numpy(np.ascontiguousarray(source.read(picked)))
    return make_transforms(source, train=False)(images.to(device))


def prepare_model(model: nn.Module, device: torch.device | str, mode: Any, channels_last: str | None = None
                  ) -> nn.Module:
    """Move ``model`` to ``device`` in its layout: channels_last "on" / "off" (a training stage's resolved
    ``training.channels_last``); None (feature extraction): conv nets go channels_last where the half path makes
    NHWC kernels pay."""
    if channels_last is not None:
        layout = torch.channels_last if channels_last == "on" else torch.contiguous_format
        return model.to(device).to(memory_format=layout)
    model = prepare_for_speed(model, device)
    if autocast_mode(mode) in _FORCED_DTYPES and has_convolutions(model):
        model = model.to(memory_format=torch.channels_last)
    return model

"""Mixed precision and memory layout for a device.

- ``autocast_context(device)``: the autocast assumed fast without measuring (CUDA with tensor cores; on CPUs a
  no-op, fp32). Where a model and a batch are at hand, ``training.autocast: auto`` measures instead
  (``compat_core.hardware.workloads.autocast_choice``, used by ``pipelines.training.autocast.resolve_autocast``), because CPU
  flags do not predict whether bf16 pays.
- ``prepare_for_speed(model, device)``: moves the model and switches conv nets to channels_last on CUDA and where
  a half-precision path is enabled (oneDNN's bf16 convolutions are NHWC kernels).

Measured (AMD EPYC, 2 threads, AVX-512 with avx512_bf16 but no AMX; CIFAR ResNet-18 + junction, batch 32, one SGD
train step, interleaved runs, min of 6): fp32 NCHW 0.32 s, fp32 channels_last 0.30 s, bf16 autocast NCHW 0.18 s,
bf16 autocast channels_last 0.17 s. On a 2-core Xeon with the same flags a cnn4 step took the same time in fp32 and
bf16: hence measurement, not flags.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
from torch import nn

from compat_core.hardware.device import autocast_dtype


def autocast_context(device: torch.device | str, enabled: bool = True) -> ContextManager:
    """``torch.autocast`` with the fast half dtype of ``device``, or a null context (fp32) when there is none."""
    device = torch.device(device)
    dtype = autocast_dtype(device) if enabled else None
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def has_convolutions(model: nn.Module) -> bool:
    """True when ``model`` contains a 2-D convolution other than a ViT patch embedding."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d) and not name.endswith("patch_embed.proj"):
            return True
    return False


def channels_last_pays(device: torch.device | str) -> bool:
    """Whether NHWC convolutions are expected to be faster than NCHW on ``device``."""
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and autocast_dtype(device) is not None)


def prepare_for_speed(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Move ``model`` to ``device`` and use channels_last for conv nets where it pays; returns the same module."""
    device = torch.device(device)
    model = model.to(device)
    if has_convolutions(model) and channels_last_pays(device):
        model = model.to(memory_format=torch.channels_last)
    return model


def prepare_batch(images: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """Give a ``(B, C, H, W)`` batch the memory format of the model's first conv weight (avoids a layout copy)."""
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            if images.ndim == 4 and module.weight.is_contiguous(memory_format=torch.channels_last):
                return images.contiguous(memory_format=torch.channels_last)
            break
    return images

"""What a training stage needs in memory, estimated from the config before any stage, and what the machine has.

A training stage holds, in fp32: the parameters (the backbone, counted on torch's ``meta`` device where nothing is
allocated, the junction ``m x (K-1)`` and a learnable classifier ``K x d``), their gradients, the optimiser's two
moments (Adam), the frozen previous model, the activations of one batch (each module's output, measured by a
forward pass on ``meta`` tensors, once kept and once as its gradient) and the head's ``(B, K)`` logits with the
``(B, d)`` features (the d-Simplex prototypes are never built: their logits are computed in closed form). It is an
estimate: allocator overheads and temporary buffers are not counted.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from compat_core.models.backbones import create_backbone, embedding_width

FLOAT_BYTES = 4
GIB = float(1 << 30)


@dataclass
class TrainingMemory:
    """The parts of one training stage's memory, in bytes; ``unknown`` names what could not be measured."""

    parts: dict[str, int] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        shown = ", ".join(f"{name} {value / GIB:.2f}" for name, value in self.parts.items() if value)
        return f"{self.total / GIB:.2f} GiB ({shown} GiB)"


def _backbone_on_meta(name: str, options: dict, batch: int, image_shape: tuple[int, int, int] | None,
                      estimate: TrainingMemory) -> int:
    """Parameters of backbone ``name`` built on the meta device; adds one batch's activations to ``estimate``."""
    try:
        with torch.device("meta"):
            module = create_backbone(name, **options)
    except Exception as error:  # noqa: BLE001 - a backbone that cannot be built on meta is estimated without it
        estimate.unknown.append(f"backbone {name} parameters ({type(error).__name__})")
        return 0
    count = sum(parameter.numel() for parameter in module.parameters())
    if image_shape is None:
        estimate.unknown.append("activations (the data's image shape is unknown)")
        return count
    outputs = [0]

    def add(_module, _inputs, output) -> None:
        if isinstance(output, torch.Tensor):
            outputs[0] += output.numel()

    hooks = [child.register_forward_hook(add) for child in module.modules()]
    height, width, channels = image_shape
    try:
        module(torch.empty(batch, channels, height, width, device="meta"))
        estimate.parts["activations"] = 2 * outputs[0] * FLOAT_BYTES
    except Exception as error:  # noqa: BLE001 - same: the estimate says what it leaves out
        estimate.unknown.append(f"activations of {name} ({type(error).__name__})")
    finally:
        for hook in hooks:
            hook.remove()
    return count


def training_memory(backbone: str, backbone_config: dict, num_slots: int, classifier: str, head: str,
                    batch_size: int, image_shape: tuple[int, int, int] | None,
                    old_model: bool = True) -> TrainingMemory:
    """The estimate of one training stage (see the module docstring); bytes per part."""
    estimate = TrainingMemory()
    width = embedding_width(backbone, backbone_config)
    feature_dim = num_slots - 1 if head == "junction" else width
    parameters = _backbone_on_meta(backbone, dict(backbone_config), batch_size, image_shape, estimate)
    parameters += width * (num_slots - 1) if head == "junction" else 0
    parameters += num_slots * feature_dim if classifier == "learnable" else 0
    weights = parameters * FLOAT_BYTES
    estimate.parts = {"parameters": weights, "gradients": weights, "optimizer state": 2 * weights,
                      "previous model": weights if old_model else 0,
                      "activations": estimate.parts.get("activations", 0),
                      "logits and features": 3 * batch_size * (num_slots + feature_dim) * FLOAT_BYTES}
    return estimate


def _cgroup_room() -> int | None:
    """Bytes the memory cgroup (v2) of this process still allows, or None without a limit."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(int(limit) - used, 0)


def available_memory(device: str) -> tuple[int, str]:
    """(bytes, what) the stage can use on ``device``: free CUDA memory, else the host's available RAM (the
    kernel's MemAvailable, capped by the process's memory cgroup)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        index = int(device.partition(":")[2] or 0)
        free, _total = torch.cuda.mem_get_info(index)
        return int(free), f"free memory of CUDA device {index}"
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    room = _cgroup_room()
    return (available if room is None else min(available, room)), "available host RAM"


__all__ = ["GIB", "TrainingMemory", "available_memory", "training_memory"]

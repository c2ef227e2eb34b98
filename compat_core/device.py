"""What the hardware is good at: used to pick fast half-precision paths and to fall back where they are slow."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def cpu_has_amx() -> bool:
    """True when the CPU has AMX tile units for bf16/fp16 matrix products (Sapphire Rapids and later)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as handle:
            for line in handle:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return "amx_bf16" in flags and "amx_tile" in flags
    except OSError:
        return False
    return False


def fast_half_dtype(device: torch.device | str) -> torch.dtype | None:
    """The half-precision dtype whose matrix products are faster than fp32 on ``device``, or None.

    CUDA with tensor cores (compute capability >= 7.0): fp16 (bf16 from 8.0). CPU: bf16 only with AMX; without
    it half precision is slower than fp32 BLAS, so callers must fall back to fp32.
    """
    device = torch.device(device)
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        if major >= 8:
            return torch.bfloat16
        if major >= 7:
            return torch.float16
        return None
    if device.type == "cpu" and cpu_has_amx():
        return torch.bfloat16
    return None


def autocast_dtype(device: torch.device | str) -> torch.dtype | None:
    """dtype for ``torch.autocast`` during training/extraction on ``device`` (None: run in fp32)."""
    return fast_half_dtype(device)

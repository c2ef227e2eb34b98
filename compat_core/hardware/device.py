"""What the hardware has (CPU flags, CUDA capability). Speed is decided by measurement (compat_core.hardware.calibration);
the flags only pick which half dtype a forced ``precision="half"`` uses and are shown for information."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of the first processor in /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        return frozenset()
    return frozenset()


def cpu_has_amx() -> bool:
    """True when the CPU has AMX tile units for bf16 matrix products (Sapphire Rapids and later)."""
    flags = cpu_flags()
    return "amx_bf16" in flags and "amx_tile" in flags


def cpu_has_amx_fp16() -> bool:
    """True when the AMX tiles also multiply fp16 (Granite Rapids and later), accumulating in fp32."""
    return cpu_has_amx() and "amx_fp16" in cpu_flags()


def cpu_has_avx512_bf16() -> bool:
    """True when the CPU has the AVX-512 bf16 dot-product instruction (e.g. AMD Zen 4/5, Cooper Lake).

    oneDNN uses it for bf16 matrix products with fp32 accumulation; measured 4x the fp32 matmul rate on a 2-core
    AMD EPYC without AMX.
    """
    return "avx512_bf16" in cpu_flags()


def fast_half_dtype(device: torch.device | str) -> torch.dtype | None:
    """The autocast dtype assumed fast on ``device`` without measuring, or None (fp32).

    CUDA with tensor cores (compute capability >= 7.0): fp16 (bf16 from 8.0). CPU: None. CPU flags do not predict
    speed (AVX512-BF16 without AMX is 4x fp32 on one CPU and slower than fp32 on another), so on CPUs half precision
    is chosen only by measurement: ``training.autocast: auto`` resolves through
    ``compat_core.hardware.workloads.autocast_choice`` with the model and a batch at hand; this function serves the
    unresolved case (no model to measure).
    """
    device = torch.device(device)
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        if major >= 8:
            return torch.bfloat16
        if major >= 7:
            return torch.float16
    return None


def fast_matmul_dtype(device: torch.device | str) -> torch.dtype | None:
    """The half dtype with fast, fp32-accumulating matrix products on ``device``, preferring fp16; None if neither.

    fp16 keeps 11 significant bits against bf16's 8, so its rounding error bound is 8x smaller and a retrieval
    kernel that re-checks candidates against that bound re-scores fewer of them. CPU: fp16 only with AMX-FP16
    (other CPUs run fp16 products far slower than fp32), bf16 with AMX or AVX-512-BF16. CUDA: fp16 from compute
    capability 7.0.
    """
    device = torch.device(device)
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        return torch.float16 if major >= 7 else None
    if device.type != "cpu":
        return None
    if cpu_has_amx_fp16():
        return torch.float16
    if cpu_has_amx() or cpu_has_avx512_bf16():
        return torch.bfloat16
    return None


def autocast_dtype(device: torch.device | str) -> torch.dtype | None:
    """dtype for ``torch.autocast`` during training/extraction on ``device`` (None: run in fp32)."""
    return fast_half_dtype(device)

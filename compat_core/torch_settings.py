"""Sections of code that hold a torch setting and restore the caller's: fp32 products in full fp32 (process-wide
setting, shared by concurrent sections) and one intra-op thread (per calling thread)."""
from __future__ import annotations

import contextlib
import threading

import torch

_ONE_THREAD = threading.local()   # per Python thread: depth of nested sections and the setting to restore


_FP32_LOCK = threading.Lock()
_FP32_STATE = {"depth": 0, "saved": "highest"}   # kernels running in this process, and the setting to restore


@contextlib.contextmanager
def ieee_fp32():
    """fp32 products in full fp32 for the kernel's duration: every fp32 bound (gamma_D u32) assumes it, and
    ``torch.set_float32_matmul_precision("high" / "medium")``, common in training scripts, lets fp32 products use
    TF32 on CUDA or bf16 passes on CPUs with AMX, ~2^-11 relative, far outside the bounds. The setting is
    process-wide, so kernels running at once in several threads share one section: the first sets "highest", the
    last restores the caller's setting."""
    with _FP32_LOCK:
        if _FP32_STATE["depth"] == 0:
            _FP32_STATE["saved"] = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision("highest")
        _FP32_STATE["depth"] += 1
    try:
        yield
    finally:
        with _FP32_LOCK:
            _FP32_STATE["depth"] -= 1
            if _FP32_STATE["depth"] == 0:
                torch.set_float32_matmul_precision(_FP32_STATE["saved"])


@contextlib.contextmanager
def one_thread():
    """Run many small operations on one thread: below ~1 ms per operation the thread pool's hand-offs cost more
    than they save, and on a loaded machine each waits for a descheduled worker (measured: a 32 x 32 eigh 0.07 ms
    on one thread, 50 ms on two at load 3 on 2 cores). CPU only; the previous setting is restored.

    torch's thread count belongs to the calling thread (``set_num_threads`` in one Python thread leaves another
    running thread's count as it was), so each thread sets and restores its own, and nested sections of one
    thread restore only when the outermost one leaves."""
    state = _ONE_THREAD
    depth = getattr(state, "depth", 0)
    if depth == 0:
        state.saved = torch.get_num_threads()
        torch.set_num_threads(1)
    state.depth = depth + 1
    try:
        yield
    finally:
        state.depth -= 1
        if state.depth == 0:
            torch.set_num_threads(state.saved)

"""Sections of code that hold a torch setting and restore the caller's: fp32 products in full fp32 (process-wide
setting, shared by concurrent sections) and one intra-op thread (per calling thread)."""
from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

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


def chunk_workers(device: torch.device) -> int:
    """Worker threads ``run_chunks`` uses on ``device``: the caller's torch thread count on CPU, else 1."""
    return torch.get_num_threads() if torch.device(device).type == "cpu" else 1


def even_chunks(start: int, stop: int, count: int) -> list[tuple[int, int]]:
    """Bounds of the rows start..stop-1 in ``count`` chunks whose sizes differ by at most one row."""
    rows = stop - start
    return [(start + rows * i // count, start + rows * (i + 1) // count) for i in range(count)]


def balanced_chunks(start: int, stop: int, chunk: int, device: torch.device) -> list[tuple[int, int]]:
    """Bounds of the rows start..stop-1 in chunks of at most ``chunk`` rows and of (nearly) equal size, their
    count a multiple of the workers ``run_chunks`` will use: chunks of ``chunk`` rows with a short remainder left
    one worker alone with the last chunk (9 chunks on 2 workers: 5 against 4, 10 % of the search idle)."""
    rows = stop - start
    if rows <= 0:
        return []
    workers = chunk_workers(device)
    count = -(-rows // chunk)
    if workers > 1:
        count = min(rows, -(-count // workers) * workers)
    return even_chunks(start, stop, count)


def run_chunks(work: Callable[[int, int], object], chunks: Sequence[tuple[int, int]], device: torch.device) -> None:
    """Run ``work(start, stop)`` for every chunk: on CPU with more than one torch thread, as independent chunks on
    that many worker threads with one intra-op thread each; else in order on the calling thread.

    Why: an intra-op parallel operation ends at a barrier where every thread waits for the slowest. On a busy
    machine a worker is often descheduled for a whole time slice, so a search made of many short parallel
    operations (products, selections, re-scoring) waits a slice at many of its barriers, and slowed down far more
    than one long product does. Independent chunks have no barrier between them: a descheduled worker delays
    only its own chunk while the other takes the next ones. The worker count is the caller's torch thread count
    (the stage's CPU allocation: Ray and ``OMP_NUM_THREADS`` set it), never more. Each worker runs in inference
    mode (thread-local in torch) with one intra-op thread (``one_thread``)."""
    threads = chunk_workers(device)
    if threads <= 1 or len(chunks) <= 1:
        for start, stop in chunks:
            work(start, stop)
        return

    def in_worker(bounds: tuple[int, int]) -> None:
        with torch.inference_mode(), one_thread():
            work(*bounds)

    with ThreadPoolExecutor(max_workers=min(threads, len(chunks)), thread_name_prefix="compat-chunk") as pool:
        for _ in pool.map(in_worker, chunks):      # re-raises a worker's exception here
            pass

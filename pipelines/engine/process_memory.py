"""This process's host memory: resident bytes now and at their peak (Linux ``/proc/self/status``), the peak reset so
that it covers one stage, large blocks kept out of the C heap, and freed heap handed back to the OS between stages.

Why: glibc serves a block from its heap once a freed block of that size was larger than its (dynamic) mmap
threshold, which the first freed tensor raises up to 32 MB. Tensors of a training step at K = 22,000 are 28 MB
each (batch 320 x 22,000 fp32), so after the first step they all come from the heap, whose free space is kept
resident and fragments: a fine-tuning stage peaked ~250 MB higher and ended ~550 MB higher than with a fixed
threshold, and a reused process started its next stage on that high-water mark. The threshold is fixed at 1 MiB:
in the CelebA rehearsal (4 tasks, K = 22,000) a replacement stage peaked at 1.8 GB with it and at 2.1 GB with a
16 MiB threshold, at the same compute time per image. The price is paid by steps made of many 1-16 MiB tensors and
little compute each (a 768-2048-768 MLP at batch 512: 27-31 % more CPU time), whose pages fault in on every use.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import re
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_bytes(field: str) -> int | None:
    """A ``kB`` field of /proc/self/status in bytes (None where there is no procfs)."""
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def resident_bytes() -> int | None:
    """Resident set size now (VmRSS), bytes; None off Linux."""
    return _status_bytes("VmRSS")


def peak_resident_bytes() -> int | None:
    """Peak resident set size (VmHWM) since the process started or :func:`reset_peak`, bytes; None off Linux."""
    return _status_bytes("VmHWM")


def reset_peak() -> bool:
    """Restart the peak (VmHWM) from the current resident size (Linux >= 4.0: ``5`` into clear_refs); False where
    the kernel does not offer it (the peak then covers the process's whole life)."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


_LIBC = _libc()
_TRIM = getattr(_LIBC, "malloc_trim", None)
_MALLOPT = getattr(_LIBC, "mallopt", None)
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES = 1 << 20  # blocks from 1 MiB up are mapped on their own and unmapped when freed
COLLECT_GROWTH_BYTES = 256 << 20  # a full garbage collection only after the resident size grew this much
_resident_after_release: int | None = None


def limit_heap_caching() -> bool:
    """Serve every block of ``MMAP_THRESHOLD_BYTES`` or more by its own mapping, returned to the OS when freed (a
    fixed threshold also stops glibc from raising it); True when set (glibc), False elsewhere. Processes forked
    afterwards (input workers) inherit it."""
    return bool(_MALLOPT is not None and _MALLOPT(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def release_freed_memory() -> None:
    """Return the C heap's free pages to the OS (glibc ``malloc_trim``), after a full collection of unreachable
    Python objects when the resident size grew by ``COLLECT_GROWTH_BYTES`` or more since the last call (or on the
    first call, or off Linux). Call between stages, after the stage's objects are dropped.

    Why the gate: a full collection scans every object of the process, 0.2-1 s where torch, Ray and MLflow are
    imported, which is more than a small stage takes; it can only give back memory that the process gained."""
    global _resident_after_release
    now = resident_bytes()
    if now is None or _resident_after_release is None or now - _resident_after_release >= COLLECT_GROWTH_BYTES:
        gc.collect()
    if _TRIM is not None:
        _TRIM(0)
    _resident_after_release = resident_bytes()


__all__ = ["limit_heap_caching", "peak_resident_bytes", "release_freed_memory", "reset_peak", "resident_bytes"]

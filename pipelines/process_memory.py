"""This process's host memory: resident bytes now and at their peak (Linux ``/proc/self/status``), the peak reset so
that it covers one stage, large blocks kept out of the C heap, and freed heap handed back to the OS between stages.

Why: glibc serves a block from its heap once a freed block of that size was larger than its (dynamic) mmap
threshold, which the first freed tensor raises up to 32 MB. Tensors of a training step at K = 22,000 are 28 MB
each (batch 320 x 22,000 fp32), so after the first step they all come from the heap, whose free space is kept
resident and fragments: a fine-tuning stage peaked ~250 MB higher and ended ~550 MB higher than with a fixed 1 MiB
threshold, and a reused process started its next stage on that high-water mark.
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


def limit_heap_caching() -> bool:
    """Serve every block of ``MMAP_THRESHOLD_BYTES`` or more by its own mapping, returned to the OS when freed (a
    fixed threshold also stops glibc from raising it); True when set (glibc), False elsewhere. Processes forked
    afterwards (input workers) inherit it."""
    return bool(_MALLOPT is not None and _MALLOPT(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def release_freed_memory() -> None:
    """Collect unreachable Python objects, then return the C heap's free pages to the OS (glibc ``malloc_trim``;
    elsewhere only the collection). Call between stages, after the stage's objects are dropped."""
    gc.collect()
    if _TRIM is not None:
        _TRIM(0)


__all__ = ["limit_heap_caching", "peak_resident_bytes", "release_freed_memory", "reset_peak", "resident_bytes"]

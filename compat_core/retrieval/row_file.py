"""A gallery's fp16 rows in a local file, memory-mapped read-only: the rows the exact re-rank reads when the
structure in memory holds only lossy codes (IVF-PQ). A search reads the rows of its candidates and nothing else,
so what a process holds of the gallery's vectors is the codes, one fp64 inverse norm a row, and the file pages
its queries touched (clean page-cache pages the kernel may reclaim; :meth:`RowFile.drop_cache` returns them).

The file is the rows alone, row-major little-endian fp16 (2 D bytes a row, no header): its size and width are
given by whoever opened it (an index manifest, or the caller that wrote it).
"""
from __future__ import annotations

import mmap
import os

import numpy as np

__all__ = ["RowFile", "write_row_file"]


def write_row_file(path: str, rows) -> "RowFile":
    """Write ``rows`` (N, D), converted to fp16, to the local file ``path`` (replaced atomically); returns it
    opened. Rows not representable in fp16 are rounded: the file is the gallery as stored."""
    array = np.ascontiguousarray(np.asarray(rows, dtype=np.float16))
    if array.ndim != 2 or array.shape[0] == 0:
        raise ValueError(f"rows: expected a non-empty (N, D) array, got shape {array.shape}")
    temporary = f"{path}.part"
    with open(temporary, "wb") as sink:
        array.astype("<f2", copy=False).tofile(sink)
        sink.flush()
        os.fsync(sink.fileno())
    os.replace(temporary, path)
    return RowFile(path, array.shape[0], array.shape[1])


class RowFile:
    """Rows 0..size-1 of width ``dim`` in the fp16 file ``path`` (ValueError naming it when its length is not
    size x dim x 2 bytes), mapped read-only with random access advised (no read-ahead beyond the rows read)."""

    def __init__(self, path: str, size: int, dim: int) -> None:
        self.path, self.size, self.dim = str(path), int(size), int(dim)
        expected = self.size * self.dim * 2
        actual = os.path.getsize(self.path)
        if actual != expected:
            raise ValueError(f"{self.path}: {actual} bytes, expected {expected} ({self.size} fp16 rows of width "
                             f"{self.dim})")
        with open(self.path, "rb") as source:
            self._map = mmap.mmap(source.fileno(), expected, access=mmap.ACCESS_READ)
        if hasattr(mmap, "MADV_RANDOM"):
            self._map.madvise(mmap.MADV_RANDOM)
        self._rows = np.frombuffer(self._map, dtype="<f2").reshape(self.size, self.dim)

    @property
    def nbytes(self) -> int:
        """Bytes of the file (2 D a row)."""
        return self.size * self.dim * 2

    def rows_of(self, rows: np.ndarray) -> np.ndarray:
        """(n, D) float32: the rows ``rows`` (int64 row numbers), read from the file (only their pages)."""
        return self._rows[np.asarray(rows, dtype=np.int64)].astype(np.float32)

    def stored_rows(self, start: int, stop: int) -> np.ndarray:
        """(stop - start, D) float32: rows start..stop-1."""
        return self._rows[int(start):int(stop)].astype(np.float32)

    def drop_cache(self) -> None:
        """Unmap the pages this process touched and ask the kernel to drop the file's clean pages from its cache,
        so that the next reads come from the device (a cold start; what a process holds of the file is then what
        later queries touch)."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)
        if hasattr(os, "posix_fadvise"):
            descriptor = os.open(self.path, os.O_RDONLY)
            try:
                os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(descriptor)

    def resident_bytes(self) -> int | None:
        """Bytes of the file's pages mapped resident in this process (Linux ``/proc/self/smaps`` Rss of the
        mapping); None where the system does not say."""
        start = np.frombuffer(self._map, dtype=np.uint8).ctypes.data
        try:
            with open("/proc/self/smaps") as smaps:
                inside = False
                for line in smaps:
                    head = line.split(" ", 1)[0]
                    if "-" in head and ":" not in head:
                        low, high = (int(x, 16) for x in head.split("-"))
                        inside = low <= start < high
                    elif inside and line.startswith("Rss:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

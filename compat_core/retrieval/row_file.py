"""A gallery's fp16 rows in a local file, read with positioned reads: the rows the exact re-rank reads when the
structure in memory holds only lossy codes (IVF-PQ). A search reads the rows of its candidates (one ``pread`` a
distinct row into a buffer of the call's rows) and nothing else; nothing of the file is mapped. What a process
holds of the gallery's vectors is therefore the codes and one fp64 inverse norm a row, plus, during one search,
its candidates' rows: bounded whatever the number of queries answered.

The kernel's page cache may keep the whole file warm (a warm read costs a copy, not a device read): that is not
the process's memory, and the kernel reclaims it under pressure (in a cgroup v2 container it is charged to the
container but reclaimed before an OOM kill), reads then falling toward the cost of a cold cache
(:meth:`RowFile.drop_cache`). A memory mapping was measured against these reads (benchmarks/row_file_reads.py):
released after every read it is faster warm, but while a read runs the kernel maps whole cached folios around
each faulting row, up to the whole file.

The file is the rows alone, row-major little-endian fp16 (2 D bytes a row, no header): its size and width are
given by whoever opened it (an index manifest, or the caller that wrote it).
"""
from __future__ import annotations

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
    size x dim x 2 bytes), opened read-only with random access advised (no read-ahead beyond the rows read)."""

    def __init__(self, path: str, size: int, dim: int) -> None:
        self.path, self.size, self.dim = str(path), int(size), int(dim)
        expected = self.size * self.dim * 2
        actual = os.path.getsize(self.path)
        if actual != expected:
            raise ValueError(f"{self.path}: {actual} bytes, expected {expected} ({self.size} fp16 rows of width "
                             f"{self.dim})")
        self._descriptor = os.open(self.path, os.O_RDONLY)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._descriptor, 0, 0, os.POSIX_FADV_RANDOM)

    def __del__(self) -> None:
        descriptor = getattr(self, "_descriptor", None)
        if descriptor is not None:
            os.close(descriptor)

    @property
    def nbytes(self) -> int:
        """Bytes of the file (2 D a row)."""
        return self.size * self.dim * 2

    def rows_of(self, rows: np.ndarray) -> np.ndarray:
        """(n, D) float32: the rows ``rows`` (int64 row numbers), each distinct row read once from the file."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= self.size):
            raise ValueError(f"{self.path}: rows outside 0..{self.size - 1}")
        distinct, where = np.unique(rows, return_inverse=True)
        width = self.dim * 2
        buffer = np.empty((distinct.size, self.dim), dtype="<f2")
        view = memoryview(buffer).cast("B")
        for slot, row in enumerate(distinct.tolist()):
            self._read_into(view[slot * width:(slot + 1) * width], row * width)
        return buffer.astype(np.float32)[where.reshape(-1)]

    def stored_rows(self, start: int, stop: int) -> np.ndarray:
        """(stop - start, D) float32: rows start..stop-1 (one read)."""
        start, stop = int(start), int(stop)
        buffer = np.empty((max(0, stop - start), self.dim), dtype="<f2")
        if buffer.size:
            self._read_into(memoryview(buffer).cast("B"), start * self.dim * 2)
        return buffer.astype(np.float32)

    def _read_into(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            count = os.preadv(self._descriptor, [view[done:]], offset + done)
            if count <= 0:
                raise OSError(f"{self.path}: ended at byte {offset + done}, expected {self.nbytes} bytes "
                              "(the file changed after it was opened)")
            done += count

    def drop_cache(self) -> None:
        """Ask the kernel to drop the file's clean pages from its cache, so that the next reads come from the
        device (a cold start)."""
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._descriptor, 0, 0, os.POSIX_FADV_DONTNEED)

    def mapped_bytes(self) -> int | None:
        """Bytes of this file mapped resident in this process, over every mapping of it (Linux
        ``/proc/self/smaps`` Rss; 0 when none: reads map nothing); None where the system does not say."""
        real, total = os.path.realpath(self.path), 0
        try:
            with open("/proc/self/smaps") as smaps:
                inside = False
                for line in smaps:
                    fields = line.split()
                    if fields and "-" in fields[0] and ":" not in fields[0]:
                        inside = len(fields) >= 6 and " ".join(fields[5:]) == real
                    elif inside and fields and fields[0] == "Rss:":
                        total += int(fields[1]) * 1024
        except OSError:
            return None
        return total

"""How a replica should read its candidates' rows from an IVF-PQ index's fp16 row file (a script, not a test):
``python benchmarks/row_file_reads.py [--rows 200000] [--dim 512]``.

One file of ``--rows`` random fp16 rows; ``--batches`` batches of ``--batch`` x 128 random rows (a batch of
queries' re-rank candidates), each read four ways, warm (the file in the kernel's page cache) and cold (the
file's pages dropped from the cache before every batch):

- mapped: gathered from a read-only memory mapping that stays mapped (the process keeps what it touched; its
  "cold" line is not cold: the kernel does not drop pages a process maps);
- mapped + release: the same, then ``madvise(MADV_DONTNEED)`` over the whole mapping (the process's pages
  unmapped, the page cache kept);
- mapped + release touched: the same, released page range by page range over the pages the rows lie on;
- pread: one ``os.preadv`` a row into a buffer (the file advised random: no read-ahead); nothing mapped.

Prints milliseconds per batch (median of the batches), the file bytes the process holds mapped at the peak (right
after a batch's read, before any release) and after the last batch, with the CPU and the load average.
"""
from __future__ import annotations

import argparse
import mmap
import os
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from retrieval import cpu_model  # noqa: E402

PAGE = mmap.PAGESIZE


def mapped_rss(base: int) -> int:
    """Bytes of the mapping starting at ``base`` resident in this process (/proc/self/smaps Rss)."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= base < high
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    return 0


def readers(path: str, rows: int, dim: int) -> tuple[dict, callable]:
    """name -> read(row numbers) -> (n, D) float32, and the function returning the mapped bytes held."""
    width = dim * 2
    with open(path, "rb") as source:
        mapping = mmap.mmap(source.fileno(), rows * width, access=mmap.ACCESS_READ)
    mapping.madvise(mmap.MADV_RANDOM)
    array = np.frombuffer(mapping, dtype="<f2").reshape(rows, dim)
    base = np.frombuffer(mapping, dtype=np.uint8).ctypes.data
    descriptor = os.open(path, os.O_RDONLY)
    os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_RANDOM)
    peak = {"bytes": 0}

    def gathered(numbers):
        out = array[numbers].astype(np.float32)
        peak["now"] = numbers
        return out

    def release_touched(numbers):
        pages = np.unique(np.concatenate([numbers * width // PAGE, ((numbers + 1) * width - 1) // PAGE]))
        breaks = np.flatnonzero(np.diff(pages) != 1)
        for first, last in zip(pages[np.r_[0, breaks + 1]].tolist(), pages[np.r_[breaks, pages.size - 1]].tolist()):
            mapping.madvise(mmap.MADV_DONTNEED, first * PAGE, (last - first + 1) * PAGE)

    def pread(numbers):
        out = np.empty((numbers.size, dim), dtype="<f2")
        view = memoryview(out).cast("B")
        for i, row in enumerate(numbers.tolist()):
            os.preadv(descriptor, [view[i * width:(i + 1) * width]], row * width)
        return out.astype(np.float32)

    ways = {"mapped": (gathered, None),
            "mapped + release": (gathered, lambda numbers: mapping.madvise(mmap.MADV_DONTNEED)),
            "mapped + release touched": (gathered, release_touched),
            "pread": (pread, None)}
    return ways, (lambda: mapped_rss(base)), (lambda: mapping.madvise(mmap.MADV_DONTNEED))


def drop_page_cache(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16, help="queries a batch (128 candidate rows each)")
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--row-dir", default=tempfile.gettempdir())
    args = parser.parse_args(argv)
    print(f"CPU: {cpu_model()}; load average before: {os.getloadavg()}")
    path = os.path.join(args.row_dir, f"row-file-reads-{os.getpid()}.f16")
    np.random.default_rng(0).standard_normal((args.rows, args.dim)).astype("<f2").tofile(path)
    try:
        ways, held, unmap = readers(path, args.rows, args.dim)
        rng = np.random.default_rng(1)
        batches = [rng.integers(0, args.rows, args.batch * 128) for _ in range(args.batches)]
        reference = ways["mapped"][0](batches[0])
        print(f"{args.rows} x {args.dim} fp16 ({args.rows * args.dim * 2 / 2 ** 20:.0f} MiB), batches of "
              f"{args.batch * 128} rows\n{'read':26} {'cache':6} {'ms/batch':>9} {'peak MiB':>9} {'after MiB':>10}")
        for cold in (False, True):
            for name, (read, release) in ways.items():
                unmap()
                if not cold:
                    with open(path, "rb") as source:
                        while source.read(1 << 24):
                            pass
                if not np.array_equal(read(batches[0]), reference):
                    raise RuntimeError(f"{name}: rows differ from the mapping's")
                unmap()
                seconds, peak = [], 0
                for numbers in batches:
                    if cold:
                        drop_page_cache(path)
                    started = time.perf_counter()
                    read(numbers)
                    middle = time.perf_counter()
                    peak = max(peak, held())
                    resumed = time.perf_counter()
                    if release is not None:
                        release(numbers)
                    seconds.append(middle - started + time.perf_counter() - resumed)
                print(f"{name:26} {'cold' if cold else 'warm':6} {statistics.median(seconds) * 1e3:9.2f} "
                      f"{peak / 2 ** 20:9.2f} {held() / 2 ** 20:10.2f}", flush=True)
    finally:
        os.remove(path)
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

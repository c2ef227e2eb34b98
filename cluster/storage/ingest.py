"""`compat ingest`: one registered dataset split -> Parquet parts + manifest (format in
:mod:`compat_core.data.formats.shards`), on a local folder or ``s3://``.

Parts are written in parallel as Ray tasks (one task per part, each opening the dataset itself) or in this
process (``workers=0``). The ingest is resumable per part: a part whose record is committed and whose file still
matches it (size and sha256) is kept; the manifest is written last, so a split exists only when every part does.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable

import numpy as np

from cluster.ray.task_backend import connect
from compat_core import io as cio
from compat_core.data.datasets import load_dataset
from compat_core.data.formats import shards as fmt

DEFAULT_PART_BYTES = 256 * 1024 * 1024  # a part = a few row groups of tens of MB


def plan_parts(num_rows: int, rows_per_part: int) -> list[tuple[int, int]]:
    """[start, stop) row ranges of the parts of a split of ``num_rows`` rows."""
    if rows_per_part < 1:
        raise ValueError(f"rows_per_part must be >= 1, got {rows_per_part}")
    return [(start, min(start + rows_per_part, num_rows)) for start in range(0, num_rows, rows_per_part)]


def estimate_rows_per_part(source, part_bytes: int) -> int:
    """Rows per part so that a part holds about ``part_bytes`` bytes (from the stored size of up to 16 samples)."""
    sample = fmt.rows_table(source, 0, min(len(source), 16))
    per_row = max(1, sample.column("image").nbytes // max(sample.num_rows, 1))
    return max(1, int(part_bytes // per_row))


def _write_one(dataset: str, root: str | None, split: str, options: dict, folder: str, number: int, start: int,
               stop: int, row_group_bytes: int, setup: Callable[[], None] | None = None) -> dict:
    if setup is not None:
        setup()
    existing = fmt.committed_part(folder, number, start, stop - start)
    if existing is not None:
        return {"record": existing.__dict__, "resumed": True}
    source = load_dataset(dataset, root=root, split=split, **options)
    record = fmt.write_part(folder, number, fmt.rows_table(source, start, stop), row_group_bytes)
    return {"record": record.__dict__, "resumed": False}


def ingest(dataset: str, root: str | None, split: str, out: str, *, options: dict[str, Any] | None = None,
           rows_per_part: int | None = None, part_bytes: int = DEFAULT_PART_BYTES,
           row_group_bytes: int = fmt.DEFAULT_ROW_GROUP_BYTES, workers: int = 0,
           setup: Callable[[], None] | None = None, progress: Callable[[str], None] | None = print) -> fmt.DatasetManifest:
    """Ingest ``dataset``/``split`` (read from ``root``) into ``out``/``split``; returns the committed manifest.

    workers: 0 writes the parts in this process; N >= 1 runs them as Ray tasks (at most N at a time) on the
    connected (or an embedded local) Ray instance. setup: callable run in each task first (register datasets that
    live outside the package). progress: receives one line per finished part (rows/s, ETA).
    """
    options = dict(options or {})
    source = load_dataset(dataset, root=root, split=split, **options)
    if len(source) == 0:
        raise ValueError(f"ingest: {dataset}/{split} has no samples")
    rows_per_part = rows_per_part or estimate_rows_per_part(source, part_bytes)
    parts = plan_parts(len(source), rows_per_part)
    folder = fmt.split_root(out, split)
    started = time.perf_counter()
    records: dict[int, fmt.PartRecord] = {}
    resumed = 0

    def finished(number: int, result: dict) -> None:
        nonlocal resumed
        records[number] = fmt.PartRecord(**result["record"])
        resumed += int(result["resumed"])
        if progress is not None:
            done_rows = sum(r.rows for r in records.values())
            elapsed = time.perf_counter() - started
            rate = done_rows / max(elapsed, 1e-9)
            eta = (len(source) - done_rows) / max(rate, 1e-9)
            progress(f"ingest {dataset}/{split}: part {len(records)}/{len(parts)} "
                     f"({'kept' if result['resumed'] else 'written'}), {done_rows}/{len(source)} rows, "
                     f"{rate:.0f} rows/s, ETA {eta:.0f} s")

    arguments = [(dataset, root, split, options, folder, number, start, stop, row_group_bytes, setup)
                 for number, (start, stop) in enumerate(parts)]
    if workers <= 0:
        for number, args in enumerate(arguments):
            finished(number, _write_one(*args))
    else:
        import ray

        owns = connect()
        try:
            task = ray.remote(num_cpus=1, max_retries=2)(_write_one)
            pending: dict[Any, int] = {}
            queue = list(enumerate(arguments))
            while queue or pending:
                while queue and len(pending) < workers:
                    number, args = queue.pop(0)
                    pending[task.remote(*args)] = number
                ready, _ = ray.wait(list(pending), num_returns=1)
                finished(pending.pop(ready[0]), ray.get(ready[0]))
        finally:
            if owns:
                ray.shutdown()
    ordered = tuple(records[number] for number in range(len(parts)))
    manifest = fmt.DatasetManifest(
        source={"dataset": dataset, "root": None if root is None else str(root), "split": split, "options": options},
        encoding=fmt.source_encoding(source),
        image_shape=tuple(int(v) for v in source.image_shape),
        rows=len(source),
        class_names=list(source.class_names),
        mean=tuple(float(v) for v in source.mean),
        std=tuple(float(v) for v in source.std),
        hflip=bool(source.hflip),
        parts=ordered,
        coarse_labels=None if source.coarse_labels is None else np.asarray(source.coarse_labels).tolist(),
    )
    fmt.write_manifest(folder, manifest)
    if progress is not None:
        size = sum(r.size for r in ordered)
        progress(f"ingest {dataset}/{split}: committed {cio.join(folder, fmt.MANIFEST_NAME)} "
                 f"({len(ordered)} parts, {resumed} kept from a previous run, {size / 2**20:.1f} MiB, "
                 f"{math.ceil(time.perf_counter() - started)} s)")
    return manifest


__all__ = ["DEFAULT_PART_BYTES", "estimate_rows_per_part", "ingest", "plan_parts"]

"""Row ranges of a gallery split into shards, and the exact merge of the shards' top-k answers.

A gallery of N rows split into S shards by row range gives shard s the rows ``offset_s .. offset_s + rows_s - 1``
(:func:`shard_ranges`: near-equal, in order). Each shard answers a query with its own exact top-k in its local row
numbers (score descending, lowest local row on ties). The global top-k is contained in the union of the shards'
top-k, and ordering that union by (score descending, global row ascending) gives exactly the unsharded exact
search's answer, ties included (:func:`merge_shard_topk`): a local row order within a shard is the global order
shifted by the shard's offset.
"""
from __future__ import annotations

import numpy as np

__all__ = ["shard_ranges", "merge_shard_topk"]


def shard_ranges(count: int, shards: int) -> list[tuple[int, int]]:
    """(start, stop) row ranges of ``count`` rows split into ``shards`` near-equal contiguous parts (the first
    ``count % shards`` one row longer). ValueError when a shard would be empty."""
    if shards < 1:
        raise ValueError(f"shards: expected a positive number of shards, got {shards}")
    if count < shards:
        raise ValueError(f"shards: {shards} shards of a {count}-row gallery would leave a shard empty; use at most "
                         f"{count}")
    base, extra = divmod(int(count), int(shards))
    ranges, start = [], 0
    for number in range(shards):
        stop = start + base + (1 if number < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


def merge_shard_topk(answers, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The exact top-k over every shard's top-k answer to one query.

    answers: one (offset, local rows, scores) per shard (rows (n_s,) ints, scores (n_s,) floats, a shard's own
    top-min(k, rows_s) answer). Returns (global rows, scores, shard numbers, local rows), each of length
    min(k, total), ordered by score descending then global row ascending."""
    if k < 1:
        raise ValueError(f"k: expected a positive number of results, got {k}")
    rows, scores, shards, local = [], [], [], []
    for number, (offset, positions, values) in enumerate(answers):
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        values = np.asarray(values, dtype=np.float64).reshape(-1)
        if positions.shape != values.shape:
            raise ValueError(f"shard {number}: {positions.size} rows but {values.size} scores")
        rows.append(positions + int(offset))
        scores.append(values)
        shards.append(np.full(positions.size, number, dtype=np.int64))
        local.append(positions)
    rows, scores = np.concatenate(rows), np.concatenate(scores)
    shards, local = np.concatenate(shards), np.concatenate(local)
    if np.unique(rows).size != rows.size:
        raise ValueError("shard answers: a global row appears twice (overlapping shard offsets?)")
    order = np.lexsort((rows, -scores))[:k]
    return rows[order], scores[order], shards[order], local[order]

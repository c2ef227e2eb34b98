"""Shards by row range and the exact merge of their top-k: equal to fp64 brute force over the whole gallery, ties
(duplicate rows in different shards) broken by the lowest global row."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from compat_core.retrieval.search import PreparedGallery, search_prepared
from compat_core.retrieval.shard_merge import merge_shard_topk, shard_ranges


def _brute(query: np.ndarray, gallery: np.ndarray, k: int):
    g = gallery.astype(np.float64) / np.linalg.norm(gallery.astype(np.float64), axis=1, keepdims=True)
    q = query.astype(np.float64) / np.linalg.norm(query.astype(np.float64))
    scores = g @ q
    order = np.lexsort((np.arange(g.shape[0]), -scores))[:k]
    return order, scores[order]


def test_ranges_tile_the_gallery_in_order():
    assert shard_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert shard_ranges(8, 8) == [(i, i + 1) for i in range(8)]
    with pytest.raises(ValueError, match="leave a shard empty"):
        shard_ranges(3, 4)
    with pytest.raises(ValueError, match="positive"):
        shard_ranges(3, 0)


@pytest.mark.parametrize("shards", [1, 3, 8])
def test_merged_shard_answers_equal_fp64_brute_force_with_ties(shards):
    rng = np.random.default_rng(shards)
    gallery = rng.standard_normal((203, 16)).astype(np.float32)
    gallery[150] = gallery[7]            # exact duplicates in different shards: a tie on every query
    gallery[190] = gallery[7] * 3.0      # same direction, another norm: the same cosine
    queries = rng.standard_normal((40, 16)).astype(np.float32)
    queries[:5] = gallery[7] + 1e-3 * queries[:5]   # queries whose nearest rows are the tied ones
    k = 6
    parts = [(start, PreparedGallery(torch.from_numpy(gallery[start:stop])))
             for start, stop in shard_ranges(gallery.shape[0], shards)]
    for query in queries:
        answers = []
        for offset, prepared in parts:
            rows, scores = search_prepared(torch.from_numpy(query[None]), prepared, min(k, prepared.size))
            answers.append((offset, rows[0].numpy(), scores[0].numpy()))
        rows, scores, shard, local = merge_shard_topk(answers, k)
        expected_rows, expected_scores = _brute(query, gallery, k)
        np.testing.assert_array_equal(rows, expected_rows)
        np.testing.assert_allclose(scores, expected_scores, rtol=0, atol=1e-12)
        np.testing.assert_array_equal(rows, np.array([parts[s][0] for s in shard]) + local)
    top = merge_shard_topk(answers, 3)[0]
    assert top.size == 3


def test_tied_rows_keep_the_lowest_global_row():
    answers = [(0, [1, 0], [0.5, 0.25]), (10, [0, 2], [0.5, 0.5]), (20, [3], [0.9])]
    rows, scores, shard, local = merge_shard_topk(answers, 4)
    assert rows.tolist() == [23, 1, 10, 12] and scores.tolist() == [0.9, 0.5, 0.5, 0.5]
    assert shard.tolist() == [2, 0, 1, 1] and local.tolist() == [3, 1, 0, 2]
    with pytest.raises(ValueError, match="appears twice"):
        merge_shard_topk([(0, [5], [0.1]), (3, [2], [0.2])], 1)

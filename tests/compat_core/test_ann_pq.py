"""IVF-PQ's code size chosen by the recall target: the smallest code of the ladder whose re-ranked top-1 reaches the
target on held-out queries, its recall checked against fp64 brute force."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from compat_core.retrieval.ann import ann_search
from compat_core.retrieval.ann_pq import pq_ladder, tune_pq
from compat_core.retrieval.search import PreparedGallery


def _rows(count: int, seed: int, centres: np.ndarray) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    rows = centres[rng.integers(0, centres.shape[0], count)] + 0.35 * rng.standard_normal((count, centres.shape[1]))
    return torch.nn.functional.normalize(torch.from_numpy(rows.astype(np.float32)), dim=1)


def test_the_ladder_runs_from_the_smallest_code():
    assert pq_ladder(512) == [32, 64, 128]
    assert pq_ladder(9, (3, 1)) == [3, 9]
    with pytest.raises(ValueError, match="divides the width 7"):
        pq_ladder(7)


def test_the_smallest_code_reaching_the_target_is_kept_and_its_recall_is_true():
    centres = np.random.default_rng(0).standard_normal((40, 32)) / 3.0   # close classes: 1-2 byte codes fall short
    gallery, sample, measured_q = _rows(4000, 1, centres), _rows(200, 2, centres), _rows(200, 3, centres)
    prepared = PreparedGallery(gallery)
    ann, measured = tune_pq(gallery, prepared, sample, 1.0, seed=0, ladder=[1, 2, 8])
    curve = measured["pq_curve"]
    assert ann.kind == "ivfpq" and ann.params["pq_m"] == 8 and measured["recall"] == 1.0
    assert [entry[0] for entry in curve] == [1, 2, 8] and [entry[2] for entry in curve] == [None, None, 1.0]
    assert [entry[1] for entry in curve] == [-(-m * ann.params["pq_bits"] // 8) for m, *_ in curve]
    assert ann.index.code_size == curve[-1][1]
    # the recall it reports is the brute-force one on the tuning sample
    scores = sample.double() @ gallery.double().T
    exact = np.lexsort((np.tile(np.arange(4000), (200, 1)), -scores.numpy()), axis=1)[:, 0]
    top1 = ann_search(sample, prepared, ann, 1)[0][:, 0].numpy()
    assert np.mean(top1 == exact) == measured["recall"]
    assert ann_search(measured_q, prepared, ann, 1)[0].shape == (200, 1)
    with pytest.raises(ValueError, match="no IVF-PQ code of \\[1\\] sub-vectors reached it"):
        tune_pq(gallery, prepared, sample, 1.0, seed=0, ladder=[1])

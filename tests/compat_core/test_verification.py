"""compat_core.evaluation.verification on hand-worked examples."""
from __future__ import annotations

import numpy as np
import pytest

from compat_core.evaluation.verification import tar_at_far, verification_accuracy


def test_verification_separable_scores_give_accuracy_one():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((60, 8))
    same = np.arange(60) % 2 == 0
    b = np.where(same[:, None], a + 0.01 * rng.standard_normal((60, 8)), -a)
    mean, std = verification_accuracy(a, b, same)
    assert (mean, std) == (1.0, 0.0)


def test_verification_hand_worked_ten_folds():
    # 20 positives at cosine 0.9 except the first (0.1), 20 negatives at 0.2; fold f = positives 2f, 2f+1 and
    # negatives 2f, 2f+1. Training on the other folds always picks threshold 0.2 (accept > 0.2): fold 0 gets 3/4,
    # the other nine folds 4/4: mean = (0.75 + 9) / 10 = 0.975, std = sqrt((0.225^2 + 9 * 0.025^2) / 10) = 0.075.
    pos = np.full(20, 0.9)
    pos[0] = 0.1
    neg = np.full(20, 0.2)
    scores = np.empty(40)
    scores[0::2], scores[1::2] = pos, neg                 # interleaved input order
    same = np.zeros(40, bool)
    same[0::2] = True
    a = np.tile([1.0, 0.0], (40, 1))
    b = np.stack([scores, np.sqrt(1 - scores ** 2)], axis=1)
    mean, std = verification_accuracy(a, b, same, folds=10)
    assert mean == pytest.approx(0.975)
    assert std == pytest.approx(0.075)


def test_tar_at_far_hand_worked():
    scores = np.array([0.9, 0.8, 0.7, 0.4, 0.85, 0.5, 0.3, 0.2, 0.1])
    same = np.array([1, 1, 1, 1, 0, 0, 0, 0, 0], bool)
    # FAR <= 0.2 allows one of five negatives (0.85): lowest such threshold 0.7 -> TAR 3/4
    assert tar_at_far(scores, same, 0.2) == pytest.approx(0.75)
    assert tar_at_far(scores, same, 0.0) == pytest.approx(0.25)      # threshold 0.9
    assert tar_at_far(scores, same, 1.0) == pytest.approx(1.0)


def test_tar_at_far_ties_are_accepted_together():
    scores = np.array([0.6, 0.5, 0.5, 0.1])
    same = np.array([True, True, False, False])
    assert tar_at_far(scores, same, 0.5) == pytest.approx(1.0)       # threshold 0.5 accepts both 0.5 pairs
    assert tar_at_far(scores, same, 0.49) == pytest.approx(0.5)      # cannot split the tie: threshold 0.6

"""Partial backfilling on a hand-worked 2-image gallery, orders, and the uncertainty predictor vs numpy lstsq."""
import numpy as np
import pytest
import torch

from compat_core.upgrades.backfill_order import backfill_curve, backfill_order, uncertainty_scores

QUERY = np.array([[1.0, 0.0], [0.0, 1.0]])
LABELS = np.array([0, 1])
OLD = np.array([[0.1, 0.9], [0.9, 0.1]])   # both gallery items point at the other class's query
NEW = np.array([[1.0, 0.0], [0.0, 1.0]])


def test_hand_worked_curve():
    # f=0: each query's nearest item has the other label -> R@1 0, AP 1/2 (relevant item at rank 2) for both
    # f=0.5 (item 0 re-embedded): q0 -> item 0 (1 > 0.994), q1 -> item 1 (0.11 > 0) -> R@1 1, mAP 1; f=1: all new
    curve = backfill_curve(QUERY, LABELS, OLD, NEW, LABELS, np.array([0, 1]), fractions=(0.0, 0.5, 1.0))
    assert curve["fraction"] == [0.0, 0.5, 1.0]
    assert curve["recall_at_1"] == [0.0, 1.0, 1.0]
    assert curve["map"] == pytest.approx([0.5, 1.0, 1.0])


def test_orders_and_bad_input():
    assert backfill_order(2, "uncertainty", scores=np.array([0.1, 0.9])).tolist() == [1, 0]
    assert sorted(backfill_order(5, "random", seed=3).tolist()) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="expected one of"):
        backfill_order(2, "oldest")
    with pytest.raises(ValueError, match="permutation"):
        backfill_curve(QUERY, LABELS, OLD, NEW, LABELS, np.array([0, 0]))


def test_uncertainty_predictor_is_the_ridge_least_squares_fit():
    rng = np.random.default_rng(0)
    old = rng.standard_normal((50, 4))
    transformed, new = rng.standard_normal((50, 4)), rng.standard_normal((50, 4))
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    error = np.sum((unit(transformed) - unit(new)) ** 2, axis=1)
    design = np.c_[unit(old), np.ones(50)]
    expected = design @ np.linalg.lstsq(design, error, rcond=None)[0]
    scores = uncertainty_scores(torch.from_numpy(old), torch.from_numpy(transformed), torch.from_numpy(new), ridge=0.0)
    assert np.abs(scores - expected).max() < 1e-5

"""The one adapter-and-backfill workflow of an upgrade (pipelines.stages.adapt.study_upgrade), shared by the adapt
stage and the compatibility gate, on a hand-made upgrade: the new model is the old one rotated, so the Procrustes
adapter undoes it exactly, and every number is checked against an fp64 brute-force Recall@1 written here."""
from __future__ import annotations

import numpy as np
import pytest

from pipelines.stages.adapt import cross_tests, study_upgrade


def _recall_at_1(query: tuple, gallery: tuple, metric: str = "recall_at_1") -> float:
    """fp64 brute force: the fraction of queries whose most cosine-similar gallery item has their label."""
    assert metric == "recall_at_1"
    q = np.asarray(query[0], dtype=np.float64)
    g = np.asarray(gallery[0], dtype=np.float64)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    g /= np.linalg.norm(g, axis=1, keepdims=True)
    nearest = np.argmax(q @ g.T, axis=1)
    return float(np.mean(np.asarray(gallery[1])[nearest] == np.asarray(query[1])))


def _upgrade():
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(4, 8)) * 4.0
    labels_q, labels_g = np.repeat(np.arange(4), 5), np.repeat(np.arange(4), 10)
    old_q = (centres[labels_q] + rng.normal(size=(20, 8))).astype(np.float32)
    old_g = (centres[labels_g] + rng.normal(size=(40, 8))).astype(np.float32)
    rotation, _ = np.linalg.qr(rng.normal(size=(8, 8)))
    new_q, new_g = (old_q @ rotation).astype(np.float32), (old_g @ rotation).astype(np.float32)
    return ((old_q, labels_q, None), (old_g, labels_g, None)), ((new_q, labels_q, None), (new_g, labels_g, None))


def test_study_fits_judges_and_curves_like_brute_force():
    (old_q, old_g), (new_q, new_g) = _upgrade()
    tests = cross_tests(old_q, old_g, new_q, new_g, _recall_at_1, ("recall_at_1",))["recall_at_1"]
    assert tests.self_old == pytest.approx(_recall_at_1(old_q, old_g))
    assert tests.self_new == pytest.approx(_recall_at_1(new_q, new_g)) == pytest.approx(tests.self_old)
    assert tests.cross == pytest.approx(_recall_at_1(new_q, old_g)) and tests.cross < tests.self_old

    seen = []
    study = study_upgrade(old_g, new_q, new_g, _recall_at_1, "recall_at_1", tests.self_old, strict=True,
                          kinds=("procrustes",), metrics=("recall_at_1",), seed=3,
                          orders=("random", "uncertainty"),
                          on_adapter=lambda index, kind, outcome, seconds: seen.append((index, kind)),
                          on_curve=lambda index, order: seen.append((index, order)))
    assert seen == [(0, "procrustes"), (0, "random"), (1, "uncertainty")]
    outcome = study.adapters["procrustes"]
    # the rotation is undone: new queries mapped back search the old gallery exactly as old queries do
    expected = _recall_at_1((outcome.query[0], new_q[1], None), old_g)
    assert outcome.cross["recall_at_1"] == pytest.approx(expected) == pytest.approx(tests.self_old)
    # equal is not better: the strict criterion refuses, the non-strict one accepts
    assert outcome.verdict["compatible"] is False
    loose = study_upgrade(old_g, new_q, new_g, _recall_at_1, "recall_at_1", tests.self_old, strict=False,
                          kinds=("procrustes",), metrics=("recall_at_1",), orders=())
    assert loose.adapters["procrustes"].verdict["compatible"] is True and loose.curves == {}
    assert study.start == "old features"  # a query adapter leaves the gallery as it is
    for order in ("random", "uncertainty"):
        curve = study.curves[order]
        assert curve["fraction"][0] == 0.0 and curve["fraction"][-1] == 1.0
        assert curve["recall_at_1"][0] == pytest.approx(tests.cross)      # nothing re-embedded
        assert curve["recall_at_1"][-1] == pytest.approx(tests.self_new)  # everything re-embedded

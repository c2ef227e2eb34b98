"""1:1 verification metrics (SPEC §5): accuracy by k-fold threshold selection (LFW style) and TAR at a given FAR,
on cosine similarities of pairs of features."""
from __future__ import annotations

import numpy as np

from compat_core.retrieval.search import _as_labels, _as_matrix
from compat_core.retrieval.space import _inverse_norms


def _pair_cosines(feats_a, feats_b) -> np.ndarray:
    a = _as_matrix("feats_a", feats_a).double().cpu()
    b = _as_matrix("feats_b", feats_b).double().cpu()
    if a.shape != b.shape:
        raise ValueError(f"feats_a/feats_b: expected equal shapes, got {tuple(a.shape)} and {tuple(b.shape)}")
    a = a * _inverse_norms("feats_a", a)[:, None]
    b = b * _inverse_norms("feats_b", b)[:, None]
    return (a * b).sum(dim=1).numpy()


def _best_threshold(scores: np.ndarray, same: np.ndarray) -> float:
    """Threshold maximising accuracy of 'same iff score > threshold' among -inf and the midpoints between
    adjacent distinct scores; among equally good ones the midpoint of the widest gap (the largest margin to the
    training scores on either side, first on ties), so that a separable training set is split in the middle."""
    values = np.unique(scores)
    candidates = np.concatenate([[-np.inf], (values[:-1] + values[1:]) / 2, [values[-1]]])
    positive = np.sort(scores[same])
    negative = np.sort(scores[~same])
    true_accepts = len(positive) - np.searchsorted(positive, candidates, side="right")
    true_rejects = np.searchsorted(negative, candidates, side="right")
    accuracy = (true_accepts + true_rejects) / len(scores)
    gaps = np.concatenate([[0.0], np.diff(values), [0.0]])
    best = np.flatnonzero(accuracy == accuracy.max())
    return float(candidates[best[int(np.argmax(gaps[best]))]])


def verification_accuracy(feats_a, feats_b, same, folds: int = 10) -> tuple[float, float]:
    """1:1 verification accuracy (fraction) by k-fold threshold selection, LFW style.

    feats_a, feats_b (n, D): the two sides of each pair; same (n,) bool. A pair is called "same" when its cosine
    similarity is > the threshold. Folds are stratified and contiguous: positives and negatives are each split in
    ``folds`` consecutive groups (in their order in the input) and fold f joins group f of both. For each fold the
    threshold maximising accuracy on the other folds (see ``_best_threshold``) is applied to the held-out fold.
    Returns (mean, population std) of the per-fold accuracies.
    """
    scores = _pair_cosines(feats_a, feats_b)
    same = _as_labels("same", same, len(scores)).astype(bool)
    if folds < 2:
        raise ValueError(f"folds: expected at least 2, got {folds}")
    positive = np.flatnonzero(same)
    negative = np.flatnonzero(~same)
    if len(positive) < folds or len(negative) < folds:
        raise ValueError(f"same: need at least {folds} positive and {folds} negative pairs for {folds} folds, "
                         f"got {len(positive)} and {len(negative)}")
    fold_of = np.empty(len(scores), dtype=np.int64)
    for group in (positive, negative):
        for f, part in enumerate(np.array_split(group, folds)):
            fold_of[part] = f
    accuracies = []
    for f in range(folds):
        train = fold_of != f
        threshold = _best_threshold(scores[train], same[train])
        test = ~train
        accuracies.append(float(np.mean((scores[test] > threshold) == same[test])))
    return float(np.mean(accuracies)), float(np.std(accuracies))


def tar_at_far(scores, same, far: float) -> float:
    """True accept rate (fraction) at the lowest threshold whose false accept rate is <= ``far``.

    scores (n,) similarities, same (n,) bool; a pair is accepted when score >= threshold, so pairs with equal
    scores are always accepted or rejected together (ties never split). Thresholds range over the observed
    scores and +inf (accept nothing), so the result is exact for the empirical distribution.
    """
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 1:
        raise ValueError(f"scores: expected a 1-D array, got shape {scores.shape}")
    same = _as_labels("same", same, len(scores)).astype(bool)
    if not 0.0 <= far <= 1.0:
        raise ValueError(f"far: expected a fraction in [0, 1], got {far}")
    pos = np.sort(scores[same])
    neg = np.sort(scores[~same])
    if len(pos) == 0 or len(neg) == 0:
        raise ValueError("same: need at least one positive and one negative pair")
    thresholds = np.concatenate([np.unique(scores), [np.inf]])
    false_accept = (len(neg) - np.searchsorted(neg, thresholds, side="left")) / len(neg)
    threshold = thresholds[int(np.argmax(false_accept <= far))]      # FAR falls as the threshold rises
    return float((len(pos) - np.searchsorted(pos, threshold, side="left")) / len(pos))

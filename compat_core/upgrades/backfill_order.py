"""Partial backfilling: retrieval accuracy against the fraction of the gallery re-embedded with the new model.

A gallery of ``N`` images indexed with the old model is upgraded item by item: after re-embedding a fraction ``f``
of it, queries of the new model search a mixed index (re-embedded items: new-model features; the others: old-model
features, optionally passed through an old -> new transformation such as FCT). ``f = 0`` is the cross-test (or the
transformed gallery), ``f = 1`` the new model's self-test (full re-indexing).

Orders: ``random`` (seeded permutation) and ``uncertainty`` (FastFill-style, Jaccard et al. 2023: the items whose
old -> new transformation is least reliable first). The uncertainty of item ``i`` is the transformation error
``||h(g_old_i) - g_new_i||^2`` predicted from the old feature alone by ridge regression (:func:`uncertainty_scores`),
so a team can order its backfill from what it already has. All accuracies are fractions in [0, 1].
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from compat_core.retrieval import search as retrieval

DEFAULT_FRACTIONS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
ORDERS = ("random", "uncertainty")


def _matrix(name: str, value: Any) -> torch.Tensor:
    tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    if tensor.ndim != 2:
        raise ValueError(f"{name}: expected an (N, D) feature matrix, got shape {tuple(tensor.shape)}")
    return tensor.float()


def uncertainty_scores(gallery_old: Any, transformed_old: Any, gallery_new: Any, ridge: float = 1e-2) -> np.ndarray:
    """(N,) predicted squared transformation error of each gallery item, from its old feature (ridge regression).

    Target ``e_i = ||n(h(g_old_i)) - n(g_new_i)||^2`` (n = L2 normalisation); predictor ``[n(g_old_i), 1] w`` with
    ``w = (Z^T Z + ridge * N * I)^{-1} Z^T e`` (float64).
    """
    old = F.normalize(_matrix("gallery_old", gallery_old), dim=1).double()
    error = ((F.normalize(_matrix("transformed_old", transformed_old), dim=1)
              - F.normalize(_matrix("gallery_new", gallery_new), dim=1)) ** 2).sum(dim=1).double()
    if old.shape[0] != error.shape[0]:
        raise ValueError(f"uncertainty: {old.shape[0]} old gallery rows but {error.shape[0]} transformed/new rows")
    design = torch.cat([old, torch.ones(old.shape[0], 1, dtype=torch.float64)], dim=1)
    gram = design.T @ design + ridge * old.shape[0] * torch.eye(design.shape[1], dtype=torch.float64)
    weights = torch.linalg.solve(gram, design.T @ error)
    return (design @ weights).numpy()


def backfill_order(size: int, order: str, seed: int = 0, scores: Any = None) -> np.ndarray:
    """Permutation of ``range(size)``: the order in which gallery items are re-embedded."""
    if order == "random":
        return np.random.default_rng(seed).permutation(size)
    if order == "uncertainty":
        if scores is None or np.asarray(scores).shape != (size,):
            raise ValueError(f"backfill order 'uncertainty': expected scores of shape ({size},)")
        return np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")  # most uncertain first
    raise ValueError(f"backfill order {order!r}: expected one of {list(ORDERS)}")


def backfill_curve(query_new: Any, query_labels: Any, gallery_old: Any, gallery_new: Any, gallery_labels: Any,
                   order: np.ndarray, fractions: Sequence[float] = DEFAULT_FRACTIONS,
                   metrics: Sequence[str] = ("recall_at_1", "map"),
                   on_point: Callable[[float, dict[str, float]], None] | None = None) -> dict[str, list[float]]:
    """Accuracy of new queries on the partly re-embedded gallery at each fraction.

    gallery_old: old-model (or already transformed) gallery features in the new model's space; gallery_new: the
    new model's features of the same images; order: the re-embedding order (:func:`backfill_order`). Returns
    ``{"fraction": [...], "recall_at_1": [...], "map": [...]}`` (fractions in [0, 1]; the first ``round(f * N)``
    items of ``order`` are re-embedded at fraction ``f``). on_point(fraction, {metric: value}) is called after each
    point (progress lines for long curves).
    """
    query = F.normalize(_matrix("query_new", query_new), dim=1)
    old = F.normalize(_matrix("gallery_old", gallery_old), dim=1)
    new = F.normalize(_matrix("gallery_new", gallery_new), dim=1)
    if old.shape != new.shape or old.shape[1] != query.shape[1]:
        raise ValueError(f"backfill: gallery_old {tuple(old.shape)}, gallery_new {tuple(new.shape)} and query "
                         f"{tuple(query.shape)} must share N and D")
    order = np.asarray(order)
    if sorted(order.tolist()) != list(range(old.shape[0])):
        raise ValueError("backfill: order must be a permutation of the gallery rows")
    q_labels = np.asarray(query_labels, dtype=np.int64)
    g_labels = np.asarray(gallery_labels, dtype=np.int64)
    curve: dict[str, list[float]] = {"fraction": [], **{name: [] for name in metrics}}
    for fraction in fractions:
        if not 0.0 <= float(fraction) <= 1.0:
            raise ValueError(f"backfill fraction {fraction!r}: expected a value in [0, 1]")
        count = int(round(float(fraction) * old.shape[0]))
        mixed = old.clone()
        chosen = torch.from_numpy(order[:count].astype(np.int64))
        mixed[chosen] = new[chosen]
        curve["fraction"].append(float(fraction))
        for name in metrics:
            if name == "recall_at_1":
                value = retrieval.recall_at_1(query, q_labels, mixed, g_labels)
            elif name == "map":
                value = retrieval.mean_average_precision(query, q_labels, mixed, g_labels)
            else:
                raise ValueError(f"backfill metric {name!r}: expected recall_at_1 or map")
            curve[name].append(float(value))
        if on_point is not None:
            on_point(float(fraction), {name: curve[name][-1] for name in metrics})
    return curve


__all__ = ["DEFAULT_FRACTIONS", "ORDERS", "uncertainty_scores", "backfill_order", "backfill_curve"]

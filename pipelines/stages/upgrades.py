"""The ``adapt`` stage: adapters and partial-backfilling curves at a replacement (old model t-1 -> new model t).

Inputs are the features the pipeline already extracted: query and gallery features of both models. Adapters are
fitted on the **paired gallery features** (the same gallery images embedded by both models: what a team has after
re-embedding a sample of its index) and evaluated with the **query** set, whose images are disjoint from the
gallery's. Each adapter is stored as ``adapter-<kind>.safetensors`` in the stage folder (content-keyed like every
model; the tracker logs and registers it), and the record holds, for the entry C[t, t-1]:

- ``self_old`` M(Q_old, G_old), ``self_new`` M(Q_new, G_new) (full re-indexing), ``cross`` M(Q_new, G_old);
- per adapter: ``cross`` with the adapter applied (queries new->old, or the FCT-transformed gallery), the verdict
  of the compatibility criterion (strict by default) and the margin to the self-test, the fit loss;
- ``backfill``: Recall@1 / mAP against the re-embedded fraction of the gallery, random and uncertainty-first
  order, starting from the FCT-transformed gallery when ``fct`` is listed, else from the raw old gallery.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from compat_core.evaluation.metrics import upgrade_verdict
from compat_core.upgrades.adapters import GALLERY_ADAPTERS, SEEDED_ADAPTERS, make_adapter, save_adapter
from compat_core.upgrades.backfill_order import backfill_curve, backfill_order, uncertainty_scores
from pipelines.engine.events import ProgressUpdate
from pipelines.records.payloads import AdapterResult, CrossTests, UpgradeVerdict
from pipelines.records.stage_records import AdaptersRecord
from pipelines.stages.context import StageContext, StageResult
from pipelines.stages.entry_metrics import compute_entry
from pipelines.stages.feature_store import read_features

ADAPTER_BLOB_PREFIX = "adapter-"


def adapter_blob_name(kind: str) -> str:
    return f"{ADAPTER_BLOB_PREFIX}{kind}.safetensors"


def _with_metric(protocol: dict, metric: str) -> dict:
    return {**protocol, "metric": metric}


@dataclass(frozen=True)
class AdapterOutcome:
    """One adapter fitted at an upgrade (old model -> new model) and judged by the compatibility criterion.

    settings: the adapter's constructor settings (seed included for seeded kinds). query / gallery: the feature
    tuples of the cross test (new queries and old gallery, one of them moved by the adapter). cross: metric name ->
    M(query, gallery) with the adapter (fraction). verdict: :func:`compat_core.evaluation.metrics.upgrade_verdict` on the
    judged metric."""

    adapter: Any
    settings: dict[str, Any]
    query: tuple
    gallery: tuple
    cross: dict[str, float]
    verdict: dict[str, Any]


def fit_and_judge(kind: str, old_gallery: tuple, new_query: tuple, new_gallery: tuple,
                  entry: Callable[[tuple, tuple, str], float], metric: str, self_old: float,
                  self_new: float | None = None, strict: bool = True, metrics: Sequence[str] | None = None,
                  settings: dict | None = None, seed: int = 0) -> AdapterOutcome:
    """Fit adapter ``kind`` on the paired gallery features and judge the cross-test it gives.

    Feature arguments are ``(features, fine labels, coarse labels)`` tuples. Gallery adapters move the old gallery
    into the new space (new queries unchanged); query adapters move the new queries into the old space (old gallery
    unchanged). entry(query, gallery, metric name) -> fraction computes an entry of the protocol; ``metrics``: the
    names to measure (default just ``metric``), ``metric`` the one judged against ``self_old`` (``>`` when strict).
    """
    settings = dict(settings or {})
    if kind in SEEDED_ADAPTERS:
        settings.setdefault("seed", seed)
    adapter = make_adapter(kind, **settings)
    as_tensor = lambda part: torch.from_numpy(np.asarray(part[0], dtype=np.float32))  # noqa: E731
    if kind in GALLERY_ADAPTERS:
        adapter.fit(as_tensor(old_gallery), as_tensor(new_gallery))
        query, gallery = new_query, (adapter.apply(as_tensor(old_gallery)).numpy(),) + tuple(old_gallery[1:])
    else:
        adapter.fit(as_tensor(new_gallery), as_tensor(old_gallery))
        query, gallery = (adapter.apply(as_tensor(new_query)).numpy(),) + tuple(new_query[1:]), old_gallery
    cross = {name: entry(query, gallery, name) for name in (metrics or (metric,))}
    return AdapterOutcome(adapter, settings, query, gallery, cross,
                          upgrade_verdict(cross[metric], self_old, self_new, strict))


def adapt_stage(ctx: StageContext) -> StageResult:
    """Fit every adapter listed at the replacement of task ``ctx.stage.task``; evaluate; backfilling curves."""
    config, stage = ctx.config, ctx.stage
    params = stage.params
    protocol = params["protocol"]
    metric = protocol["metric"]
    if metric not in ("recall_at_1", "map"):
        raise ValueError(f"replacements[].adapters: adapters are evaluated with recall_at_1 or map retrieval; "
                         f"evaluation.metric is {metric!r}")
    old_q, old_g, new_q, new_g = (read_features(ctx.store, key) for key in stage.parents)
    as_float = lambda part: np.asarray(part[0], dtype=np.float32)  # noqa: E731

    def entry(query: tuple, gallery: tuple, name: str = metric) -> float:
        return compute_entry(query, gallery, _with_metric(protocol, name), config)

    baseline = {name: CrossTests(self_old=entry(old_q, old_g, name), self_new=entry(new_q, new_g, name),
                                 cross=entry(new_q, old_g, name)) for name in ("recall_at_1", "map")}
    strict = bool(params.get("strict", True))

    def verdict(cross: float) -> UpgradeVerdict:
        return UpgradeVerdict(**upgrade_verdict(cross, baseline[metric].self_old, baseline[metric].self_new, strict))

    record = AdaptersRecord(stage.key, int(stage.task), int(stage.task) - 1, metric, baseline,
                            verdict(baseline[metric].cross))
    blobs: dict[str, bytes] = {}
    transformed_gallery = None
    kinds = list(params["adapters"])
    for index, kind in enumerate(kinds):
        started = time.perf_counter()
        outcome = fit_and_judge(kind, old_g, new_q, new_g, entry, metric, baseline[metric].self_old,
                                baseline[metric].self_new, strict, ("recall_at_1", "map"),
                                params.get("adapter_params", {}).get(kind, {}), int(params.get("seed", 0)))
        if kind in GALLERY_ADAPTERS:
            transformed_gallery = outcome.gallery[0]
        blob = adapter_blob_name(kind)
        blobs[blob] = save_adapter(outcome.adapter)
        record.adapters[kind] = AdapterResult(outcome.adapter.direction, blob, outcome.settings,
                                              outcome.adapter.fit_loss[-1], time.perf_counter() - started,
                                              outcome.cross["recall_at_1"], outcome.cross["map"],
                                              UpgradeVerdict(**outcome.verdict))
        ctx.emit(ProgressUpdate(stage.key, index + 1, len(kinds) + 2, "adapter", 0.0))

    # partial backfilling: new queries on a gallery re-embedded item by item
    start_gallery = transformed_gallery if transformed_gallery is not None else as_float(old_g)
    labels = lambda part: part[2] if protocol["label_level"] == "coarse" else part[1]  # noqa: E731
    scores = uncertainty_scores(as_float(old_g), start_gallery, as_float(new_g))
    record.backfill.start = "fct" if transformed_gallery is not None else "old features"
    for step, order_name in enumerate(("random", "uncertainty")):
        order = backfill_order(start_gallery.shape[0], order_name, seed=int(params.get("seed", 0)),
                               scores=scores if order_name == "uncertainty" else None)
        setattr(record.backfill, order_name, backfill_curve(as_float(new_q), labels(new_q), start_gallery,
                                                            as_float(new_g), labels(new_g), order))
        ctx.emit(ProgressUpdate(stage.key, len(kinds) + step + 1, len(kinds) + 2, "backfill curve", 0.0))
    return StageResult(record, blobs)


def adapter_summaries(graph: Any, store: Any) -> list[dict]:
    """Committed adapt-stage records of a run, by replacement task (empty when the scenario lists no adapters)."""
    return [store.load_record(key) for task, key in sorted(graph.adapt_stages.items()) if store.has(key)]


__all__ = ["AdapterOutcome", "adapt_stage", "fit_and_judge", "adapter_blob_name", "adapter_summaries",
           "ADAPTER_BLOB_PREFIX"]

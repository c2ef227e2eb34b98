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
from pipelines.stages.entry_metrics import entry_metric
from pipelines.stages.inputs import AdaptInputs
from pipelines.stages.feature_store import read_features

ADAPTER_BLOB_PREFIX = "adapter-"


def adapter_blob_name(kind: str) -> str:
    return f"{ADAPTER_BLOB_PREFIX}{kind}.safetensors"


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


METRICS = ("recall_at_1", "map")


def cross_tests(old_query: tuple, old_gallery: tuple, new_query: tuple, new_gallery: tuple,
                entry: Callable[[tuple, tuple, str], float], metrics: Sequence[str] = METRICS) -> dict[str, CrossTests]:
    """Per metric name, the entries of an upgrade (fractions): M(Q_old, G_old), M(Q_new, G_new), M(Q_new, G_old)."""
    return {name: CrossTests(self_old=entry(old_query, old_gallery, name), self_new=entry(new_query, new_gallery, name),
                             cross=entry(new_query, old_gallery, name)) for name in metrics}


@dataclass(frozen=True)
class UpgradeStudy:
    """What a team can do at an upgrade old -> new: ``adapters`` (kind -> its :class:`AdapterOutcome`, in the order
    fitted) with the seconds each took to fit and judge, and the partial-backfilling ``curves`` (order -> {"fraction":
    [...], metric: [...]}, fractions) starting from ``start`` ("fct": the gallery adapter's transformed gallery, or
    "old features")."""

    adapters: dict[str, AdapterOutcome]
    seconds: dict[str, float]
    curves: dict[str, dict[str, list[float]]]
    start: str


def study_upgrade(old_gallery: tuple, new_query: tuple, new_gallery: tuple,
                  entry: Callable[[tuple, tuple, str], float], metric: str, self_old: float, *,
                  self_new: float | None = None, strict: bool = True, kinds: Sequence[str] = (),
                  metrics: Sequence[str] | None = None, adapter_params: dict | None = None, seed: int = 0,
                  orders: Sequence[str] = ("random",), label_level: str = "fine",
                  start_from_gallery_adapter: bool = True,
                  on_adapter: Callable[[int, str, AdapterOutcome, float], None] | None = None,
                  on_curve: Callable[[int, str], None] | None = None,
                  on_point: Callable[[float, dict], None] | None = None) -> UpgradeStudy:
    """The one adapter-and-backfill workflow of an upgrade (the adapt stage's and the gate's).

    Fits every adapter of ``kinds`` in order and judges it (:func:`fit_and_judge`: ``metric`` against ``self_old``,
    ``metrics`` measured), then computes a backfilling curve per order of ``orders`` ("random", "uncertainty";
    seeded by ``seed``) of new queries on the gallery re-embedded item by item, measured on ``metrics`` with the
    labels of ``label_level``. The curves start from the last gallery adapter's transformed gallery when
    ``start_from_gallery_adapter`` and one was fitted, else from the raw old gallery. Feature arguments are
    ``(features, fine labels, coarse labels)`` tuples. Callbacks: on_adapter(index, kind, outcome, seconds) after each
    adapter, on_curve(index, order) after each curve, on_point(fraction, values) after each curve point."""
    as_float = lambda part: np.asarray(part[0], dtype=np.float32)  # noqa: E731
    adapters, seconds, transformed = {}, {}, None
    for index, kind in enumerate(kinds):
        started = time.perf_counter()
        outcome = fit_and_judge(kind, old_gallery, new_query, new_gallery, entry, metric, self_old, self_new, strict,
                                metrics, (adapter_params or {}).get(kind, {}), seed)
        adapters[kind], seconds[kind] = outcome, time.perf_counter() - started
        if kind in GALLERY_ADAPTERS:
            transformed = outcome.gallery[0]
        if on_adapter is not None:
            on_adapter(index, kind, outcome, seconds[kind])
    use_transformed = start_from_gallery_adapter and transformed is not None
    start_gallery = transformed if use_transformed else as_float(old_gallery)
    labels = lambda part: part[2] if label_level == "coarse" else part[1]  # noqa: E731
    scores = (uncertainty_scores(as_float(old_gallery), start_gallery, as_float(new_gallery))
              if "uncertainty" in orders else None)
    curves = {}
    for index, order_name in enumerate(orders):
        order = backfill_order(start_gallery.shape[0], order_name, seed=seed,
                               scores=scores if order_name == "uncertainty" else None)
        curves[order_name] = backfill_curve(as_float(new_query), labels(new_query), start_gallery,
                                            as_float(new_gallery), labels(new_gallery), order,
                                            metrics=tuple(metrics or METRICS), on_point=on_point)
        if on_curve is not None:
            on_curve(index, order_name)
    return UpgradeStudy(adapters, seconds, curves, "fct" if use_transformed else "old features")


def adapt_stage(ctx: StageContext) -> StageResult:
    """Fit every adapter listed at the replacement of task ``inputs.task``; evaluate; backfilling curves."""
    stage = ctx.stage
    inputs: AdaptInputs = ctx.inputs
    metric = inputs.rules.protocol.metric  # recall_at_1 or map (pipelines.config.validate)
    old_q, old_g, new_q, new_g = (read_features(ctx.store, key) for key in stage.parents)

    def entry(query: tuple, gallery: tuple, name: str = metric) -> float:
        return entry_metric(query, gallery, inputs.rules.with_metric(name))

    baseline = cross_tests(old_q, old_g, new_q, new_g, entry)
    record = AdaptersRecord(stage.key, inputs.task, inputs.task - 1, metric, baseline,
                            UpgradeVerdict(**upgrade_verdict(baseline[metric].cross, baseline[metric].self_old,
                                                             baseline[metric].self_new, inputs.strict)))
    kinds = list(inputs.adapters)
    steps = len(kinds) + 2

    def adapter_done(index: int, kind: str, outcome: AdapterOutcome, seconds: float) -> None:
        ctx.emit(ProgressUpdate(stage.key, index + 1, steps, "adapter", 0.0))

    def curve_done(index: int, order: str) -> None:
        ctx.emit(ProgressUpdate(stage.key, len(kinds) + index + 1, steps, "backfill curve", 0.0))

    study = study_upgrade(old_g, new_q, new_g, entry, metric, baseline[metric].self_old,
                          self_new=baseline[metric].self_new, strict=inputs.strict, kinds=kinds, metrics=METRICS,
                          adapter_params=inputs.adapter_params, seed=inputs.seed,
                          orders=("random", "uncertainty"), label_level=inputs.rules.protocol.label_level,
                          on_adapter=adapter_done, on_curve=curve_done)
    blobs: dict[str, bytes] = {}
    for kind, outcome in study.adapters.items():
        blob = adapter_blob_name(kind)
        blobs[blob] = save_adapter(outcome.adapter)
        record.adapters[kind] = AdapterResult(outcome.adapter.direction, blob, outcome.settings,
                                              outcome.adapter.fit_loss[-1], study.seconds[kind],
                                              outcome.cross["recall_at_1"], outcome.cross["map"],
                                              UpgradeVerdict(**outcome.verdict))
    record.backfill.start = study.start
    record.backfill.random, record.backfill.uncertainty = study.curves["random"], study.curves["uncertainty"]
    return StageResult(record, blobs)


def adapter_summaries(graph: Any, store: Any) -> list[dict]:
    """Committed adapt-stage records of a run, by replacement task (empty when the scenario lists no adapters)."""
    return [store.load_record(key) for task, key in sorted(graph.adapt_stages.items()) if store.has(key)]


__all__ = ["AdapterOutcome", "METRICS", "UpgradeStudy", "adapt_stage", "cross_tests", "fit_and_judge",
           "adapter_blob_name", "adapter_summaries", "study_upgrade", "ADAPTER_BLOB_PREFIX"]

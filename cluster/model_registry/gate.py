"""Compatibility gate on MLflow registry aliases: move ``champion`` to a candidate only when new queries can search
the gallery the champion indexed.

:func:`run_gate` evaluates, on a held-out query/gallery set (the ``evaluation`` section of a scenario config), the
self-test M(Q_old, G_old) of the version behind the alias, the cross-test M(Q_new, G_old) of the candidate against
it and the candidate's self-test M(Q_new, G_new) (full re-indexing), Recall@1 and mAP, and applies the strict
compatibility criterion ``M(new, old) > M(old, old)`` (``>=`` when not strict; SPEC §1). The alias moves only when
it holds (or when the alias is not set yet: the first champion). With ``adapter`` a query adapter (new -> old) or
an FCT gallery transformation is fitted on the candidate's and champion's paired gallery features and the criterion
is applied with it; the adapter file is logged with the gate run and its kind tagged on the version.

Every decision is a run of the MLflow experiment ``compat-gate`` (tags ``run_role=gate``, ``action=gate|rollback``,
``registered_model``, ``alias``, ``candidate_version``, ``previous_version`` (behind the alias before),
``new_version`` (behind it after), ``decision``, ``reason``; metrics in fractions). Only a move writes the version
tags that say how a version came to hold the alias (``gate.<alias>.decision``, ``.run_id``, ``.margin``,
``.adapter``: the search service reads the adapter file of that run); a refusal or a dry run tags the candidate with
``gate.<alias>.last_decision`` / ``.last_run_id`` only, and a gate of the version already behind the alias
(decision ``unchanged``) writes no version tag. :func:`alias_history` lists the runs; :func:`rollback` moves the
alias back to a version that held it before, after loading it and comparing it with the current holder and with
what each serving index named was built with (:func:`check_serving_index`).

A move survives a kill at any point (``MOVE_STEPS``): its run is created first with tag ``move_state=intended``
(left RUNNING) and the candidate's install tags as they were (``prior.<name>``), then the candidate's install tags,
then the alias move, then the replaced version's tags, ``move_state=confirmed`` and FINISHED. Every later gate,
rollback or history reconciles an intent left behind (:func:`reconcile_moves`): the alias at the intended version
confirms it (and writes the tags that follow the move); the alias elsewhere records the decision as
``interrupted``, puts the candidate's install tags back and ends the run KILLED.
"""
from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from cluster.model_registry.alias_moves import (
    DEFAULT_ALIAS, GATE_EXPERIMENT, MOVE_STATE, MOVE_STEPS, PRIOR, MoveStep, _experiment_id, _no_step, _version,
    after_move, alias_history, install_tags, reconcile_moves, set_version_tags, version_by_alias,
)
from cluster.model_registry import alias_moves
from cluster.model_registry.serving_indexes import index_location, recorded_indexes
from cluster.model_registry.versions import MlflowModelResolver
from cluster.serving.index_store import HEAD, read_manifest
from cluster.serving.models import installed_adapter
from cluster.serving.shards import is_sharded, part_root, read_shard_set
from cluster.serving.state import check_servable
from cluster.storage.s3 import configure_object_storage
from cluster.tracking.client import ensure_experiment, open_client
from compat_core import io as cio
from compat_core.evaluation.metrics import criterion_sign, is_compatible, upgrade_verdict
from compat_core.models.compat_model import load_model
from compat_core.upgrades.adapters import ADAPTER_KINDS, save_adapter
from pipelines.config.model_uri import ModelUri
from pipelines.stages.context import resolve_device
from pipelines.stages.entry_metrics import compute_entry
from pipelines.stages.extraction import extract_pool_features
from pipelines.stages.pools import check_pools_open_set, load_pool
from pipelines.stages.adapt import METRICS, adapter_blob_name, cross_tests, study_upgrade



@dataclass
class GateResult:
    """One gate decision. decision: promoted | refused | unchanged (the candidate is already behind the alias) |
    dry-run-pass | dry-run-refuse; numbers are fractions."""

    model: str
    alias: str
    candidate_version: str
    champion_version: str | None
    decision: str
    reason: str
    metric: str
    strict: bool
    adapter: str | None = None
    values: dict[str, dict[str, float]] = field(default_factory=dict)   # metric -> self_old/cross/self_new
    verdict: dict[str, Any] = field(default_factory=dict)
    advice: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)              # per adapter / backfill numbers on refusal
    run_id: str | None = None

    @property
    def moved(self) -> bool:
        return self.decision == "promoted"


def _features(resolver: Any, model: str, version: str, config: Any, pools: dict, device: Any,
              log: Callable[[str], None]) -> dict[str, tuple]:
    """Features of ``models:/model/version`` on the query and gallery pools: split -> (features, labels, coarse)."""
    folder = resolver(str(ModelUri(model, str(version))))
    try:
        network = load_model(folder, map_location=device)
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"models:/{model}/{version} cannot be loaded: {error}") from None
    out = {}
    for split, pool in pools.items():
        started = time.perf_counter()
        features = extract_pool_features(network, pool, config, device)
        log(f"gate: version {version} {split} features {features.shape[0]} x {features.shape[1]} in "
            f"{time.perf_counter() - started:.1f} s")
        out[split] = (features, np.asarray(pool.labels), getattr(pool, "coarse_labels", None))
    return out


def _entry(query: tuple, gallery: tuple, config: Any, metric: str) -> float:
    return compute_entry(query, gallery, {"metric": metric}, config)


def _options_on_refusal(old: dict, new: dict, config: Any, metric: str, self_old: float, strict: bool,
                        seed: int, log: Callable[[str], None] = print) -> tuple[dict, list[str]]:
    """What the team can do: each adapter's verdict, and the re-indexed fraction that reaches the self-test (the
    pipeline's upgrade workflow, :func:`pipelines.stages.adapt.study_upgrade`, on the judged metric, the curve from
    the raw old gallery in random order); one progress line per adapter and per curve point through ``log`` (fitting
    them takes minutes on a large set)."""

    def adapter_done(index: int, kind: str, outcome: Any, seconds: float) -> None:
        log(f"gate: adapter {index + 1}/{len(ADAPTER_KINDS)} {kind}: M(new, old) {outcome.cross[metric]:.4f} "
            f"({'passes' if outcome.verdict['compatible'] else 'fails'}) in {seconds:.1f} s")

    def point(fraction: float, values: dict) -> None:
        log(f"gate: backfill curve {fraction:.0%} re-embedded: {metric} {values[metric]:.4f}")

    study = study_upgrade(old["gallery"], new["query"], new["gallery"],
                          lambda query, gallery, name: _entry(query, gallery, config, name), metric, self_old,
                          strict=strict, kinds=ADAPTER_KINDS, metrics=(metric,), seed=seed, orders=("random",),
                          label_level=config.evaluation.label_level, start_from_gallery_adapter=False,
                          on_adapter=adapter_done, on_point=point)
    options: dict[str, Any] = {"adapters": {kind: {"cross": outcome.cross[metric],
                                                   "compatible": outcome.verdict["compatible"],
                                                   "margin": outcome.verdict["margin"]}
                                            for kind, outcome in study.adapters.items()}}
    advice = []
    passing = [kind for kind, item in options["adapters"].items() if item["compatible"]]
    if passing:
        best = max(passing, key=lambda kind: options["adapters"][kind]["cross"])
        advice.append(f"fit an adapter: with {best} the cross-test is {options['adapters'][best]['cross']:.4f} > "
                      f"{self_old:.4f}; re-run with --adapter {best} (passing: {', '.join(passing)})")
    else:
        advice.append("no adapter makes the candidate compatible on this set "
                      + ", ".join(f"{k} {v['cross']:.4f}" for k, v in options["adapters"].items()))
    curve = options["backfill_random"] = study.curves["random"]
    needed = next((f for f, v in zip(curve["fraction"], curve[metric]) if is_compatible(v, self_old, strict)), None)
    if needed is None:
        advice.append("backfill: even full re-indexing does not beat the champion's self-test on this set")
    else:
        advice.append(f"backfill: re-embedding {needed:.0%} of the gallery with the candidate (random order) gives "
                      f"{curve[metric][curve['fraction'].index(needed)]:.4f} {criterion_sign(strict)} {self_old:.4f} "
                      f"(full re-indexing: {curve[metric][-1]:.4f}); serve the candidate once that much is "
                      f"re-embedded (see the backfilling curve in the gate run)")
    return options, advice


def run_gate(tracking_uri: str, model: str, candidate: str, config: Any, alias: str = DEFAULT_ALIAS,
             adapter: str | None = None, strict: bool | None = None, dry_run: bool = False,
             cache_dir: str | None = None, experiment: str = GATE_EXPERIMENT,
             log: Callable[[str], None] = print, on_move_step: MoveStep = _no_step) -> GateResult:
    """Evaluate ``models:/model/candidate`` against the version behind ``alias``; move the alias when compatible.

    config: a ScenarioConfig whose ``evaluation`` section names the held-out query/gallery sets and the metric
    (``recall_at_1`` or ``map``). strict: None = ``config.evaluation.strict``. dry_run: decide and record, never move.
    on_move_step(step): called between the steps of the record and the alias move, with "intent" (the decision is
    recorded, the alias not moved yet) and "moved" (moved, not yet confirmed); a caller can observe or stop there.
    """
    metric = config.evaluation.metric
    if metric not in METRICS:
        raise ValueError(f"evaluation.metric {metric!r}: the gate evaluates retrieval, expected one of {METRICS}")
    if adapter is not None:
        if adapter not in ADAPTER_KINDS:
            raise ValueError(f"--adapter {adapter!r}: expected one of {list(ADAPTER_KINDS)}")
    strict = config.evaluation.strict if strict is None else bool(strict)
    client = open_client(tracking_uri)
    reconcile_moves(client, model, alias, experiment)
    candidate_version = _version(client, model, candidate)
    champion = version_by_alias(client, model, alias)
    result = GateResult(model, alias, str(candidate_version.version), str(champion.version) if champion else None,
                        "", "", metric, strict, adapter)
    started_ms = int(time.time() * 1000)
    if champion is None:
        result.decision, result.reason = ("dry-run-pass" if dry_run else "promoted"), (
            f"first promotion: alias {alias!r} of {model!r} is not set, so there is no {alias} to be compatible with; "
            f"the candidate {'would become' if dry_run else 'becomes'} the first {alias} without a compatibility test")
        result.advice = [f"no {alias} existed: nothing was evaluated; every later candidate is gated against "
                         f"version {candidate_version.version}"]
    elif str(champion.version) == str(candidate_version.version):
        result.decision = "unchanged"
        result.reason = (f"version {candidate_version.version} is already behind alias {alias!r}: nothing to "
                         f"evaluate, the alias and the version's tags are left as they are")
    else:
        check_pools_open_set(config)
        pools = {"query": load_pool(config.evaluation.query_set, "evaluation.query_set"),
                 "gallery": load_pool(config.evaluation.gallery_set, "evaluation.gallery_set")}
        device = resolve_device(config.device)
        resolver = MlflowModelResolver(tracking_uri, cache_dir)
        old = _features(resolver, model, str(champion.version), config, pools, device, log)
        new = _features(resolver, model, str(candidate_version.version), config, pools, device, log)
        entry = lambda query, gallery, name: _entry(query, gallery, config, name)  # noqa: E731
        for name, tests in cross_tests(old["query"], old["gallery"], new["query"], new["gallery"], entry,
                                       METRICS).items():
            result.values[name] = {"self_old": tests.self_old, "cross": tests.cross, "self_new": tests.self_new}
        fitted = None
        if adapter is not None:
            study = study_upgrade(old["gallery"], new["query"], new["gallery"], entry, metric,
                                  result.values[metric]["self_old"], self_new=result.values[metric]["self_new"],
                                  strict=strict, kinds=(adapter,), metrics=METRICS, seed=config.seed, orders=())
            fitted = study.adapters[adapter].adapter
            for name in METRICS:
                result.values[name][f"cross_{adapter}"] = study.adapters[adapter].cross[name]
        numbers = result.values[metric]
        cross = numbers[f"cross_{adapter}"] if adapter else numbers["cross"]
        result.verdict = upgrade_verdict(cross, numbers["self_old"], numbers["self_new"], strict)
        sign = criterion_sign(strict)
        what = f"M(new{'+' + adapter if adapter else ''}, old) = {cross:.4f}"
        if result.verdict["compatible"]:
            result.decision = "dry-run-pass" if dry_run else "promoted"
            result.reason = f"compatible: {what} {sign} M(old, old) = {numbers['self_old']:.4f}"
        else:
            result.decision = "dry-run-refuse" if dry_run else "refused"
            result.reason = f"not compatible: {what} is not {sign} M(old, old) = {numbers['self_old']:.4f}"
            log("gate: refused; measuring the options (each adapter, then a backfilling curve)")
            result.options, result.advice = _options_on_refusal(old, new, config, metric, numbers["self_old"],
                                                                strict, config.seed, log)
        result.fitted_adapter = fitted  # type: ignore[attr-defined]
    _record(client, experiment, result, candidate_version, champion, dry_run, started_ms, on_move_step)
    return result


def _run_tags(result: GateResult, candidate: Any, champion: Any, dry_run: bool) -> dict[str, str]:
    """The gate run's tags; a promotion also keeps the candidate's install tags before it (``prior.<name>``)."""
    moved = result.decision == "promoted"
    tags = {"run_role": "gate", "action": "gate", "registered_model": result.model, "alias": result.alias,
            "candidate_version": result.candidate_version, "previous_version": result.champion_version or "",
            "new_version": result.candidate_version if moved else (result.champion_version or ""),
            "decision": result.decision, "reason": result.reason[:4000], "metric": result.metric,
            "strict": str(result.strict).lower(), "adapter": result.adapter or "", "dry_run": str(dry_run).lower(),
            "first_promotion": str(champion is None).lower()}
    if moved:
        tags[MOVE_STATE] = "intended"
        tags.update({PRIOR + name: value for name, value in install_tags(candidate, result.alias).items()})
    return tags


def _log_numbers(client: Any, run_id: str, result: GateResult) -> None:
    """The gate's metrics, decision.json, the fitted adapter file and the backfilling curve, on its run."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = [Metric(f"{name}/{part}", float(value), now, 0) for name, parts in result.values.items()
               for part, value in parts.items()]
    if result.verdict:
        metrics.append(Metric("margin", float(result.verdict["margin"]), now, 0))
        metrics.append(Metric("compatible", float(result.verdict["compatible"]), now, 0))
    for kind, item in (result.options.get("adapters") or {}).items():
        metrics.append(Metric(f"option/{kind}/cross", float(item["cross"]), now, 0))
    curve = result.options.get("backfill_random")
    if curve:
        # step = percent of the gallery re-embedded; the percentage is also a metric of its own with the same
        # steps, so the MLflow chart can use it as the x-axis by name ("backfill/percent_reembedded")
        for fraction, value in zip(curve["fraction"], curve[result.metric]):
            percent = int(round(100 * fraction))
            metrics.append(Metric(f"backfill/random/{result.metric}", float(value), now, percent))
            metrics.append(Metric("backfill/percent_reembedded", float(percent), now, percent))
    if metrics:
        client.log_batch(run_id, metrics=metrics, synchronous=True)
    with tempfile.TemporaryDirectory(prefix="compat-gate-") as folder:
        document = {key: value for key, value in asdict(result).items()}
        Path(folder, "decision.json").write_text(json.dumps(document, indent=2))
        fitted = getattr(result, "fitted_adapter", None)
        if fitted is not None:
            Path(folder, adapter_blob_name(result.adapter)).write_bytes(save_adapter(fitted))
        if curve:
            _plot_backfill(curve, result.metric, Path(folder, "backfill.png"))
        client.log_artifacts(run_id, folder, "gate")


def _record(client: Any, experiment: str, result: GateResult, candidate: Any, champion: Any, dry_run: bool,
            started_ms: int | None = None, on_move_step: MoveStep = _no_step) -> None:
    """Gate run (tags, metrics, decision.json, adapter file), then, for a promotion only, the candidate's install
    tags and the alias move. A decision that moves nothing writes no install tag: a refusal or a dry run tags the
    candidate with ``last_decision`` / ``last_run_id`` only, and a gate of the version already behind the alias
    (``unchanged``) writes no version tag at all, so the search service keeps the adapter its holder came with."""
    moved = result.decision == "promoted"
    # the run spans the whole gate (features, adapters, curve), not only this recording
    tags = _run_tags(result, candidate, champion, dry_run)
    run = client.create_run(_experiment_id(client, experiment), start_time=started_ms, tags=tags,
                            run_name=f"gate-{result.model}-v{result.candidate_version}-{result.decision}")
    run_id = result.run_id = run.info.run_id
    _log_numbers(client, run_id, result)
    if not moved:
        if result.decision != "unchanged":
            set_version_tags(client, result.model, result.candidate_version, result.alias,
                             {"last_decision": result.decision, "last_run_id": run_id})
        client.set_terminated(run_id, "FINISHED", end_time=int(time.time() * 1000))
        return
    on_move_step("intent")
    set_version_tags(client, result.model, result.candidate_version, result.alias,
                     {"decision": result.decision, "run_id": run_id, "adapter": result.adapter or "",
                      "margin": f"{result.verdict['margin']:.6f}" if result.verdict else ""})
    on_move_step("tagged")
    client.set_registered_model_alias(result.model, result.alias, result.candidate_version)
    on_move_step("moved")
    after_move(client, result.model, result.alias, tags, run_id)
    client.set_tag(run_id, MOVE_STATE, "confirmed")
    client.set_terminated(run_id, "FINISHED", end_time=int(time.time() * 1000))


def _served_model(resolver: Any, model: str, version: str) -> Any:
    """The CompatModel of ``models:/model/version`` (sha256 tag, config, weights: names, shapes, dtypes, finite
    values); ValueError naming the version and the cause."""
    uri = str(ModelUri(model, str(version)))
    try:
        return load_model(resolver(uri), map_location="cpu")
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise ValueError(f"{uri} cannot be loaded: {error}") from None
    except Exception as error:  # noqa: BLE001 - a reader's own error type (e.g. safetensors') for bad bytes
        raise ValueError(f"{uri} cannot be loaded: {type(error).__name__}: {error}") from None


def _feature_kind(network: Any) -> dict[str, Any]:
    """What a gallery indexed by ``network`` needs of another model: the feature width and how it is made."""
    return {"feature width": network.feature_dim, "head": network.head, "classifier": network.classifier_kind}


def check_installable(tracking_uri: str, model: str, version: str, reference: str, cache_dir: str | None = None,
                      log: Callable[[str], None] = print) -> None:
    """Load ``models:/model/version`` and compare it with ``reference`` (the version behind the alias, whose
    gallery the search service holds): ValueError when the target does not load or makes features of another width
    or kind. A reference that does not load itself (a broken holder being rolled back) is said and skipped."""
    resolver = MlflowModelResolver(tracking_uri, cache_dir)
    target = _feature_kind(_served_model(resolver, model, version))
    try:
        expected = _feature_kind(_served_model(resolver, model, reference))
    except ValueError as error:
        log(f"gate: the version behind the alias does not load ({error}); version {version} is checked alone")
        return
    different = {key: (expected[key], target[key]) for key in target if target[key] != expected[key]}
    if different:
        raise ValueError(f"models:/{model}/{version} cannot replace version {reference}: "
                         + ", ".join(f"{key} {new} instead of {old}" for key, (old, new) in different.items())
                         + "; the gallery indexed for the current version cannot be searched with it")


def check_serving_index(tracking_uri: str, model: str, version: str, root: str, alias: str = DEFAULT_ALIAS,
                        cache_dir: str | None = None, log: Callable[[str], None] = print) -> None:
    """Refuse (ValueError naming the index) a version that the gallery index at ``root`` cannot be served with.
    The index is what ``compat serve ROOT`` searches: its HEAD manifest, written by ``compat index build`` (and
    each backfill). Checked: the model it was built for (registered model name), its width and search kind
    (:func:`cluster.serving.state.check_servable`), the feature kind (width, head, classifier) of every version
    whose rows its shards hold, and the adapter the gate installed with ``version`` (its file must load: the service
    applies it to the rows of the version it maps)."""
    if str(root).startswith("s3://"):
        configure_object_storage()
    digest, manifest = read_manifest(root)
    where = f"{root} (manifest {digest[:12]})"
    built_for = str((manifest.get("model") or {}).get("name") or "")
    if built_for and built_for != model:
        raise ValueError(f"the index at {where} serves registered model {built_for!r}, not {model!r}; name the "
                         f"index of this model's alias")
    resolver = MlflowModelResolver(tracking_uri, cache_dir)
    uri = str(ModelUri(model, str(version)))
    target = _served_model(resolver, model, version)
    check_servable(manifest, where, uri, getattr(target, "feature_dim", None))
    wanted = _feature_kind(target)
    held = sorted({str(v) for shard in manifest.get("shards") or [] for v in shard.get("model_versions") or []}
                  - {str(version)}, key=lambda v: (len(v), v))
    for other in held:
        try:
            kind = _feature_kind(_served_model(resolver, model, other))
        except ValueError as error:
            log(f"gate: version {other}, whose rows the index at {where} holds, does not load ({error}); not "
                f"compared")
            continue
        different = {key: (kind[key], wanted[key]) for key in wanted if wanted[key] != kind[key]}
        if different:
            raise ValueError(f"{uri} cannot search the index at {where}: it holds rows embedded by version {other}, "
                             f"and " + ", ".join(f"{key} {new} instead of {old}" for key, (old, new) in different.items())
                             + "; re-index with `compat index build`, or roll back to a version of that kind")
    try:
        installed_adapter(resolver.client, ModelUri(model, str(version)), alias)
    except Exception as error:  # noqa: BLE001 - any failure to fetch or read the adapter file refuses the target
        raise ValueError(f"{uri} was installed with an adapter (tag gate.{alias}.adapter) that cannot be loaded now "
                         f"({type(error).__name__}: {str(error)[:300]}); the service serving the index at {where} "
                         f"could not apply it") from None


def rollback(tracking_uri: str, model: str, alias: str = DEFAULT_ALIAS, to_version: str | None = None,
             reason: str = "", experiment: str = GATE_EXPERIMENT, force: bool = False,
             on_move_step: MoveStep = _no_step, cache_dir: str | None = None,
             log: Callable[[str], None] = print, indexes: tuple[str, ...] = ()) -> dict:
    """:func:`cluster.model_registry.alias_moves.rollback` with the target loaded and compared with the version
    behind the alias first (:func:`check_installable`), and with every serving index: those named in ``indexes``
    and those ``compat index build`` recorded for the model (:mod:`cluster.model_registry.serving_indexes`; one that
    is gone is said and skipped), each part of a sharded one (:func:`check_serving_index`)."""
    named = [index_location(root) for root in indexes]
    recorded = [root for root in recorded_indexes(open_client(tracking_uri), model) if root not in named]

    def check(target: str, current: str) -> None:
        check_installable(tracking_uri, model, target, current, cache_dir, log)
        for root in named + recorded:
            if str(root).startswith("s3://"):
                configure_object_storage()
            if root in recorded and not cio.exists(cio.join(root, HEAD)) and not is_sharded(root):
                log(f"gate: the index at {root}, recorded when `compat index build` wrote it, is gone; not checked")
                continue
            parts = ([part_root(root, part) for part in read_shard_set(root)[1]["parts"]] if is_sharded(root)
                     else [root])
            for part in parts:
                check_serving_index(tracking_uri, model, target, part, alias, cache_dir, log)

    return alias_moves.rollback(tracking_uri, model, alias, to_version, reason, experiment, force, on_move_step,
                                check_target=check)


def _plot_backfill(curve: dict, metric: str, path: Path) -> None:
    """The backfilling curve as a picture: x = percent of the gallery re-embedded, y = the metric (fraction)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(5, 3.5))
    axes.plot([100 * f for f in curve["fraction"]], curve[metric], marker="o")
    axes.set_xlabel("gallery re-embedded with the candidate (%)")
    axes.set_ylabel(f"{metric} (fraction)")
    axes.set_title("backfilling curve (random order)")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)


__all__ = ["GateResult", "check_installable", "check_serving_index", "run_gate", "alias_history", "rollback", "reconcile_moves",
           "GATE_EXPERIMENT", "DEFAULT_ALIAS", "MOVE_STEPS"]

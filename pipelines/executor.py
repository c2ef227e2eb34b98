"""Executors run a stage graph against a store; the local one runs it in-process in topological order.

``Executor.run(graph, store)`` is the interface the Ray executor (cluster package) implements with the same stage
functions (:func:`pipelines.stages.execute_stage`). Stages whose manifest is already committed are skipped, so a
killed run started again resumes where it stopped; after the last stage :func:`finalize_run` writes the run
directory's contract files (config.yaml, matrix.json, metrics.json, then the reports when that module exists).
"""
from __future__ import annotations

import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from pipelines.config import ScenarioConfig, config_hash, dump_config
from pipelines.graph import StageGraph
from pipelines.progress import ProgressReporter, StageEvent
from pipelines.stages import execute_stage
from pipelines.store import RunStore

log = logging.getLogger(__name__)


@dataclass
class RunSummary:
    """What one executor invocation did: stage keys executed and skipped (already committed), seconds per stage."""

    run_id: str
    executed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    matrix: dict | None = None
    metrics: dict | None = None


class Executor:
    """Runs every stage of ``graph`` whose manifest is missing from ``store``; returns a RunSummary."""

    def run(self, graph: StageGraph, store: RunStore) -> RunSummary:  # pragma: no cover - interface
        raise NotImplementedError


class LocalExecutor(Executor):
    """In-process, one stage at a time, in the graph's topological order, with progress bars.

    emit: callback receiving every record (stage events, training records, progress); defaults to a tqdm
    ProgressReporter. stop_after: execute at most this many stages, then return (tests, partial runs).
    """

    def __init__(self, emit: Callable[[Any], None] | None = None, progress: bool = True,
                 stop_after: int | None = None) -> None:
        self.emit = emit if emit is not None else ProgressReporter(enabled=progress)
        self.stop_after = stop_after

    def run(self, graph: StageGraph, store: RunStore) -> RunSummary:
        prepare_run(graph.config, store)
        summary = RunSummary(run_id=uuid.uuid4().hex[:12])
        total = len(graph)
        for index, stage in enumerate(graph):
            if store.has(stage.key):
                summary.skipped.append(stage.key)
                self.emit(StageEvent(stage.key, stage.label, stage.kind, "skipped", index, total))
                continue
            if self.stop_after is not None and len(summary.executed) >= self.stop_after:
                break
            self.emit(StageEvent(stage.key, stage.label, stage.kind, "started", index, total))
            started = time.perf_counter()
            try:
                execute_stage(stage, graph.config, store, self.emit, code_version=graph.code_version)
            except BaseException:
                self.emit(StageEvent(stage.key, stage.label, stage.kind, "failed", index, total))
                raise
            seconds = time.perf_counter() - started
            summary.executed.append(stage.key)
            summary.seconds[stage.key] = seconds
            self.emit(StageEvent(stage.key, stage.label, stage.kind, "done", index, total, seconds))
        record_invocation(store, summary)
        if all(store.has(stage.key) for stage in graph):
            summary.matrix, summary.metrics = finalize_run(graph, store)
        close = getattr(self.emit, "close", None)
        if callable(close):
            close()
        return summary


def prepare_run(config: ScenarioConfig, store: RunStore) -> None:
    """Write the resolved config.yaml; refuse a run directory that holds a different scenario."""
    text = dump_config(config)
    try:
        existing = store.read_text("config.yaml")
    except FileNotFoundError:
        existing = None
    if existing is not None and existing != text:
        import yaml

        from pipelines.config import validate_config

        try:
            same = config_hash(validate_config(yaml.safe_load(existing), "config.yaml")) == config_hash(config)
        except ValueError:
            same = False
        if not same:
            raise ValueError(f"run directory {store.root} holds another scenario (config.yaml differs); use a new "
                             f"--output or resume with that run's own config")
    store.write_text("config.yaml", text)


def record_invocation(store: RunStore, summary: RunSummary) -> None:
    """One JSON file per executor invocation under executions/ (object stores cannot append to a log)."""
    store.write_text(f"executions/{time.strftime('%Y%m%dT%H%M%S')}-{summary.run_id}.json", json.dumps({
        "run_id": summary.run_id, "executed": summary.executed, "skipped": summary.skipped,
        "seconds": summary.seconds}, indent=1))


def read_invocations(store: RunStore) -> list[dict]:
    """Every invocation record of a run directory, oldest first."""
    from compat_core import io as cio

    folder = store.uri("executions")
    if not cio.is_dir(folder):
        return []
    return [json.loads(store.read_text(f"executions/{name}")) for name in cio.list_dir(folder)]


def assemble_matrix(graph: StageGraph, store: RunStore):
    """CompatibilityMatrix (T x T fractions, NaN above the diagonal) from the committed row records."""
    from compat_core.metrics import CompatibilityMatrix

    config = graph.config
    T = config.num_tasks
    values = np.full((T, T), np.nan)
    for row, key in enumerate(graph.evaluate_stages):
        record = store.load_record(key)
        values[row, : row + 1] = record["values"]
    protocol = {
        "metric": config.evaluation.metric,
        "gallery": config.evaluation.gallery,
        "label_level": config.evaluation.label_level,
        "strict": config.evaluation.strict,
        "query_set": f"{config.evaluation.query_set.dataset}/{config.evaluation.query_set.split}",
        "gallery_set": f"{config.evaluation.gallery_set.dataset}/{config.evaluation.gallery_set.split}",
        "replacements_at_task": [r.at_task for r in config.replacements],  # 1-based, as the papers
    }
    return CompatibilityMatrix(values, [f"task-{t + 1}" for t in range(T)], config.evaluation.metric, protocol)


def compute_metrics(matrix, strict: bool) -> dict:
    """metrics.json content: AC, AA, ACA, BC, FC (fractions; null when undefined) + AC_tau/AA_tau per task."""
    from compat_core.metrics import metrics_by_task

    summary = matrix.summary()
    curves = metrics_by_task(matrix.values, strict=strict)
    clean = lambda v: None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)  # noqa: E731
    return {
        "units": "fraction",
        "metric": matrix.metric,
        "strict": strict,
        "num_tasks": matrix.num_models,
        **{name: clean(summary[name]) for name in ("AC", "AA", "ACA", "BC", "FC")},
        "AC_tau": [clean(v) for v in curves["AC_tau"]],
        "AA_tau": [clean(v) for v in curves["AA_tau"]],
    }


def write_results(store: RunStore, matrix, metrics: dict) -> None:
    store.write_text("matrix.json", matrix.to_json())
    store.write_text("metrics.json", json.dumps(metrics, indent=2, allow_nan=False))


def finalize_run(graph: StageGraph, store: RunStore) -> tuple[dict, dict]:
    """Write matrix.json and metrics.json (and reports when pipelines.reports exists); returns both as dicts."""
    matrix = assemble_matrix(graph, store)
    metrics = compute_metrics(matrix, graph.config.evaluation.strict)
    write_results(store, matrix, metrics)
    if getattr(graph, "adapt_stages", None):  # adapters at replacements (issue 16): report input
        from pipelines.upgrades import adapter_summaries

        store.write_text("adapters.json", json.dumps(adapter_summaries(graph, store), indent=2, allow_nan=False))
    try:
        from pipelines.reports import write_reports
    except ImportError:
        log.info("pipelines.reports is not available: report.md and matrix.png not written")
    else:
        if store.is_local:
            write_reports(store.base)
        else:
            log.info("reports are written for local run directories only; run `compat report` on a local copy")
    return matrix.to_dict(), metrics

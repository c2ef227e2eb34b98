"""One trial of a search: its pipeline run task by task with a report after each task (in-process), and the Ray
Tune function trainable around it."""
from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from cluster.storage.s3 import configure_object_storage
from cluster.tune.spec import (
    MODELS_KEY,
    OBJECTIVE_KEY,
    RESULT_KEY,
    TIME_ATTR,
    TRIAL_FILE,
    SearchSpec,
    first_reported_task,
    load_plugins,
    trial_config,
)
from compat_core import io as cio
from pipelines.engine.events import StageEvent, StageRecord
from pipelines.engine.progress import ProgressReporter
from pipelines.engine.runner import LocalExecutor, close_emit, prepare_run
from pipelines.graph.compile import compile_scenario
from pipelines.records.stage_records import ModelRecord
from pipelines.reports.run_report import write_store_reports
from pipelines.results.assemble import headline_metrics, matrix_values
from pipelines.stages.run_precision import resolve_run_precision
from pipelines.store.run_store import RunStore

# the loggers of Ray Train storage that announce every checkpoint at INFO
CHECKPOINT_LOGGERS = ("ray.train._internal.storage", "ray.train.v2._internal.execution.storage")


# ---- the trainable ---------------------------------------------------------------------------------------------------
class TrialLines:
    """Emit callback of a trial: its stage lines (started / done, and epoch, images/s, ETA every 10 s inside a stage)
    in the trial's log, which Ray forwards to the search's driver, labelled ``[trial <id>]``. Stages an earlier task's
    invocation committed (skipped again by each later one) are not repeated."""

    def __init__(self, trial_id: str) -> None:
        self.reporter = ProgressReporter(enabled=False, label=f"trial {trial_id}")

    def __call__(self, record: Any) -> None:
        event = record.record if isinstance(record, StageRecord) else record
        if isinstance(event, StageEvent) and event.status == "skipped":
            return
        self.reporter(record)

    def close(self) -> None:
        self.reporter.close()


class ModelCollector:
    """Emit callback of a trial: forwards every record to ``emit`` and keeps, from the engine's done / skipped
    events, each task model's stage key and blob table (what the driver registers for the best trial)."""

    BLOBS = ("model.safetensors", "config.json")

    def __init__(self, emit) -> None:
        self.emit = emit
        self.models: dict[str, dict] = {}

    def close(self) -> None:
        close_emit(self.emit)

    def __call__(self, record: Any) -> None:
        self.emit(record)
        committed = getattr(record, "committed", None)
        if committed is not None and isinstance(committed.record, ModelRecord) and committed.record.task is not None:
            self.models[str(committed.record.task)] = {
                "stage_key": committed.record.stage_key,
                "blobs": {name: {field: committed.blobs[name][field] for field in ("sha256", "size")}
                          for name in self.BLOBS}}


def run_trial_pipeline(spec: SearchSpec, sampled: dict[str, Any], trial_id: str, report, start_after: int = 0,
                       emit=None) -> dict:
    """Run one trial's pipeline task by task; ``report(metrics, tasks_completed)`` after each reported task.

    start_after: tasks already reported (from a Tune checkpoint): they are neither re-run (their stages are
    committed) nor reported again. The last report also holds the run's result (``RESULT_KEY``) and its task models
    (``MODELS_KEY``), which the driver's tracking logs and registers. Returns the last reported metrics. Independent
    of Ray, so tests and users can run a trial in-process.
    """
    run_dir = spec.run_dir(trial_id)
    config = trial_config(spec.base_config, spec.space.get("fixed") or {}, sampled, run_dir,
                          source=f"trial {trial_id}", shared_store=spec.shared_store)
    graph = compile_scenario(resolve_run_precision(config))  # autocast: auto measured once, in the trial's process
    store = RunStore(run_dir)
    prepare_run(graph, store)
    cio.write_bytes(cio.join(run_dir, TRIAL_FILE), json.dumps({"trial_id": trial_id, "params": sampled},
                                                               indent=1, sort_keys=True).encode("utf-8"))
    collector = ModelCollector(emit or TrialLines(trial_id))
    engine = LocalExecutor(emit=collector, progress=False)
    strict = config.evaluation.strict
    first = first_reported_task(spec.objective)
    T = config.num_tasks
    last_metrics: dict = {}
    for task in range(T):
        # the engine up to row `task` (the last call completes the graph and writes matrix.json / metrics.json; the
        # reports follow before the last report: the driver logs them on completion)
        # the last task's call runs the whole graph, as `compat run` does: a stage no evaluation needs (a declared
        # third-party model no task loads) still belongs to the run, and only a complete graph has a result
        last = task == T - 1
        invocation = engine.run(graph, store, until=None if last else graph.evaluate_stages[: task + 1])
        if invocation.result is not None:
            write_store_reports(store)
        completed = task + 1
        if completed <= start_after or completed < first:
            continue
        values = matrix_values(store, graph.evaluate_stages[:completed])
        metrics = headline_metrics(values, strict)
        last_metrics = {OBJECTIVE_KEY: metrics[spec.objective], TIME_ATTR: completed, "num_tasks": T,
                        **metrics, "run_dir": run_dir,
                        "matrix_row": [float(v) for v in values[completed - 1, :completed]]}
        if last:
            if invocation.result is None:
                raise RuntimeError(f"trial {trial_id}: every task ran but the run in {run_dir} is not complete; "
                                   f"its result cannot be reported")
            # as JSON text: Tune's loggers keep text as it is instead of logging its numbers as metrics
            last_metrics.update({RESULT_KEY: invocation.result.to_json(),
                                 MODELS_KEY: json.dumps(collector.models, sort_keys=True)})
        report(last_metrics, completed)
    return last_metrics


def tune_trainable(config: dict, spec_json: str = "") -> None:
    """Ray Tune function trainable: ``config`` = the sampled values (dotted keys), the search in ``spec_json``."""
    import ray.tune as tune

    spec = SearchSpec.from_json(spec_json, "search spec")
    if spec.plugins:
        load_plugins(spec.plugins)
    if spec.storage.startswith("s3://") or spec.base_config.get("output", {}).get("dir", "").startswith("s3://"):
        configure_object_storage()
    trial_id = tune.get_context().get_trial_id()
    start_after = 0
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            start_after = int(json.loads(Path(folder, "progress.json").read_text())[TIME_ATTR])

    # Ray logs "Checkpoint successfully created at: ..." at INFO for every report: the driver's line per reported
    # task says it (cluster.tune.progress); its warnings and errors still show
    for name in CHECKPOINT_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)

    def report(metrics: dict, completed: int) -> None:
        with tempfile.TemporaryDirectory(prefix="compat-tune-ckpt-") as folder:
            Path(folder, "progress.json").write_text(json.dumps({TIME_ATTR: completed}))
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(folder))

    run_trial_pipeline(spec, dict(config), trial_id, report, start_after)


def trial_dirname(trial) -> str:
    """Tune trial folder name: ``trial-<id>`` (the default embeds the parameters, too long for dotted keys)."""
    return f"trial-{trial.trial_id}"

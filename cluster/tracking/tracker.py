"""Experiment tracking: pipeline records -> MLflow runs, metrics, artifacts and registered model versions.

This module owns the tracker interface and the MLflow tracker's runs (pipeline and stage scopes, resume); what each
record logs is in cluster.tracking.record_logging, stores and clients in cluster.tracking.client, params without secrets in
cluster.tracking.params.

Stages never call a tracker; they emit plain records (``StageEvent``, ``TrainRecord``, ``ProgressUpdate``) through
the executor's ``emit`` callback, and the engine emits the run's ``RunResult`` (matrix + metrics) once the graph is
complete. A :class:`Tracker` is such a callback::

    tracker = create_tracker(tracking_uri)                  # app.dispatch resolves it; None: a NullTracker
    with tracker.pipeline(graph, store):                    # parent run; FAILED (and re-raise) on an exception
        LocalExecutor(emit=ProgressReporter(sinks=[ReportWriter(store), tracker])).run(graph, store)

(``cluster.run_driver.run_tracked`` does this for the commands; ``ReportWriter`` writes the reports when the engine
emits the result, so that the tracker, closed with the executor, logs them.)

What MLflow holds (one experiment per scenario name):

- parent run (tag ``run_role=pipeline``): tags ``pipeline_id`` (founding config hash + absolute run folder, see
  cluster.tracking.run_identity), ``config_hash``, ``code_version``, ``scenario``, ``run_folder``, ``run_name``,
  ``overrides_digest``, ``scenario_aliases`` (whether the run may move the scenario's bare aliases);
  params = the validated config flattened with dot keys (secrets excluded, see :func:`flatten_params`); metrics
  ``compat/q{t}_g{k}`` = C[t, k] (query model t, gallery model k, **0-based** as in matrix.json) with step t;
  ``AC`` ``AA`` ``ACA`` ``BC`` ``FC`` (fractions, step T-1); ``AC_tau`` ``AA_tau`` with step = 0-based index of the
  last task of the prefix; ``task/final_loss`` ``task/images_per_s`` ``task/seconds`` ``task/selected_epoch``
  with step = 0-based task; artifacts ``results/`` (matrix.json, matrix.csv, metrics.json, report.md, PNGs).
- one nested run per stage (tag ``mlflow.parentRunId``; ``stage_key``, ``stage_kind``, ``stage_label``,
  ``task_0based``, ``task_1based``, ``ray_job_id`` under Ray): training metrics ``train/loss``,
  ``train/loss/<part>``, ``train/lr``, ``train/images_per_s``, ``train/epoch`` (0-based) with step = optimiser
  steps done in the task; ``stage/seconds``; model stages log ``model/`` (model.safetensors + config.json) and
  register it (see cluster.model_registry.versions); evaluate stages log their row's ``compat/q{t}_g{k}``.

Resuming: the parent run is found by tag ``pipeline_id`` (so only a run of the same folder and founding config) and
reopened. A run grown by appended tasks or replacements (pipelines.engine.growth) keeps the pipeline id of the config
it was started with, so it continues its parent run: new stage runs, the matrix metrics of the new row at its step,
the next registered version with ``parent_version`` naming the previous task's; see :meth:`_record_growth`. When it was still RUNNING, only a holder of the run folder's lease (pipelines.store.lease) continues it:
holding the lease proves the driver that ran it is gone, so the stage runs it left RUNNING are ended KILLED first
(tag ``ended_by``); a process without the lease is refused and marks nothing. A stage whose run is
FINISHED is not logged again; an interrupted (RUNNING/KILLED) stage run is reused; a FAILED stage run stays FAILED
as the record of that failure and the retry gets a new run with tag ``attempt`` incremented. A stage that was
committed without tracking (skipped now) gets a run backfilled from its stored record (no per-step metrics).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Iterator

from cluster.model_registry.versions import ensure_registered_model, registered_model_name
from cluster.tracking.client import ensure_experiment, log_metrics, log_params, open_client
from cluster.tracking.outage import RecordQueue, ServerWatch
from cluster.tracking.params import flatten_params
from cluster.tracking.record_logging import StageRecordLogging
from cluster.tracking.run_identity import (
    AS_WRITTEN,
    RunIntent,
    check_run_name,
    pipeline_id_of,
    run_location,
    run_name_of,
    scoped_alias,
    submitted_intent,
)
from cluster.tracking.ui import summary_placeholders
from pipelines.config.load import config_hash, config_to_dict
from pipelines.engine.events import StageEvent, StageRecord
from pipelines.engine.growth import read_growth
from pipelines.graph.stage_kind import StageKind
from pipelines.records.stage_records import CommittedStage
from pipelines.results.assemble import RunResult
from pipelines.store.lease import holds_lease

log = logging.getLogger(__name__)

_TERMINAL = ("FINISHED", "FAILED", "KILLED")


def ray_job_id() -> str | None:
    """The Ray job id when this process runs inside an initialised Ray (ray is never imported here)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    try:
        return str(ray.get_runtime_context().get_job_id())
    except Exception:  # noqa: BLE001 - a runtime without a job context (e.g. shutting down) has no id to report
        return None


def ray_submission_id() -> str | None:
    """The Ray Job *submission* id (what `compat submit`, `ray job status` and the dashboard show) when this
    process is a submitted job's entrypoint: Ray passes it in the job config's metadata."""
    text = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not text:
        return None
    try:
        metadata = json.loads(text).get("metadata") or {}
    except (json.JSONDecodeError, AttributeError):
        return None
    value = metadata.get("job_submission_id")
    return str(value) if value else None


# ---- interface -----------------------------------------------------------------------------------------------------
class Tracker:
    """Interface: an ``emit`` sink plus pipeline/stage scopes. This base class tracks nothing (the no-op tracker)."""

    def start(self, graph: Any, store: Any) -> None:
        """Open (or reopen, on a resume) the pipeline's tracking scope."""

    def __call__(self, record: Any) -> None:
        """Receive one emitted record (StageEvent, TrainRecord, ProgressUpdate, StageRecord, anything else)."""

    def finish(self, status: str | None = None) -> None:
        """End the pipeline: FINISHED when every stage is committed, KILLED when stopped early, else ``status``."""

    def close(self) -> None:
        """Called by executors at the end of ``run``; same as ``finish()``."""
        self.finish()

    @contextlib.contextmanager
    def pipeline(self, graph: Any, store: Any) -> Iterator["Tracker"]:
        """Scope of one executor invocation; an exception ends the pipeline as FAILED and is re-raised."""
        self.start(graph, store)
        try:
            yield self
        except BaseException as error:
            if not getattr(error, "lease_lost", False):  # a driver that lost its lease leaves the runs to the new one
                self.finish("FAILED")
            raise
        self.finish()


class NullTracker(Tracker):
    """Tracks nothing (``--tracking none``)."""


def create_tracker(uri: str | None, **options: Any) -> Tracker:
    """An MlflowTracker on ``uri`` (a target resolved once by :func:`cluster.tracking.store.resolve_tracking`), or a
    NullTracker when tracking is off (None). On an ``http(s)://`` server its records are sent by a worker thread
    (:class:`QueuedTracker`). options: :class:`MlflowTracker` keyword arguments."""
    if uri is None:
        return NullTracker()
    tracker = MlflowTracker(uri, **options)
    return QueuedTracker(tracker) if uri.startswith(("http://", "https://")) else tracker


# ---- MLflow --------------------------------------------------------------------------------------------------------
@dataclass
class _OpenStage:
    run_id: str
    stage: Any
    failed: bool = False


class MlflowTracker(StageRecordLogging, Tracker):
    """Turns pipeline records into MLflow (see the module doc for the layout).

    tracking_uri: ``sqlite:///PATH`` or ``http(s)://HOST:PORT``; with SQLite, artifacts go to ``<db folder>/
    mlartifacts`` (a server decides its own artifact store). experiment: default = scenario name. pipeline_id:
    default :func:`cluster.tracking.run_identity.pipeline_id_of` of the config and the absolute run folder.
    register_models: register every model stage in the model registry. intent: what the user asked for
    (:func:`cluster.tracking.run_identity.run_intent`; default: the config file as written).
    """

    def __init__(self, tracking_uri: str, experiment: str | None = None, pipeline_id: str | None = None,
                 register_models: bool = True, intent: RunIntent = AS_WRITTEN, run_name: str | None = None) -> None:
        self.tracking_uri = tracking_uri
        self.fixed_run_name = None if run_name is None else check_run_name(run_name)
        self.client = open_client(self.tracking_uri)  # a fresh SQLite store: one at a time
        self.experiment_name = experiment
        self.fixed_pipeline_id = pipeline_id
        self.register_models = register_models
        self.intent = intent
        self.graph: Any = None
        self.store: Any = None
        self.parent_run_id: str | None = None
        self.experiment_id: str | None = None
        self.pipeline_id: str | None = None
        self.config_hash: str | None = None
        self.growth: list[dict] = []  # the run folder's growth records (pipelines.engine.growth)
        self.model_name: str | None = None
        self.run_folder: str | None = None
        self.run_name: str | None = None
        self.scenario_aliases = intent.scenario_aliases
        self._stage_runs: dict[str, list[Any]] = {}
        self._open: dict[str, _OpenStage] = {}
        self._failed = False
        self._result: RunResult | None = None  # emitted by the engine once the graph is complete

    # ---- pipeline scope ----------------------------------------------------------------------------------------
    def start(self, graph: Any, store: Any) -> None:
        config = graph.config
        self.graph, self.store = graph, store
        self.config_hash = config_hash(config)
        self.run_folder = run_location(store.root)
        self.growth = read_growth(store)  # a grown run keeps the identity of the config it was started with
        founding = self.growth[0]["founding_config_hash"] if self.growth else self.config_hash
        self.pipeline_id = self.fixed_pipeline_id or pipeline_id_of(founding, self.run_folder)
        self.run_name = self.fixed_run_name or run_name_of(self.run_folder, self.pipeline_id)
        self.experiment_id = self._experiment(self.experiment_name or config.name)
        self._failed = False
        self._result = None
        self._open.clear()
        self.scenario_aliases = self.intent.scenario_aliases
        existing = self.client.search_runs(
            [self.experiment_id],
            f"tags.run_role = 'pipeline' and tags.pipeline_id = '{self.pipeline_id}'",
            order_by=["attributes.start_time ASC"], max_results=10)
        if existing:  # a resumed or grown run keeps the name (and alias prefix) it was started with
            kept = existing[0].data.tags.get("run_name", self.run_name)
            if self.fixed_run_name and self.fixed_run_name != kept:
                raise ValueError(f"--run-name {self.fixed_run_name}: the run in {self.run_folder} is named {kept!r} "
                                 f"(its aliases are {kept}__task-N); resume it without --run-name or with "
                                 f"--run-name {kept}")
            self.run_name = kept
        self._base_tags = self._identity_tags(graph)
        self._refuse_a_taken_run_name()
        if existing and existing[0].info.status == "RUNNING" and not holds_lease(store.root):
            raise RuntimeError(
                f"pipeline run {existing[0].info.run_id} of run folder {self.run_folder} is RUNNING and this process "
                f"does not hold the run folder's lease (pipelines.store.lease.run_lease): its driver may be alive; "
                f"take the lease before tracking (compat run / demo do), so a live run is never taken over")
        if existing:
            self._reopen_parent(existing[0])
            self._record_growth(existing[0], config)
        else:
            self._create_parent(config)
        self._stage_runs = self._load_stage_runs()
        if existing and existing[0].info.status == "RUNNING":
            self._reconcile_stale_runs()  # this process holds the lease: the driver that ran them is gone
        if self.register_models:
            self.model_name = registered_model_name(config.name, config.output.registered_model)
            ensure_registered_model(self.client, self.model_name, {"scenario": config.name})
            self._latest_task = -1  # latest-task follows this run's highest task (stages register in task order)

    def _refuse_a_taken_run_name(self) -> None:
        """A run name given with --run-name that another pipeline (another config or run folder) of this experiment
        already carries would let this run move that run's aliases: RuntimeError naming the other run folder."""
        if self.fixed_run_name is None:
            return
        others = [run for run in self.client.search_runs(
            [self.experiment_id], f"tags.run_role = 'pipeline' and tags.run_name = '{self.run_name}'", max_results=10)
            if run.data.tags.get("pipeline_id") != self.pipeline_id]
        if others:
            raise RuntimeError(f"--run-name {self.run_name}: already the name of pipeline run {others[0].info.run_id} "
                               f"(run folder {others[0].data.tags.get('run_folder')}); its registry aliases "
                               f"({scoped_alias(self.run_name, 'task-N')}) would be moved by this run: choose "
                               f"another name")

    def _identity_tags(self, graph: Any) -> dict[str, str]:
        """Tags of the parent and every stage run: who the run is (pipeline id, run folder and name, config hash,
        code version, the overrides' digest) and where it runs (Ray job, submission)."""
        submitted = submitted_intent()
        if submitted is False:
            self.scenario_aliases = False  # the submitter's overrides changed the config it named
        tags = {"pipeline_id": self.pipeline_id, "config_hash": self.config_hash,
                "code_version": graph.code_version, "scenario": graph.config.name, "run_folder": self.run_folder,
                "run_name": self.run_name, "overrides_digest": self.intent.overrides_digest}
        job = ray_job_id()
        if job:
            tags["ray_job_id"] = job
        submission = ray_submission_id()
        if submission:
            tags["ray_submission_id"] = submission
        return tags

    def _reopen_parent(self, run: Any) -> None:
        """Continue this run folder's own pipeline run; a resume keeps the intent the run was started with."""
        self.parent_run_id = run.info.run_id
        tags = run.data.tags
        if tags.get("scenario_aliases") == "false":
            self.scenario_aliases = False
        resumes = int(tags.get("resumes", "0")) + 1
        self.client.update_run(self.parent_run_id, status="RUNNING")
        self.client.set_tag(self.parent_run_id, "resumes", str(resumes))
        for key in ("ray_job_id", "ray_submission_id", "run_folder", "run_name"):
            if key in self._base_tags and tags.get(key) != self._base_tags[key]:
                self.client.set_tag(self.parent_run_id, key, self._base_tags[key])
        self._base_tags["scenario_aliases"] = str(self.scenario_aliases).lower()

    def _record_growth(self, run: Any, config: Any) -> None:
        """A grown run (appended tasks or replacements, pipelines.engine.growth) continues its pipeline run: tag
        ``config_hash`` becomes the grown config's, ``grown`` counts the growths, ``grown_from_config_hash`` names
        the previous config; params new to the config are logged, and the changed ones (MLflow params never change)
        go to the tag ``grown_params`` (``key: old -> new``)."""
        if run.data.tags.get("config_hash") == self.config_hash or not self.growth:
            return
        last = self.growth[-1]
        self.client.set_tag(self.parent_run_id, "config_hash", self.config_hash)
        self.client.set_tag(self.parent_run_id, "grown", str(len(self.growth)))
        self.client.set_tag(self.parent_run_id, "grown_from_config_hash", last["previous_config_hash"])
        params, _excluded = flatten_params(config_to_dict(config))
        logged = run.data.params
        log_params(self.client, self.parent_run_id, {key: value for key, value in params.items() if key not in logged})
        changed = [f"{key}: {logged[key]} -> {value}" for key, value in params.items()
                   if key in logged and str(logged[key]) != str(value)]
        if changed:
            self.client.set_tag(self.parent_run_id, "grown_params", "; ".join(changed)[:4900])

    def _create_parent(self, config: Any) -> None:
        self._base_tags["scenario_aliases"] = str(self.scenario_aliases).lower()
        run = self.client.create_run(self.experiment_id, tags={**self._base_tags, "run_role": "pipeline"},
                                     run_name=self.fixed_run_name or f"{config.name}-{self.pipeline_id[:8]}")
        self.parent_run_id = run.info.run_id
        # first metrics of the run: MLflow's compare-runs page plots the first metric the compared runs share
        log_metrics(self.client, self.parent_run_id, summary_placeholders(), step=0)
        params, excluded = flatten_params(config_to_dict(config))
        log_params(self.client, self.parent_run_id, params)
        if excluded:
            self.client.set_tag(self.parent_run_id, "params_excluded_as_secret", ",".join(sorted(excluded)))

    def finish(self, status: str | None = None) -> None:
        if status is not None and status not in _TERMINAL:
            raise ValueError(f"status: expected one of {_TERMINAL} or None, got {status!r}")
        if self.parent_run_id is None:
            return
        for key in list(self._open):
            self._end_stage(key, "FAILED" if status == "FAILED" else "KILLED")
        if status is None:
            complete = all(self.store.has(stage.key) for stage in self.graph)
            status = "FAILED" if self._failed else ("FINISHED" if complete else "KILLED")
        if status == "FINISHED":
            self._log_results(self._result)
            self._move_scenario_aliases()
        self.client.set_terminated(self.parent_run_id, status)
        self.parent_run_id = None

    # ---- records -----------------------------------------------------------------------------------------------
    def __call__(self, record: Any) -> None:
        if self.parent_run_id is None:
            raise RuntimeError("MlflowTracker received a record before start(graph, store) / pipeline(...) was "
                               "entered; wrap the executor run in `with tracker.pipeline(graph, store):`")
        stage_key = None
        if isinstance(record, StageRecord):
            stage_key, record = record.stage_key, record.record
        if isinstance(record, StageEvent):
            self._on_event(record)
        elif isinstance(record, RunResult):
            self._result = record
        elif _is_train_record(record):
            self._on_train_record(record, stage_key)

    def _on_event(self, event: Any) -> None:
        if event.kind == StageKind.ENTRY:
            return  # matrix entries are logged with their row (compat/q{t}_g{k}), not as T(T+1)/2 runs of their own
        if event.status == "started":
            self._open_stage(self.graph[event.stage_key])
        elif event.status == "done":
            self._complete_stage(event.stage_key, event.seconds, event.committed)
        elif event.status == "failed":
            if event.stage_key not in self._open:
                self._open_stage(self.graph[event.stage_key])
            self._end_stage(event.stage_key, "FAILED")
            self._failed = True
        elif event.status == "skipped":
            self._backfill(event.stage_key, event.committed)

    def _reconcile_stale_runs(self) -> None:
        """The pipeline run was still RUNNING when this resume started and this process holds the run folder's lease
        (checked by :meth:`start`): the driver that ran it is gone (the lease allows one live driver). Stage runs
        it left RUNNING are ended KILLED now (tag ``ended_by``) instead of staying RUNNING forever; the stages that
        run again reopen them, under the same parent run."""
        stale = [runs[-1] for runs in self._stage_runs.values()
                 if runs and runs[-1].info.status in ("RUNNING", "SCHEDULED")]
        for run in stale:
            self.client.set_tag(run.info.run_id, "ended_by",
                                "resume: the run folder's lease passed to this driver, so the driver that ran it is gone")
            self.client.set_terminated(run.info.run_id, "KILLED")
            self._refresh(run.data.tags["stage_key"], run.info.run_id)
        previous = int(self.client.get_run(self.parent_run_id).data.tags.get("stale_runs_killed", "0"))
        self.client.set_tag(self.parent_run_id, "stale_runs_killed", str(previous + len(stale)))
        if stale:
            log.warning("pipeline run %s: %d stage run(s) left RUNNING by a driver that died were marked KILLED",
                        self.parent_run_id, len(stale))

    # ---- stage runs --------------------------------------------------------------------------------------------
    def _load_stage_runs(self) -> dict[str, list[Any]]:
        runs: dict[str, list[Any]] = {}
        token = None
        while True:
            page = self.client.search_runs([self.experiment_id],
                                           f"tags.`mlflow.parentRunId` = '{self.parent_run_id}'",
                                           order_by=["attributes.start_time ASC"], max_results=1000, page_token=token)
            for run in page:
                key = run.data.tags.get("stage_key")
                if key:
                    runs.setdefault(key, []).append(run)
            token = page.token
            if not token:
                return runs

    def _stage_tags(self, stage: Any, attempt: int) -> dict[str, str]:
        tags = {**self._base_tags, "run_role": "stage", "mlflow.parentRunId": self.parent_run_id,
                "stage_key": stage.key, "stage_kind": stage.kind, "stage_label": stage.label, "attempt": str(attempt)}
        if stage.task is not None:
            tags["task_0based"] = str(stage.task)
            tags["task_1based"] = str(stage.task + 1)
        if stage.split:
            tags["split"] = stage.split
        if stage.name:
            tags["pretrain_name"] = stage.name
        job = ray_job_id()
        if job:
            tags["ray_job_id"] = job
        return tags

    def _open_stage(self, stage: Any) -> str:
        """The run of ``stage`` (reused when interrupted, new when absent or FAILED), set RUNNING."""
        runs = self._stage_runs.get(stage.key, [])
        last = runs[-1] if runs else None
        if last is not None and last.info.status in ("RUNNING", "KILLED", "SCHEDULED"):
            run_id = last.info.run_id
            self.client.update_run(run_id, status="RUNNING")
        else:
            attempt = len(runs) + 1
            run = self.client.create_run(self.experiment_id, tags=self._stage_tags(stage, attempt),
                                         run_name=stage.label)
            run_id = run.info.run_id
            self._stage_runs.setdefault(stage.key, []).append(run)
        self._open[stage.key] = _OpenStage(run_id, stage)
        return run_id

    def _end_stage(self, key: str, status: str) -> None:
        opened = self._open.pop(key, None)
        if opened is None:
            return
        self.client.set_terminated(opened.run_id, status)
        self._refresh(key, opened.run_id)

    def _refresh(self, key: str, run_id: str) -> None:
        runs = self._stage_runs.setdefault(key, [])
        fresh = self.client.get_run(run_id)
        for index, run in enumerate(runs):
            if run.info.run_id == run_id:
                runs[index] = fresh
                return
        runs.append(fresh)

    def _complete_stage(self, key: str, seconds: float | None, committed: CommittedStage | None) -> None:
        """Log the committed stage as the engine handed it (with "done", or "skipped" for a stage committed before
        this invocation) and end its run FINISHED. The store is read only for the blobs the tracker uploads."""
        if committed is None:
            raise ValueError(f"stage {key}: the engine's event carries no committed record; the tracker logs "
                             f"stages from the engine's events only (pipelines.engine.runner.run_graph)")
        if key not in self._open:
            self._open_stage(self.graph[key])
        opened = self._open[key]
        if seconds is not None:
            log_metrics(self.client, opened.run_id, {"stage/seconds": float(seconds)}, step=0)
        self._log_record(opened.stage, opened.run_id, committed)
        self._end_stage(key, "FINISHED")

    def _backfill(self, key: str, committed: CommittedStage | None) -> None:
        """A stage committed earlier: log it from its record unless a FINISHED run already holds it."""
        runs = self._stage_runs.get(key, [])
        if runs and runs[-1].info.status == "FINISHED":
            return
        self._open_stage(self.graph[key])
        self.client.set_tag(self._open[key].run_id, "backfilled", "true")
        self._complete_stage(key, None, committed)

    # ---- low level ---------------------------------------------------------------------------------------------
    def _experiment(self, name: str) -> str:
        return ensure_experiment(self.client, name)


class QueuedTracker(Tracker):
    """An :class:`MlflowTracker` on a server whose records go to MLflow from one worker thread, in order
    (:mod:`cluster.tracking.outage`): the stages never wait for the server, a server that stops answering is named
    within 10 s with what the run does meanwhile, and a line says when it answers again. Other attributes are the
    tracker's (``tracking_uri``, ``model_name``, ...)."""

    def __init__(self, tracker: MlflowTracker) -> None:
        self.tracker = tracker
        self.watch = ServerWatch(tracker.tracking_uri)
        self.records = RecordQueue(tracker, self.watch)

    def __getattr__(self, name: str) -> Any:
        if name == "tracker":
            raise AttributeError(name)
        return getattr(self.tracker, name)

    def start(self, graph: Any, store: Any) -> None:
        with self.watch.request(lambda back: "opening the run's tracking" if back
                                else "the run's first stage waits for the run's tracking to open"):
            self.tracker.start(graph, store)

    def __call__(self, record: Any) -> None:
        if self.tracker.parent_run_id is None:
            self.tracker(record)  # refused at once, naming the scope to enter
        self.records.put(record)

    def finish(self, status: str | None = None) -> None:
        """Send every queued record, then end the pipeline's runs (:meth:`MlflowTracker.finish`). A record the server
        did not take is raised here as a ConnectionError naming the server, unless the run already failed (its own
        error is the one to see)."""
        try:
            self.records.drain()
        except Exception as error:  # noqa: BLE001 - the worker kept it; said in one line at the end
            self.watch.close()
            if status == "FAILED":
                return
            raise ConnectionError(
                f"the MLflow tracking server at {self.watch.shown} did not take this run's records ({error}); its "
                f"stages are committed in the run folder: `compat run --resume` of the folder logs them once the "
                f"server answers") from error
        with self.watch.request(lambda back: "ending the run's tracking" if back
                                else "the run's stages are done; it ends once the server takes its last records"):
            self.tracker.finish(status)
        self.watch.close()


def _is_train_record(record: Any) -> bool:
    return all(hasattr(record, name) for name in ("task", "epoch", "step", "loss", "loss_parts", "lr", "images_per_s"))


__all__ = ["MlflowTracker", "NullTracker", "QueuedTracker", "Tracker", "create_tracker", "ray_job_id", "ray_submission_id"]

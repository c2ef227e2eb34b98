"""Experiment tracking: pipeline records -> MLflow runs, metrics, artifacts and registered model versions.

Stages never call a tracker; they emit plain records (``StageEvent``, ``TrainRecord``, ``ProgressUpdate``) through
the executor's ``emit`` callback. A :class:`Tracker` is such a callback::

    tracker = create_tracker(None, run_dir)                 # SQLite next to the run directory by default
    with tracker.pipeline(graph, store):                    # parent run; FAILED (and re-raise) on an exception
        LocalExecutor(emit=ProgressReporter(sinks=[tracker])).run(graph, store)

What MLflow holds (one experiment per scenario name):

- parent run (tag ``run_role=pipeline``): tags ``pipeline_id``, ``config_hash``, ``code_version``, ``scenario``;
  params = the validated config flattened with dot keys (secrets excluded, see :func:`flatten_params`); metrics
  ``compat/q{t}_g{k}`` = C[t, k] (query model t, gallery model k, **0-based** as in matrix.json) with step t;
  ``AC`` ``AA`` ``ACA`` ``BC`` ``FC`` (fractions, step T-1); ``AC_tau`` ``AA_tau`` with step = 0-based index of the
  last task of the prefix; ``task/final_loss`` ``task/images_per_s`` ``task/seconds`` ``task/selected_epoch``
  with step = 0-based task; artifacts ``results/`` (matrix.json, matrix.csv, metrics.json, report.md, PNGs).
- one nested run per stage (tag ``mlflow.parentRunId``; ``stage_key``, ``stage_kind``, ``stage_label``,
  ``task_0based``, ``task_1based``, ``ray_job_id`` under Ray): training metrics ``train/loss``,
  ``train/loss/<part>``, ``train/lr``, ``train/images_per_s``, ``train/epoch`` (0-based) with step = optimiser
  steps done in the task; ``stage/seconds``; model stages log ``model/`` (model.safetensors + config.json) and
  register it (see cluster.registry); evaluate stages log their row's ``compat/q{t}_g{k}``.

Resuming: the parent run is found by tags ``pipeline_id`` + ``config_hash`` and reopened (when it was still
RUNNING, its driver died: the stage runs it left RUNNING are ended KILLED first, tag ``ended_by``); a stage whose run is
FINISHED is not logged again; an interrupted (RUNNING/KILLED) stage run is reused; a FAILED stage run stays FAILED
as the record of that failure and the retry gets a new run with tag ``attempt`` incremented. A stage that was
committed without tracking (skipped now) gets a run backfilled from its stored record (no per-step metrics).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from pipelines.progress import StageRecord  # re-exported: executors and trackers share one record type
from pipelines.redaction import redact_uri, split_uri_credentials

log = logging.getLogger(__name__)

SECRET_KEY_PATTERN = re.compile(r"secret|password|passwd|token|access_key|secret_key|credential|api_key|private_key",
                                re.IGNORECASE)
_SECRET_VALUE_PATTERNS = (
    re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),                          # AWS access key id
    re.compile(r"^[a-z][a-z0-9+.-]*://[^/@:\s]+:[^/@\s]+@"),              # URL with user:password@
    re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\."),           # JWT
    re.compile(r"\b(ghp|gho|ghu|ghs|github_pat|hf|sk|xox[abprs])[_-][A-Za-z0-9_-]{16,}"),  # common API tokens
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
)
_HIGH_ENTROPY = re.compile(r"^[A-Za-z0-9+/=_-]{32,}$")
MAX_PARAM_VALUE = 6000  # characters MLflow 3 accepts for a param value
_TERMINAL = ("FINISHED", "FAILED", "KILLED")


# ---- params --------------------------------------------------------------------------------------------------------
def looks_like_secret(value: Any) -> bool:
    """True for strings shaped like credentials (AWS key ids, URLs with a password, JWTs, API tokens, private keys,
    or 32+ characters of base64 mixing upper case, lower case and digits; lower-case hex digests are not secrets)."""
    if not isinstance(value, str):
        return False
    if any(pattern.search(value) for pattern in _SECRET_VALUE_PATTERNS):
        return True
    return bool(_HIGH_ENTROPY.match(value) and re.search(r"[A-Z]", value) and re.search(r"[a-z]", value)
                and re.search(r"[0-9]", value))


def flatten_params(data: dict, prefix: str = "") -> tuple[dict[str, str], list[str]]:
    """Flatten a config dict to ``{"a.b.c": str value}`` (lists of scalars as JSON, lists of dicts by index).

    Returns (params, excluded keys). Excluded: keys matching :data:`SECRET_KEY_PATTERN` anywhere in the dotted
    path and values :func:`looks_like_secret`. Values longer than MLflow's 6000-character limit are truncated.
    """
    if not isinstance(data, dict):
        raise ValueError(f"flatten_params: expected a dict of config sections, got {type(data).__name__}")
    params: dict[str, str] = {}
    excluded: list[str] = []

    def visit(value: Any, key: str) -> None:
        if SECRET_KEY_PATTERN.search(key):
            excluded.append(key)
            return
        if isinstance(value, dict):
            if not value:
                params[key] = "{}"
            for child, item in value.items():
                visit(item, f"{key}.{child}" if key else str(child))
            return
        if isinstance(value, (list, tuple)) and any(isinstance(item, (dict, list, tuple)) for item in value):
            for index, item in enumerate(value):
                visit(item, f"{key}.{index}")
            return
        if isinstance(value, (list, tuple)):
            if any(looks_like_secret(item) for item in value):
                excluded.append(key)
                return
            text = json.dumps(list(value))
        elif looks_like_secret(value):
            excluded.append(key)
            return
        elif value is None:
            return  # unset options are not params (MLflow shows no "None" noise; defaults are in config.yaml)
        else:
            text = str(value)
        params[key] = text if len(text) <= MAX_PARAM_VALUE else text[: MAX_PARAM_VALUE - 3] + "..."

    visit(data, prefix)
    return params, excluded


def pipeline_id_of(config_hash: str, run_root: str) -> str:
    """Stable id of a pipeline = sha256 of (config hash, run root), 16 hex: the same run directory resumed keeps it."""
    from pipelines.config_load import stable_hash

    return stable_hash({"config_hash": config_hash, "run_root": run_root})[:16]


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


def ensure_experiment(client: Any, name: str) -> str:
    """Id of experiment ``name``, created when missing (concurrent creation tolerated). With a SQLite store its
    artifacts go to ``<db folder>/mlartifacts``, never to ./mlruns of whatever folder the command ran in."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is not None:
        if found.lifecycle_stage == "deleted":
            raise ValueError(f"experiment {name!r} is deleted on {redact_uri(client.tracking_uri)}; restore it "
                             f"(mlflow experiments restore) or choose another experiment name")
        return found.experiment_id
    location = None
    if client.tracking_uri.startswith("sqlite:///"):
        location = (Path(client.tracking_uri[len("sqlite:///"):]).parent / "mlartifacts").resolve().as_uri()
    try:
        return client.create_experiment(name, artifact_location=location)
    except MlflowException as error:
        if error.error_code != "RESOURCE_ALREADY_EXISTS":  # created concurrently by another driver
            raise
        return client.get_experiment_by_name(name).experiment_id


def default_tracking_uri(run_dir: str | os.PathLike) -> str:
    """``sqlite:///<absolute run dir>/mlflow.db``; a remote (s3://) run directory needs an explicit tracking URI."""
    text = os.fspath(run_dir)
    if re.match(r"^[a-z][a-z0-9+.-]*://", text):
        raise ValueError(f"tracking URI: run directory {text} is not local, so it cannot hold the default SQLite "
                         f"database; give a tracking URI (http(s)://host:port or sqlite:///path)")
    return f"sqlite:///{Path(text).resolve() / 'mlflow.db'}"


def project_tracking_uri(run_dir: str | os.PathLike) -> str:
    """Default store of ``compat run``: ``mlflow.db`` in the folder that HOLDS the run directory (``runs/mlflow.db``
    for the default ``runs/{name}``), shared by every run kept there, so runs of different scenarios (ER and
    d-Simplex-HOC) are compared in one MLflow UI; ``compat demo`` uses the same place for its two runs."""
    text = os.fspath(run_dir)
    if re.match(r"^[a-z][a-z0-9+.-]*://", text):
        default_tracking_uri(text)  # raises the error that names the remote folder
    return default_tracking_uri(Path(text).resolve().parent)


@contextlib.contextmanager
def sqlite_store_lock(tracking_uri: str) -> Iterator[None]:
    """Exclusive lock on ``<db>.lock`` next to a SQLite store (no-op for servers): two processes that open a new
    shared store at once would both run MLflow's schema migration, and one of them dies in it."""
    if not tracking_uri.startswith("sqlite:///"):
        yield
        return
    import fcntl

    database = Path(tracking_uri[len("sqlite:///"):])
    database.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{database}.lock", "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def check_tracking_uri(uri: str) -> str:
    """Accept ``sqlite:///PATH``, ``http://`` and ``https://`` tracking URIs; raise ValueError otherwise.

    A ``user:password@`` part is moved into MLflow's standard ``MLFLOW_TRACKING_USERNAME`` /
    ``MLFLOW_TRACKING_PASSWORD`` variables and the URI is returned without it, so the password is never printed,
    logged, stored in a search folder or sent to Ray with the URI (local Ray workers inherit the variables)."""
    if not isinstance(uri, str) or not re.match(r"^(sqlite:///.+|https?://[^/\s]+.*)$", uri):
        raise ValueError(f"tracking URI {redact_uri(uri)!r}: expected sqlite:///PATH or an http(s):// MLflow "
                         f"tracking server")
    clean, user, password = split_uri_credentials(uri)
    if user is not None:
        os.environ["MLFLOW_TRACKING_USERNAME"] = user
        os.environ["MLFLOW_TRACKING_PASSWORD"] = password or ""
    return clean


def open_client(tracking_uri: str, registry_uri: str | None = None) -> Any:
    """An MlflowClient for ``tracking_uri`` (checked; credentials moved out of the URI). A SQLite store is created or
    migrated under :func:`sqlite_store_lock` first, so processes that open a fresh store at once take turns."""
    from mlflow import MlflowClient

    tracking_uri = check_tracking_uri(tracking_uri)
    registry_uri = check_tracking_uri(registry_uri) if registry_uri else tracking_uri
    with contextlib.ExitStack() as locks:
        for uri in sorted(set((tracking_uri, registry_uri))):  # sorted: two stores are always locked in one order
            locks.enter_context(sqlite_store_lock(uri))  # no-op for servers
        # MLflow creates and migrates a SQLite store as the client (and its first registry call) opens it
        client = MlflowClient(tracking_uri=tracking_uri, registry_uri=registry_uri)
        if registry_uri.startswith("sqlite:///"):
            client.search_registered_models(max_results=1)
    return client


def tracking_credentials_from_environment() -> None:
    """``MLFLOW_TRACKING_URI`` with ``user:password@``: the credentials moved to MLflow's username / password
    variables and the variable rewritten without them (call once, before Ray starts: workers inherit both)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri and split_uri_credentials(uri)[1] is not None:
        os.environ["MLFLOW_TRACKING_URI"] = check_tracking_uri(uri)


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

    @contextlib.contextmanager
    def stage(self, stage: Any, seconds_hint: float | None = None) -> Iterator[None]:
        """Scope of one stage for executors that call the tracker directly; FAILED and re-raised on an exception."""
        yield


class NullTracker(Tracker):
    """Tracks nothing (``--tracking none``)."""


def create_tracker(uri: str | None, run_dir: str | os.PathLike | None = None, **options: Any) -> Tracker:
    """``"none"`` -> NullTracker; None -> MLFLOW_TRACKING_URI, else the machine's one store
    (cluster.tracking_store: every compat command of the machine in one MLflow UI); else that URI. run_dir is
    accepted for callers that name the run; the store no longer depends on it."""
    from cluster.tracking_store import default_tracking_uri as machine_default

    if uri == "none":
        return NullTracker()
    if uri is None:
        tracking_credentials_from_environment()
        uri = os.environ.get("MLFLOW_TRACKING_URI") or None
    return MlflowTracker(uri or machine_default(), **options)


# ---- MLflow --------------------------------------------------------------------------------------------------------
@dataclass
class _OpenStage:
    run_id: str
    stage: Any
    failed: bool = False


class MlflowTracker(Tracker):
    """Turns pipeline records into MLflow (see the module doc for the layout).

    tracking_uri: ``sqlite:///PATH`` or ``http(s)://HOST:PORT``; with SQLite, artifacts go to ``<db folder>/
    mlartifacts`` (a server decides its own artifact store). experiment: default = scenario name. pipeline_id:
    default :func:`pipeline_id_of`. register_models: register every model stage in the model registry.
    """

    def __init__(self, tracking_uri: str, registry_uri: str | None = None, experiment: str | None = None,
                 pipeline_id: str | None = None, register_models: bool = True) -> None:
        self.tracking_uri = check_tracking_uri(tracking_uri)
        self.registry_uri = check_tracking_uri(registry_uri) if registry_uri else self.tracking_uri
        self.client = open_client(self.tracking_uri, self.registry_uri)  # a fresh SQLite store: one at a time
        self.experiment_name = experiment
        self.fixed_pipeline_id = pipeline_id
        self.register_models = register_models
        self.graph: Any = None
        self.store: Any = None
        self.parent_run_id: str | None = None
        self.experiment_id: str | None = None
        self.pipeline_id: str | None = None
        self.config_hash: str | None = None
        self.model_name: str | None = None
        self._stage_runs: dict[str, list[Any]] = {}
        self._open: dict[str, _OpenStage] = {}
        self._failed = False

    # ---- pipeline scope ----------------------------------------------------------------------------------------
    def start(self, graph: Any, store: Any) -> None:
        from pipelines.config_load import config_hash, config_to_dict

        config = graph.config
        self.graph, self.store = graph, store
        self.config_hash = config_hash(config)
        self.pipeline_id = self.fixed_pipeline_id or pipeline_id_of(self.config_hash, store.root)
        self.experiment_id = self._experiment(self.experiment_name or config.name)
        self._failed = False
        self._open.clear()
        base_tags = {"pipeline_id": self.pipeline_id, "config_hash": self.config_hash,
                     "code_version": graph.code_version, "scenario": config.name}
        job = ray_job_id()
        if job:
            base_tags["ray_job_id"] = job
        submission = ray_submission_id()
        if submission:
            base_tags["ray_submission_id"] = submission
        self._base_tags = base_tags
        existing = self.client.search_runs(
            [self.experiment_id],
            f"tags.run_role = 'pipeline' and tags.pipeline_id = '{self.pipeline_id}' "
            f"and tags.config_hash = '{self.config_hash}'",
            order_by=["attributes.start_time ASC"], max_results=10)
        if existing:
            self.parent_run_id = existing[0].info.run_id
            resumes = int(existing[0].data.tags.get("resumes", "0")) + 1
            self.client.update_run(self.parent_run_id, status="RUNNING")
            self.client.set_tag(self.parent_run_id, "resumes", str(resumes))
            if job:
                self.client.set_tag(self.parent_run_id, "ray_job_id", job)
            if submission:
                self.client.set_tag(self.parent_run_id, "ray_submission_id", submission)
        else:
            run = self.client.create_run(self.experiment_id, tags={**base_tags, "run_role": "pipeline"},
                                         run_name=f"{config.name}-{self.pipeline_id[:8]}")
            self.parent_run_id = run.info.run_id
            params, excluded = flatten_params(config_to_dict(config))
            self._log_params(self.parent_run_id, params)
            if excluded:
                self.client.set_tag(self.parent_run_id, "params_excluded_as_secret", ",".join(sorted(excluded)))
        self._stage_runs = self._load_stage_runs()
        if existing and existing[0].info.status == "RUNNING":
            self._reconcile_stale_runs()
        if self.register_models:
            from cluster.registry import ensure_registered_model, registered_model_name

            self.model_name = registered_model_name(config.name, config.output.registered_model)
            ensure_registered_model(self.client, self.model_name, {"scenario": config.name})
            self._latest_task = -1  # latest-task follows this run's highest task (stages register in task order)

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
            self._log_results()
        self.client.set_terminated(self.parent_run_id, status)
        self.parent_run_id = None

    # ---- records -----------------------------------------------------------------------------------------------
    def __call__(self, record: Any) -> None:
        if self.parent_run_id is None:
            raise RuntimeError("MlflowTracker received a record before start(graph, store) / pipeline(...) was "
                               "entered; wrap the executor run in `with tracker.pipeline(graph, store):`")
        from pipelines.progress import StageEvent

        stage_key = None
        if isinstance(record, StageRecord):
            stage_key, record = record.stage_key, record.record
        if isinstance(record, StageEvent):
            self._on_event(record)
        elif _is_train_record(record):
            self._on_train_record(record, stage_key)

    def _on_event(self, event: Any) -> None:
        if event.kind == "entry":
            return  # matrix entries are logged with their row (compat/q{t}_g{k}), not as T(T+1)/2 runs of their own
        if event.status == "started":
            self._open_stage(self.graph[event.stage_key])
        elif event.status == "done":
            self._complete_stage(event.stage_key, event.seconds)
        elif event.status == "failed":
            if event.stage_key not in self._open:
                self._open_stage(self.graph[event.stage_key])
            self._end_stage(event.stage_key, "FAILED")
            self._failed = True
        elif event.status == "skipped":
            self._backfill(event.stage_key)

    @contextlib.contextmanager
    def stage(self, stage: Any, seconds_hint: float | None = None) -> Iterator[None]:
        """Open the stage run, yield, then log the committed record and end FINISHED; on an exception end FAILED."""
        self._open_stage(stage)
        started = time.perf_counter()
        try:
            yield
        except BaseException:
            self._end_stage(stage.key, "FAILED")
            self._failed = True
            raise
        self._complete_stage(stage.key, time.perf_counter() - started if seconds_hint is None else seconds_hint)

    def _reconcile_stale_runs(self) -> None:
        """The pipeline run was still RUNNING when this resume started: its driver died (the run-folder lease
        allows one live driver). Stage runs it left RUNNING are ended KILLED now (tag ``ended_by``) instead of
        staying RUNNING forever; the stages that run again reopen them, under the same parent run."""
        stale = [runs[-1] for runs in self._stage_runs.values()
                 if runs and runs[-1].info.status in ("RUNNING", "SCHEDULED")]
        for run in stale:
            self.client.set_tag(run.info.run_id, "ended_by", "resume: the driver that ran it is gone")
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

    def _complete_stage(self, key: str, seconds: float | None) -> None:
        if key not in self._open:
            self._open_stage(self.graph[key])
        opened = self._open[key]
        if seconds is not None:
            self._log_metrics(opened.run_id, {"stage/seconds": float(seconds)}, step=0)
        self._log_record(opened.stage, opened.run_id, self.store.load_manifest(key))
        self._end_stage(key, "FINISHED")

    def _backfill(self, key: str) -> None:
        """A stage committed earlier: log it from its record unless a FINISHED run already holds it."""
        runs = self._stage_runs.get(key, [])
        if runs and runs[-1].info.status == "FINISHED":
            return
        self._open_stage(self.graph[key])
        self.client.set_tag(self._open[key].run_id, "backfilled", "true")
        self._complete_stage(key, None)

    # ---- what each record logs ---------------------------------------------------------------------------------
    def _on_train_record(self, record: Any, stage_key: str | None) -> None:
        run_id = self._run_for_train_record(record, stage_key)
        if run_id is None:
            log.warning("training record of task %s not logged: no single open training stage to attribute it to",
                        getattr(record, "task", None))
            return
        values = {"train/loss": record.loss, "train/lr": record.lr, "train/images_per_s": record.images_per_s,
                  "train/epoch": record.epoch}
        values.update({f"train/loss/{name}": value for name, value in (record.loss_parts or {}).items()})
        values.update({f"train/{name}": value for name, value in (getattr(record, "metrics", None) or {}).items()})
        self._log_metrics(run_id, values, step=int(record.step))

    def _run_for_train_record(self, record: Any, stage_key: str | None) -> str | None:
        if stage_key is not None:
            opened = self._open.get(stage_key)
            return opened.run_id if opened else None
        training = [o for o in self._open.values() if o.stage.kind in ("pretrain", "finetune", "replace")]
        if len(training) > 1:
            training = [o for o in training if o.stage.task == getattr(record, "task", None)]
        return training[0].run_id if len(training) == 1 else None

    def _log_record(self, stage: Any, run_id: str, manifest: dict) -> None:
        from pipelines.records import AdaptersRecord, FeatureRecord, ModelRecord, RowRecord, record_from_json

        record = record_from_json(manifest["record"], stage.key)
        if isinstance(record, ModelRecord):
            self._log_model(stage, run_id, manifest, record)
            if record.weights:  # the external weights the stage started from: what loaded, what was ignored
                self.client.log_dict(run_id, record.weights, "weights/load_report.json")
                self.client.set_tag(run_id, "weights_sha256", str(record.weights.get("sha256")))
                self.client.set_tag(run_id, "weights_loaded",
                                    f"{record.weights.get('loaded')}/{record.weights.get('target_keys')}")
            training = record.training
            if stage.task is not None and training:
                values = {f"task/{name}": training[name] for name in
                          ("final_loss", "images_per_s", "seconds", "selected_epoch", "input_stall_fraction",
                           "first_step_seconds", "peak_device_memory_bytes") if training.get(name) is not None}
                self._log_metrics(self.parent_run_id, values, step=int(stage.task) + 1)  # 1-based task
        elif isinstance(record, FeatureRecord):
            self._log_metrics(run_id, {"extract/images_per_s": record.images_per_second,
                                       "extract/seconds": record.seconds,
                                       "extract/rows": record.layout.get("rows")}, step=0)
        elif isinstance(record, AdaptersRecord):
            self._log_adapters(stage, run_id, manifest)
        elif isinstance(record, RowRecord):
            row = record.row
            entries = {entry_metric_key(row, column): value for column, value in enumerate(record.values)}
            # on the row's own stage run only; the parent gets the whole matrix once, as a table and a figure
            self._log_metrics(run_id, entries, step=row + 1)

    def _log_model(self, stage: Any, run_id: str, manifest: dict, record: Any) -> None:
        from cluster.registry import (LATEST_ALIAS, MODEL_ARTIFACT_PATH, find_version, register_version, task_alias,
                                      write_model_folder)

        missing = [name for name in ("model.safetensors", "config.json") if name not in manifest["blobs"]]
        if missing:
            raise ValueError(f"stage {stage.label}: model record without {', '.join(missing)} in its manifest "
                             f"(blobs: {sorted(manifest['blobs'])})")
        with tempfile.TemporaryDirectory(prefix="compat-mlflow-model-") as folder:
            model_folder = write_model_folder(Path(folder, MODEL_ARTIFACT_PATH),
                                              self.store.read_blob(stage.key, "config.json", manifest),
                                              self.store.read_blob(stage.key, "model.safetensors", manifest))
            self.client.log_artifacts(run_id, str(model_folder), MODEL_ARTIFACT_PATH)
        sha256 = manifest["blobs"]["model.safetensors"]["sha256"]
        self.client.set_tag(run_id, "model_sha256", sha256)
        if not self.register_models:
            return
        tags = {"stage_kind": stage.kind, "line": record.line, "sha256": sha256,
                "pipeline_id": self.pipeline_id, "code_version": self.graph.code_version}
        aliases: list[str] = []
        if stage.kind == "pretrain":
            aliases.append(f"pretrain-{stage.name}")
        else:
            task = int(stage.task)
            tags.update(task_0based=task, task_1based=task + 1)
            aliases.append(task_alias(task))
            if task > 0:
                parent = find_version(self.client, self.model_name, self.graph.model_stages[task - 1])
                if parent is not None:
                    tags["parent_version"] = parent.version
            source = record.source
            if source:
                tags["external_source"] = source
                if source.startswith("pretrain:") and source[len("pretrain:"):] in self.graph.pretrain_stages:
                    origin = find_version(self.client, self.model_name,
                                          self.graph.pretrain_stages[source[len("pretrain:"):]])
                    if origin is not None:
                        tags["source_version"] = origin.version
            if task >= self._latest_task:  # this run's newest task model, even when an older run went further
                self._latest_task = task
                aliases.append(LATEST_ALIAS)
        version = register_version(self.client, self.model_name, run_id, stage.key, tags, aliases)
        self.client.set_tag(run_id, "registered_model", self.model_name)
        self.client.set_tag(run_id, "model_version", version.version)

    def _log_adapters(self, stage: Any, run_id: str, manifest: dict) -> None:
        """Adapter stage: cross-tests with/without each adapter, backfilling curves (step = percent
        re-embedded), adapter files as artifacts, each registered in ``<model>-adapters`` (alias KIND-task-N)."""
        from cluster.registry import ensure_registered_model, register_version

        record = manifest["record"]
        task = int(record["task"])
        values = {f"adapt/{name}/{part}": value for name, parts in record["baseline"].items()
                  for part, value in parts.items()}
        values["adapt/baseline/compatible"] = float(record["verdict"]["compatible"])
        for kind, result in record["adapters"].items():
            values.update({f"adapt/{kind}/cross_recall_at_1": result["cross_recall_at_1"],
                           f"adapt/{kind}/cross_map": result["cross_map"], f"adapt/{kind}/fit_loss": result["fit_loss"],
                           f"adapt/{kind}/compatible": float(result["verdict"]["compatible"]),
                           f"adapt/{kind}/margin": result["verdict"]["margin"]})
        self._log_metrics(run_id, values, step=task)
        for order, curve in record["backfill"].items():
            if not isinstance(curve, dict):
                continue
            for index, fraction in enumerate(curve["fraction"]):
                self._log_metrics(run_id, {f"backfill/{order}/{name}": curve[name][index] for name in curve
                                           if name != "fraction"}, step=int(round(100 * fraction)))
        names = [entry["blob"] for entry in record["adapters"].values() if entry["blob"] in manifest["blobs"]]
        with tempfile.TemporaryDirectory(prefix="compat-mlflow-adapters-") as folder:
            Path(folder, "adapters.json").write_text(json.dumps(record, indent=2))
            for name in names:
                Path(folder, name).write_bytes(self.store.read_blob(stage.key, name, manifest))
            self.client.log_artifacts(run_id, folder, "adapters")
        if not self.register_models or not names:
            return
        adapters_model = f"{self.model_name}-adapters"
        ensure_registered_model(self.client, adapters_model, {"pipeline_id": self.pipeline_id,
                                                             "models_of": self.model_name})
        for kind, entry in record["adapters"].items():
            sha256 = manifest["blobs"][entry["blob"]]["sha256"]
            register_version(self.client, adapters_model, run_id, f"{stage.key}/{kind}",
                             {"stage_kind": "adapt", "adapter": kind, "direction": entry["direction"],
                              "task_0based": task, "task_1based": task + 1, "sha256": sha256,
                              "compatible": str(entry["verdict"]["compatible"]).lower()},
                             [f"{kind}-task-{task + 1}"], artifact_path=f"adapters/{entry['blob']}")

    def _log_results(self) -> None:
        """Summary metrics and result files of a complete run, once per metrics.json content."""
        from compat_core import io as cio
        from pipelines.store import sha256_bytes

        try:
            metrics_text = self.store.read_text("metrics.json")
        except FileNotFoundError:
            log.warning("run %s has no metrics.json: summary metrics and reports not logged", self.store.root)
            return
        digest = sha256_bytes(metrics_text.encode("utf-8"))
        if self.client.get_run(self.parent_run_id).data.tags.get("results_sha256") == digest:
            return
        metrics = json.loads(metrics_text)
        last = int(metrics.get("num_tasks", 1)) - 1
        self._log_metrics(self.parent_run_id, {name: metrics.get(name) for name in ("AC", "AA", "ACA", "BC", "FC")},
                          step=max(last, 0) + 1)
        for name in ("AC_tau", "AA_tau"):
            for step, value in enumerate(metrics.get(name) or []):
                self._log_metrics(self.parent_run_id, {name: value}, step=step + 1)  # tau is 1-based
        self._log_matrix_table()
        with tempfile.TemporaryDirectory(prefix="compat-mlflow-results-") as folder:
            for name in ("matrix.json", "metrics.json", "matrix.csv", "report.md", "config.yaml"):
                uri = self.store.uri(name)
                if cio.exists(uri):
                    Path(folder, name).write_bytes(cio.read_bytes(uri))
            if not Path(folder, "matrix.csv").exists() and Path(folder, "matrix.json").exists():
                from compat_core.metrics import CompatibilityMatrix

                matrix = CompatibilityMatrix.from_json(Path(folder, "matrix.json").read_text())
                Path(folder, "matrix.csv").write_text(matrix.to_csv())
            root = self.store.uri()
            for name in cio.list_dir(root) if cio.is_dir(root) else []:
                if name.endswith(".png"):
                    Path(folder, name).write_bytes(cio.read_bytes(self.store.uri(name)))
            self.client.log_artifacts(self.parent_run_id, folder, "results")
            from cluster.tracking_ui import link_model_versions, log_comparable_images, show_headline_in_name

            log_comparable_images(self.client, self.parent_run_id, folder)
        show_headline_in_name(self.client, self.parent_run_id, metrics)
        link_model_versions(self.client, self.parent_run_id, self.model_name, self.pipeline_id)
        self.client.set_tag(self.parent_run_id, "results_sha256", digest)

    def _log_matrix_table(self) -> None:
        """The compatibility matrix as one MLflow table (rows: query task, 1-based; a column per gallery task),
        shown and compared in the UI's artifact view; the heatmap matrix.png goes with the results."""
        try:
            matrix = json.loads(self.store.read_text("matrix.json"))
        except FileNotFoundError:
            return
        values = matrix["values"]
        table = {"query_task": [row + 1 for row in range(len(values))]}
        for column in range(len(values)):
            table[f"gallery_task_{column + 1}"] = [row[column] for row in values]
        self.client.log_table(self.parent_run_id, data=table, artifact_file="results/matrix_table.json")

    # ---- low level ---------------------------------------------------------------------------------------------
    def _experiment(self, name: str) -> str:
        return ensure_experiment(self.client, name)

    def _log_params(self, run_id: str, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(key, value) for key, value in sorted(params.items())]
        for start in range(0, len(items), 100):  # MLflow accepts at most 100 params per batch
            self.client.log_batch(run_id, params=items[start:start + 100], synchronous=True)

    def _log_metrics(self, run_id: str, values: dict[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, int(step)) for key, value in values.items() if value is not None]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(run_id, metrics=metrics[start:start + 1000], synchronous=True)


def entry_metric_key(query_task: int, gallery_task: int) -> str:
    """Metric key of C[query_task, gallery_task]: ``compat/q{t}_g{k}`` with **0-based** task indices (matrix.json)."""
    if query_task < 0 or gallery_task < 0 or gallery_task > query_task:
        raise ValueError(f"compatibility entry ({query_task}, {gallery_task}): expected 0 <= gallery <= query")
    return f"compat/q{query_task}_g{gallery_task}"


def _is_train_record(record: Any) -> bool:
    return all(hasattr(record, name) for name in ("task", "epoch", "step", "loss", "loss_parts", "lr", "images_per_s"))


__all__ = [
    "Tracker", "NullTracker", "MlflowTracker", "StageRecord", "create_tracker", "flatten_params",
    "looks_like_secret", "pipeline_id_of", "ray_job_id", "default_tracking_uri", "project_tracking_uri",
    "sqlite_store_lock", "check_tracking_uri",
    "entry_metric_key", "SECRET_KEY_PATTERN",
]

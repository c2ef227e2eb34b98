"""Hyper-parameter search over whole compatible-learning pipelines: Ray Tune + Optuna, tracked in MLflow, resumable.

Each trial runs one (small) scenario pipeline with sampled values applied as config overrides, task by task: after
task ``t`` (1-based ``t`` tasks completed) the stages that row ``t - 1`` of the compatibility matrix needs are run
and the metrics of the leading ``t x t`` block are reported, so ASHA (``time_attr = tasks_completed``) can stop bad
trials early. Pair metrics (AC, ACA, BC, FC) are undefined with one model, so for those objectives the first report
comes after task 2; AA is reported from task 1.

Layout of a search (``<storage>/<name>``, a local folder or ``s3://bucket/prefix``)::

    search.json               what the search is (base config, space, objective, MLflow ids, plugins): resume reads it
    runs/<trial_id>/          the trial's pipeline run directory (RunStore: config.yaml, matrix.json, metrics.json, ...)
    runs/<trial_id>/trial.json  trial id and sampled parameters
    third-party/              third-party models shared by the trials (``output.shared_store``, unless the base
                              config names one): a sampled value that leaves a pretrain stage's key unchanged (a
                              method parameter, the fine-tuning schedule) reuses the model another trial trained
    <Tune's files>            experiment state, searcher state, trial folders with checkpoints

Pipelines' stages are committed to the trial's run directory, so a resumed trial re-runs nothing that was committed;
the Tune checkpoint only records how many tasks were reported.

MLflow (driver side, :class:`MlflowSearchCallback`): one parent run per search (tag ``run_role=search``), a nested
run per trial (``run_role=trial``, tag ``trial_id``) with the sampled parameters, per-task metrics (step = tasks
completed, 1-based count) and, when the trial finishes, ``results/`` (matrix.json, metrics.json, matrix.csv,
report.md, PNGs). After a complete search the best trial's models are registered in the registered model named
after the search, aliases ``best`` (last task's model) and ``best-task-<t>`` (1-based).
"""
from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import logging
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

SEARCH_FILE = "search.json"
RUNS_FOLDER = "runs"
SHARED_FOLDER = "third-party"  # <experiment>/third-party: the trials' shared third-party models
TRIAL_FILE = "trial.json"
TIME_ATTR = "tasks_completed"
OBJECTIVE_KEY = "objective"
# objective name on the command line -> metric key in metrics.json; all are maximised (BC/FC are gains)
OBJECTIVES = {"aca": "ACA", "ac": "AC", "aa": "AA", "bc": "BC", "fc": "FC"}
PAIR_METRICS = ("AC", "ACA", "BC", "FC")
BEST_ALIAS = "best"
COMPARE_TOP_TRIALS = 10
_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]+$")


def first_reported_task(metric: str) -> int:
    """1-based count of tasks after which ``metric`` is defined: 2 for pair metrics, 1 for AA."""
    return 2 if metric in PAIR_METRICS else 1


def objective_metric(name: str) -> str:
    """``aca`` -> ``ACA`` (case-insensitive); ValueError listing the valid names otherwise."""
    key = str(name).lower()
    if key not in OBJECTIVES:
        raise ValueError(f"--objective: unknown objective {name!r}; valid: {', '.join(OBJECTIVES)}")
    return OBJECTIVES[key]


# ---- plugins (extra datasets / methods registered in every trial process) --------------------------------------------
def load_plugins(specs: list[str]) -> None:
    """Import each plugin ``MODULE[:FUNCTION]`` or ``PATH.py[:FUNCTION]`` and call FUNCTION (no arguments) if given.

    Trials run in other processes (Ray workers), which only know what they import themselves: plugins are how a
    user's own datasets or methods get registered there. A path must be visible to every worker (absolute path).
    """
    for spec in specs:
        target, _, function = spec.partition(":") if not re.match(r"^[A-Za-z]:\\", spec) else (spec, "", "")
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise FileNotFoundError(f"plugin {spec!r}: file {target} does not exist")
            name = f"compat_plugin_{path.stem}"
            module = sys.modules.get(name)
            if module is None:
                module_spec = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(module_spec)
                sys.modules[name] = module
                module_spec.loader.exec_module(module)
        else:
            try:
                module = importlib.import_module(target)
            except ModuleNotFoundError as error:
                raise ModuleNotFoundError(f"plugin {spec!r}: cannot import {target!r} ({error})") from None
        if function:
            hook = getattr(module, function, None)
            if not callable(hook):
                raise AttributeError(f"plugin {spec!r}: {target} has no callable {function!r}")
            hook()


def absolute_plugin(spec: str) -> str:
    """A ``PATH.py[:FUNCTION]`` plugin made absolute (trials change their working directory); modules unchanged."""
    target, sep, function = spec.partition(":")
    if target.endswith(".py"):
        return str(Path(target).resolve()) + sep + function
    return spec


# config keys whose values may be local paths (data roots, external weights, the shared third-party store)
PATH_KEYS = frozenset({"root", "init", "source", "shared_store", "initial_model"})
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")   # s3://, file://, models:/, runs:/, pretrain:<name>


def absolute_local_paths(value: Any, cwd: Path, key: str | None = None) -> Any:
    """A copy of a config document (or of one value under ``key``) whose relative local paths under ``PATH_KEYS``
    are made absolute against ``cwd``; URIs and ``pretrain:<name>`` stay as they are.

    Tune runs each trial in its own working folder, so a relative ``output.shared_store: runs/demo/third-party``
    named a different folder per trial (measured: the demo search's 8 trials each trained its third-party model,
    under Ray's session folder) and a relative data root would not be found at all."""
    if isinstance(value, dict):
        return {k: absolute_local_paths(v, cwd, k) for k, v in value.items()}
    if isinstance(value, list):
        return [absolute_local_paths(v, cwd, key) for v in value]
    if (key in PATH_KEYS and isinstance(value, str) and value and not _SCHEME.match(value)
            and not Path(value).is_absolute()):
        return str((cwd / value).resolve())
    return value


def absolute_fixed_values(fixed: dict[str, Any], cwd: Path) -> dict[str, Any]:
    """``absolute_local_paths`` for a search space's ``fixed`` mapping (dotted keys: the last part names the field)."""
    return {dotted: absolute_local_paths(value, cwd, dotted.rsplit(".", 1)[-1]) for dotted, value in fixed.items()}


# ---- configs of trials -----------------------------------------------------------------------------------------------
def apply_values(document: dict, values: dict[str, Any]) -> dict:
    """A copy of ``document`` with each ``dotted.key -> value`` set (same addressing as ``--set``)."""
    from pipelines.config_load import apply_override

    result = copy.deepcopy(document)
    for key, value in values.items():
        apply_override(result, f"{key}={json.dumps(value)}")
    return result


def trial_config(base: dict, space_fixed: dict[str, Any], sampled: dict[str, Any], run_dir: str,
                 source: str = "<trial>", shared_store: str | None = None):
    """Validated ScenarioConfig of one trial: base config, then the space's fixed values, then the sampled ones.

    shared_store: ``output.shared_store`` of the trial when the config names none (the search's third-party folder:
    trials whose sampled values leave a third-party model's key unchanged train it once).

    When the trial's ``method.name`` differs from the base config's, the base ``method.params`` are dropped first
    (they belong to the base method; the space supplies the new method's own, e.g. through ``when`` conditions).
    """
    from pipelines.config_load import validate_config

    values = {**space_fixed, **sampled}
    if "method.name" in values and values["method.name"] != base.get("method", {}).get("name"):
        base = {**base, "method": {**base.get("method", {}), "params": {}}}
    document = apply_values(base, values)
    output = document.setdefault("output", {})
    output["dir"] = run_dir
    if shared_store and not output.get("shared_store"):
        output["shared_store"] = shared_store
    return validate_config(document, source)


def check_space_against_config(base: dict, space) -> int:
    """Validate the config at every representative point of the space (typos fail before any trial starts).

    Returns the number of points checked. Raises ConfigError naming the space point and the bad key.
    """
    from pipelines.config_load import ConfigError

    points = space.representative_points()
    for point in points:
        try:
            trial_config(base, space.fixed, point, "/tmp/compat-check", source=f"config with {point}")
        except ConfigError as error:
            raise ConfigError(f"search space {space.source}: {error}") from None
    return len(points)


# ---- the search description ----------------------------------------------------------------------------------------
@dataclass
class SearchSpec:
    """Everything a search needs, JSON-serialisable (stored as ``search.json``; resume and trials read it).

    base_config: the resolved scenario config (dict). space: the space mapping (cluster.search_space grammar).
    objective: metric key (ACA, AC, AA, BC, FC), maximised. samples: trials in all. concurrent: trials at once.
    scheduler: ``asha`` or ``none``. seed: Optuna sampler seed. storage: storage root (local absolute path or
    s3:// URI); the experiment lives in ``<storage>/<name>``. resources: per trial, ``{"cpu": float, "gpu": float}``.
    """

    name: str
    base_config: dict
    space: dict
    objective: str = "ACA"
    samples: int = 8
    concurrent: int = 1
    scheduler: str = "asha"
    seed: int = 0
    storage: str = ""
    resources: dict = field(default_factory=lambda: {"cpu": 1.0, "gpu": 0.0})
    plugins: list[str] = field(default_factory=list)
    tracking_uri: str | None = None
    mlflow_experiment: str | None = None
    parent_run_id: str | None = None
    created: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_PATTERN.match(self.name):
            raise ValueError(f"search name {self.name!r}: expected letters, digits, '_', '.', '-' only")
        if self.objective not in OBJECTIVES.values():
            raise ValueError(f"objective: expected one of {sorted(OBJECTIVES.values())}, got {self.objective!r}")
        for key in ("samples", "concurrent"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{key}: expected an integer >= 1, got {value!r}")
        if self.scheduler not in ("asha", "none"):
            raise ValueError(f"--scheduler: expected asha or none, got {self.scheduler!r}")
        for key in ("cpu", "gpu"):
            value = self.resources.get(key, 0)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"resources.{key}: expected a number >= 0 per trial, got {value!r}")

    @property
    def experiment_path(self) -> str:
        """Where Tune keeps the experiment: ``<storage>/<name>`` (URI or absolute local path)."""
        from compat_core import io as cio

        return cio.join(self.storage, self.name)

    @property
    def runs_root(self) -> str:
        from compat_core import io as cio

        return cio.join(self.experiment_path, RUNS_FOLDER)

    @property
    def shared_store(self) -> str:
        """``<experiment>/third-party``: the store of third-party models the trials share (``output.shared_store``)."""
        from compat_core import io as cio

        return cio.join(self.experiment_path, SHARED_FOLDER)

    def run_dir(self, trial_id: str) -> str:
        from compat_core import io as cio

        return cio.join(self.runs_root, trial_id)

    @property
    def num_tasks(self) -> int:
        """Tasks of every trial: the base config's, after the space's ``fixed`` overrides (which may set tasks.spec)."""
        from pipelines.config import parse_increments

        document = apply_values(self.base_config, dict((self.space or {}).get("fixed") or {}))
        return len(parse_increments(document["tasks"]["spec"]))

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str = SEARCH_FILE) -> "SearchSpec":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{source}: not valid JSON ({error})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a JSON object describing the search")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {unknown}")
        missing = sorted({"name", "base_config", "space"} - set(data))
        if missing:
            raise ValueError(f"{source}: missing key(s) {missing}")
        return cls(**data)


MARKER_FILE = "compat-tune.json"


def write_spec(spec: SearchSpec) -> str:
    """Write ``search.json`` and the marker that says `compat tune` created this folder (with its sha256)."""
    import hashlib

    from compat_core import io as cio

    data = spec.to_json().encode("utf-8")
    uri = cio.write_bytes(cio.join(spec.experiment_path, SEARCH_FILE), data)
    marker = {"created_by": "compat tune", "search_sha256": hashlib.sha256(data).hexdigest()}
    cio.write_bytes(cio.join(spec.experiment_path, MARKER_FILE), json.dumps(marker).encode("utf-8"))
    return uri


def check_marker(experiment_path: str) -> None:
    """Refuse a folder that `compat tune` did not create (or whose search.json changed since): ``--resume``
    unpickles Ray Tune's experiment state from it, so only folders this tool wrote, from a trusted location, may
    be resumed. Raises PermissionError naming the folder."""
    import hashlib

    from compat_core import io as cio

    marker_uri = cio.join(str(experiment_path), MARKER_FILE)
    search_uri = cio.join(str(experiment_path), SEARCH_FILE)
    missing = [name for name, uri in ((MARKER_FILE, marker_uri), (SEARCH_FILE, search_uri)) if not cio.exists(uri)]
    if missing:
        raise PermissionError(f"--resume {experiment_path}: {' and '.join(missing)} missing there; only a folder "
                              f"created by `compat tune` can be resumed (resuming unpickles its Tune state)")
    try:
        marker = json.loads(cio.read_bytes(marker_uri).decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        marker = {}
    actual = hashlib.sha256(cio.read_bytes(search_uri)).hexdigest()
    if marker.get("created_by") != "compat tune" or marker.get("search_sha256") != actual:
        raise PermissionError(f"--resume {experiment_path}: {SEARCH_FILE} does not match {MARKER_FILE} (sha256 "
                              f"{actual}); the folder was changed outside `compat tune` and is not resumed")


def check_local_folder_private(experiment_path: str) -> None:
    """Refuse to resume a local search folder another user can write (its Tune state is unpickled on resume):
    the folder and its state files must be owned by this user and not group- or world-writable."""
    import stat

    if str(experiment_path).startswith("s3://"):
        return  # the bucket policy decides who writes there
    root = Path(experiment_path)
    if not root.is_dir():
        return  # the marker check names the missing folder
    for path in [root, *sorted(root.glob("*.json")), *sorted(root.glob("*/*.pkl")), *sorted(root.glob("*.pkl"))]:
        info = path.lstat()
        if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise PermissionError(f"--resume {experiment_path}: {path} is writable by another user (owner uid "
                                  f"{info.st_uid}, mode {stat.filemode(info.st_mode)}); resuming unpickles the "
                                  f"search state, so only a folder private to you is resumed")


def read_spec(experiment_path: str) -> SearchSpec:
    """The SearchSpec stored in ``<experiment_path>/search.json`` (FileNotFoundError naming the path otherwise)."""
    from compat_core import io as cio

    path = cio.join(str(experiment_path), SEARCH_FILE)
    if not cio.exists(path):
        raise FileNotFoundError(f"{path}: missing; {experiment_path} is not a search started by `compat tune`")
    return SearchSpec.from_json(cio.read_bytes(path).decode("utf-8"), path)


# ---- the trainable ---------------------------------------------------------------------------------------------------
def _log_emit(record: Any) -> None:
    """Stage events of a trial go to the trial's log (its stdout is collected by Ray)."""
    status = getattr(record, "status", None)
    if status in ("done", "failed"):
        log.info("%s %s", getattr(record, "label", record), status)


def run_trial_pipeline(spec: SearchSpec, sampled: dict[str, Any], trial_id: str, report, start_after: int = 0,
                       emit=None) -> dict:
    """Run one trial's pipeline task by task; ``report(metrics, tasks_completed)`` after each reported task.

    start_after: tasks already reported (from a Tune checkpoint): they are neither re-run (their stages are
    committed) nor reported again. Returns the last reported metrics. Independent of Ray, so tests and users can run
    a trial in-process.
    """
    from compat_core import io as cio
    from pipelines.executor import LocalExecutor, headline_metrics, prepare_run
    from pipelines.graph import compile_scenario
    from pipelines.records import read_record
    from pipelines.store import RunStore

    run_dir = spec.run_dir(trial_id)
    config = trial_config(spec.base_config, spec.space.get("fixed") or {}, sampled, run_dir,
                          source=f"trial {trial_id}", shared_store=spec.shared_store)
    graph = compile_scenario(config)
    store = RunStore(run_dir)
    prepare_run(config, store)
    cio.write_bytes(cio.join(run_dir, TRIAL_FILE), json.dumps({"trial_id": trial_id, "params": sampled},
                                                               indent=1, sort_keys=True).encode("utf-8"))
    engine = LocalExecutor(emit=emit or _log_emit, progress=False)
    strict = config.evaluation.strict
    first = first_reported_task(spec.objective)
    T = config.num_tasks
    last_metrics: dict = {}
    for task in range(T):
        # the engine up to row `task` (the last call completes the graph and writes matrix.json / metrics.json /
        # reports before the last report: the driver logs them on completion)
        engine.run(graph, store, until=graph.evaluate_stages[: task + 1])
        completed = task + 1
        if completed <= start_after or completed < first:
            continue
        values = np.full((completed, completed), np.nan)
        for row in range(completed):
            values[row, : row + 1] = read_record(store, graph.evaluate_stages[row]).values
        metrics = headline_metrics(values, strict)
        last_metrics = {OBJECTIVE_KEY: metrics[spec.objective], TIME_ATTR: completed, "num_tasks": T,
                        **metrics, "run_dir": run_dir,
                        "matrix_row": [float(v) for v in values[completed - 1, :completed]]}
        report(last_metrics, completed)
    return last_metrics


def tune_trainable(config: dict, spec_json: str = "") -> None:
    """Ray Tune function trainable: ``config`` = the sampled values (dotted keys), the search in ``spec_json``."""
    import ray.tune as tune

    spec = SearchSpec.from_json(spec_json, "search spec")
    if spec.plugins:
        load_plugins(spec.plugins)
    if spec.storage.startswith("s3://") or spec.base_config.get("output", {}).get("dir", "").startswith("s3://"):
        from cluster.storage import configure_object_storage

        configure_object_storage()
    trial_id = tune.get_context().get_trial_id()
    start_after = 0
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            start_after = int(json.loads(Path(folder, "progress.json").read_text())[TIME_ATTR])

    def report(metrics: dict, completed: int) -> None:
        with tempfile.TemporaryDirectory(prefix="compat-tune-ckpt-") as folder:
            Path(folder, "progress.json").write_text(json.dumps({TIME_ATTR: completed}))
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(folder))

    run_trial_pipeline(spec, dict(config), trial_id, report, start_after)


def trial_dirname(trial) -> str:
    """Tune trial folder name: ``trial-<id>`` (the default embeds the parameters, too long for dotted keys)."""
    return f"trial-{trial.trial_id}"


# ---- MLflow ----------------------------------------------------------------------------------------------------------
def _callback_class():
    """The Tune callback class, built on first use so that importing this module does not import Ray (slow)."""
    existing = globals().get("_MLFLOW_CALLBACK_CLASS")
    if existing is not None:
        return existing
    from ray.tune import Callback

    cls = type("MlflowSearchCallback", (_MlflowSearchCallbackMixin, Callback), {"__module__": __name__})
    cls.__doc__ = _MlflowSearchCallbackMixin.__doc__
    globals()["_MLFLOW_CALLBACK_CLASS"] = cls
    return cls


def __getattr__(name: str):
    # pickle finds the class as ``cluster.tune.MlflowSearchCallback`` (Tune stores callbacks with the experiment)
    if name == "MlflowSearchCallback":
        return _callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _MlflowSearchCallbackMixin:
    """Driver-side Tune callback: a nested MLflow run per trial under the search's parent run.

    Picklable (Tune stores callbacks with the experiment): only ids and URIs are kept; the client is rebuilt.
    """

    def __init__(self, tracking_uri: str, experiment_id: str, parent_run_id: str, search_name: str, objective: str,
                 num_tasks: int) -> None:
        self.tracking_uri = tracking_uri
        self.experiment_id = experiment_id
        self.parent_run_id = parent_run_id
        self.search_name = search_name
        self.objective = objective
        self.num_tasks = num_tasks
        self._client = None
        self._runs: dict[str, str] = {}

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_client"] = None
        state["_runs"] = {}
        return state

    @property
    def client(self):
        if self._client is None:
            from cluster.tracking import open_client

            self._client = open_client(self.tracking_uri)
        return self._client

    def run_for(self, trial) -> str:
        """MLflow run id of ``trial`` (created on first use; found again by tag after a resume)."""
        trial_id = trial.trial_id
        if trial_id in self._runs:
            return self._runs[trial_id]
        found = self.client.search_runs([self.experiment_id],
                                        f"tags.run_role = 'trial' and tags.trial_id = '{trial_id}' "
                                        f"and tags.search = '{self.search_name}'", max_results=1)
        if found:
            run_id = found[0].info.run_id
            if found[0].info.status != "RUNNING":
                self.client.update_run(run_id, status="RUNNING")
        else:
            from cluster.tracking import flatten_params

            run = self.client.create_run(self.experiment_id, run_name=f"trial-{trial_id}", tags={
                "mlflow.parentRunId": self.parent_run_id, "run_role": "trial", "trial_id": trial_id,
                "search": self.search_name, "objective_metric": self.objective})
            run_id = run.info.run_id
            params, _ = flatten_params({key: value for key, value in (trial.config or {}).items()})
            self._log_params(run_id, params)
        self._runs[trial_id] = run_id
        return run_id

    def on_trial_start(self, iteration, trials, trial, **info):
        self.run_for(trial)

    def on_trial_result(self, iteration, trials, trial, result, **info):
        from mlflow.entities import Metric

        run_id = self.run_for(trial)
        step = int(result.get(TIME_ATTR, 0))
        now = int(time.time() * 1000)
        values = {key: result.get(key) for key in (OBJECTIVE_KEY, "AC", "AA", "ACA", "BC", "FC")}
        metrics = [Metric(key, float(value), now, step) for key, value in values.items() if value is not None]
        if metrics:
            self.client.log_batch(run_id, metrics=metrics, synchronous=True)

    def on_trial_complete(self, iteration, trials, trial, **info):
        run_id = self.run_for(trial)
        result = trial.last_result or {}
        finished = int(result.get(TIME_ATTR, 0)) >= self.num_tasks
        if finished and result.get("run_dir"):
            self._log_results(run_id, result["run_dir"])
        else:
            self.client.set_tag(run_id, "early_stopped", "true")
        self.client.set_terminated(run_id, "FINISHED" if finished else "KILLED")

    def on_trial_error(self, iteration, trials, trial, **info):
        self.client.set_terminated(self.run_for(trial), "FAILED")

    def _log_results(self, run_id: str, run_dir: str) -> None:
        from compat_core import io as cio

        with tempfile.TemporaryDirectory(prefix="compat-tune-results-") as folder:
            for name in cio.list_dir(run_dir):
                if name in ("matrix.json", "metrics.json", "matrix.csv", "report.md", "config.yaml", TRIAL_FILE) \
                        or name.endswith(".png"):
                    Path(folder, name).write_bytes(cio.read_bytes(cio.join(run_dir, name)))
            self.client.log_artifacts(run_id, folder, "results")

    def _log_params(self, run_id: str, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(key, value) for key, value in sorted(params.items())]
        for start in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[start:start + 100], synchronous=True)


def open_search_run(spec: SearchSpec) -> tuple[str, str]:
    """Create (or reopen on resume) the search's parent MLflow run; returns (experiment_id, parent_run_id)."""
    from cluster.tracking import flatten_params, open_client

    client = open_client(spec.tracking_uri)
    experiment_name = spec.mlflow_experiment or f"{spec.base_config['name']}-search"
    found = client.get_experiment_by_name(experiment_name)
    if found is None:
        location = None
        if spec.tracking_uri.startswith("sqlite:///"):
            location = (Path(spec.tracking_uri[len("sqlite:///"):]).parent / "mlartifacts").resolve().as_uri()
        experiment_id = client.create_experiment(experiment_name, artifact_location=location)
    else:
        experiment_id = found.experiment_id
    if spec.parent_run_id:
        client.update_run(spec.parent_run_id, status="RUNNING")
        return experiment_id, spec.parent_run_id
    run = client.create_run(experiment_id, run_name=spec.name, tags={
        "run_role": "search", "search": spec.name, "objective_metric": spec.objective,
        "scenario": spec.base_config.get("name", ""), "storage": spec.experiment_path})
    params, _ = flatten_params({"search": {"objective": spec.objective, "samples": spec.samples,
                                           "concurrent": spec.concurrent, "scheduler": spec.scheduler,
                                           "seed": spec.seed},
                                "space": {key: json.dumps(value) for key, value in spec.space["parameters"].items()}})
    from mlflow.entities import Param

    items = [Param(k, v) for k, v in sorted(params.items())]
    for start in range(0, len(items), 100):
        client.log_batch(run.info.run_id, params=items[start:start + 100], synchronous=True)
    return experiment_id, run.info.run_id


def register_best_models(spec: SearchSpec, best_trial_id: str, trial_run_id: str) -> Any:
    """Register every task model of the best trial (aliases ``best-task-<t>``, 1-based) and ``best`` = the last one.

    The model files are logged to the trial's MLflow run under ``model/task-<t>``. Returns the ``best`` version.
    """
    from mlflow import MlflowClient

    from cluster.registry import ensure_registered_model, register_version, write_model_folder
    from pipelines.records import read_record
    from pipelines.store import RunStore

    client = MlflowClient(tracking_uri=spec.tracking_uri)
    store = RunStore(spec.run_dir(best_trial_id))
    # the models are found from the committed records, not by recompiling the graph: stage keys hash the code
    # version, which may differ between the trial's process and this one
    model_keys: dict[int, str] = {}
    for key in store.stage_keys():
        if key.startswith(("finetune-", "replace-")):
            model_keys[read_record(store, key).task] = key
    if sorted(model_keys) != list(range(spec.num_tasks)):
        raise FileNotFoundError(f"{store.root}: expected models of tasks 0..{spec.num_tasks - 1} (0-based), "
                                f"found {sorted(model_keys)}")
    ensure_registered_model(client, spec.name, {"search": spec.name, "objective_metric": spec.objective})
    version = None
    for task, key in sorted(model_keys.items()):
        manifest = store.load_manifest(key)
        artifact_path = f"model/task-{task + 1}"
        with tempfile.TemporaryDirectory(prefix="compat-tune-model-") as folder:
            model_folder = write_model_folder(Path(folder, "model"), store.read_blob(key, "config.json", manifest),
                                              store.read_blob(key, "model.safetensors", manifest))
            client.log_artifacts(trial_run_id, str(model_folder), artifact_path)
        aliases = [f"best-task-{task + 1}"] + ([BEST_ALIAS] if task == spec.num_tasks - 1 else [])
        version = register_version(client, spec.name, trial_run_id, key, {
            "trial_id": best_trial_id, "task_0based": task, "task_1based": task + 1,
            "sha256": manifest["blobs"]["model.safetensors"]["sha256"]}, aliases, artifact_path=artifact_path)
    client.set_tag(spec.parent_run_id, "best_trial_id", best_trial_id)
    client.set_tag(spec.parent_run_id, "best_model_uri", f"models:/{spec.name}@{BEST_ALIAS}")
    return version


# ---- running a search ------------------------------------------------------------------------------------------------
@dataclass
class TrialOutcome:
    """One trial of a finished (or interrupted) search: final objective (fraction, None if never reported)."""

    trial_id: str
    params: dict
    objective: float | None
    tasks_completed: int
    status: str
    run_dir: str


@dataclass
class SearchOutcome:
    """What :func:`run_search` / :func:`resume_search` did. trials: best first (None objectives last)."""

    spec: SearchSpec
    trials: list[TrialOutcome]
    complete: bool
    best: TrialOutcome | None
    best_version: Any = None


def _storage(spec: SearchSpec):
    """(storage_path, storage_filesystem) for Tune: local absolute path, or the configured S3 filesystem."""
    from compat_core import io as cio

    if spec.storage.startswith("s3://"):
        from cluster.storage import configure_object_storage

        configure_object_storage()
        filesystem, path = cio.resolve(spec.storage)
        return path, filesystem
    return spec.storage, None


def _trainable(spec: SearchSpec):
    import ray.tune as tune

    resources = {"cpu": float(spec.resources.get("cpu", 1.0)), "gpu": float(spec.resources.get("gpu", 0.0))}
    return tune.with_resources(tune.with_parameters(tune_trainable, spec_json=spec.to_json()), resources)


def _callbacks(spec: SearchSpec, experiment_id: str) -> list:
    return [_callback_class()(spec.tracking_uri, experiment_id, spec.parent_run_id, spec.name, spec.objective,
                                 spec.num_tasks)]


_AWS_SECRET_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SECURITY_TOKEN", "AWS_SESSION_TOKEN")


def keep_credentials_out_of_trial_runtime_env() -> None:
    """Ray Tune copies the driver's AWS key variables into every trial actor's ``runtime_env``, which Ray's
    runtime-env agent writes to a world-readable log: stop that. Trials take credentials from the standard AWS chain
    of their node instead (local workers inherit the environment of the Ray instance started here; on a cluster,
    each node's environment, profile or instance role)."""
    try:
        from ray.tune.execution import class_cache
    except ImportError:  # another Ray layout: nothing of ours to remove
        return
    propagated = getattr(class_cache, "ENV_VARS_TO_PROPAGATE", None)
    if isinstance(propagated, set):
        propagated.difference_update(_AWS_SECRET_VARIABLES)


def _ensure_ray(address: str | None) -> None:
    import ray

    keep_credentials_out_of_trial_runtime_env()

    if ray.is_initialized():
        return
    if address:
        from cluster.ray_loopback import prepare_for_address

        prepare_for_address(address)  # a head on 127.0.0.1: keep this driver on loopback too
        from cluster.ray_auth import prepare_client_auth

        prepare_client_auth()  # a token in Ray's standard places authenticates to a token-protected head
        ray.init(address=address, configure_logging=False)
    else:
        from cluster.ray_loopback import prepare_loopback

        prepare_loopback()
        # address "local": a new embedded instance, never another process's cluster on this machine
        ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1", configure_logging=False,
                 object_store_memory=300 * 1024 * 1024)


def default_resources(config, concurrent: int) -> dict:
    """Per-trial resources: the config's fine-tuning stage resources; GPUs default to 1 each when Ray has GPUs.

    On a CPU-only machine trials share the CPUs: ``min(num_cpus, cluster CPUs / concurrent)`` each (fractional).
    """
    import ray

    stage = config.resources.finetune
    cluster = ray.cluster_resources() if ray.is_initialized() else {}
    gpus = stage.num_gpus if stage.num_gpus is not None else (1.0 if cluster.get("GPU", 0) > 0 else 0.0)
    cpus = float(stage.num_cpus)
    if cluster.get("CPU"):
        cpus = min(cpus, float(cluster["CPU"]) / concurrent)
    return {"cpu": round(cpus, 3), "gpu": float(gpus)}


def make_sampler(space, seed: int):
    """Optuna sampler of a search: a seeded brute-force enumeration (every combination once, in a seeded random
    order: no repeated trial) when every parameter is an unconditional categorical; seeded TPE otherwise."""
    import optuna

    parameters = list(getattr(space, "parameters", []))
    if parameters and all(p.type == "categorical" and not p.when for p in parameters):
        return optuna.samplers.BruteForceSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def optuna_searcher(space, samples: int, seed: int):
    """Ray Tune's OptunaSearch for ``space`` (maximising the objective) with :func:`make_sampler`'s sampler; a
    budget smaller than a finite grid enqueues a spread-out, seeded choice of grid points as its trials
    (cluster.grid_design) instead of letting the enumeration spend it in one corner of the grid."""
    from ray.tune.search.optuna import OptunaSearch

    from cluster.grid_design import spread_points

    return OptunaSearch(space=space, metric=OBJECTIVE_KEY, mode="max", sampler=make_sampler(space, seed),
                        points_to_evaluate=spread_points(space, samples, seed) or None)


def run_search(spec: SearchSpec, address: str | None = None, extra_callbacks: list | None = None) -> SearchOutcome:
    """Start a new search described by ``spec`` (search.json written first), run it to the end or an interruption."""
    import ray.tune as tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search import ConcurrencyLimiter

    from cluster.search_space import parse_space

    if spec.plugins:
        load_plugins(spec.plugins)
    space = parse_space(spec.space, f"search {spec.name} space")
    check_space_against_config(spec.base_config, space)
    if spec.objective in PAIR_METRICS and spec.num_tasks < 2:
        raise ValueError(f"--objective {spec.objective}: a pair metric needs at least 2 tasks; the scenario has "
                         f"{spec.num_tasks} (use --objective aa)")
    storage_path, filesystem = _storage(spec)
    from compat_core import io as cio

    if cio.exists(cio.join(spec.experiment_path, SEARCH_FILE)):
        raise FileExistsError(f"{spec.experiment_path} already holds a search; continue it with "
                              f"`compat tune --resume {spec.experiment_path}` or choose another --name")
    _ensure_ray(address)
    if spec.tracking_uri is None:
        from cluster.tracking_store import default_tracking_uri

        spec.tracking_uri = default_tracking_uri()  # MLFLOW_TRACKING_URI, else the machine's one store
    from cluster.tracking import check_tracking_uri

    spec.tracking_uri = check_tracking_uri(spec.tracking_uri)  # never a password in search.json or trial params
    if spec.tracking_uri.startswith("sqlite:///"):
        Path(spec.tracking_uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    experiment_id, spec.parent_run_id = open_search_run(spec)
    write_spec(spec)

    searcher = ConcurrencyLimiter(optuna_searcher(space, spec.samples, spec.seed), max_concurrent=spec.concurrent)
    scheduler = None
    if spec.scheduler == "asha":
        first = first_reported_task(spec.objective)
        scheduler = ASHAScheduler(time_attr=TIME_ATTR, max_t=spec.num_tasks, grace_period=min(first, spec.num_tasks),
                                  reduction_factor=2)
    tuner = tune.Tuner(
        _trainable(spec),
        # concurrency is the ConcurrencyLimiter's alone (also giving it to TuneConfig makes Tune wrap it twice)
        tune_config=tune.TuneConfig(metric=OBJECTIVE_KEY, mode="max", search_alg=searcher, scheduler=scheduler,
                                    num_samples=spec.samples,
                                    trial_dirname_creator=trial_dirname, trial_name_creator=trial_dirname),
        run_config=tune.RunConfig(
            name=spec.name, storage_path=storage_path, storage_filesystem=filesystem,
            callbacks=_callbacks(spec, experiment_id) + list(extra_callbacks or []),
            failure_config=tune.FailureConfig(max_failures=0), verbose=1),
    )
    results = tuner.fit()
    return _finish(spec, results)


def resume_search(experiment_path: str, address: str | None = None, plugins: list[str] | None = None) -> SearchOutcome:
    """Continue an interrupted search (Tuner.restore with the searcher's saved state) up to its requested trials.

    Finished trials are kept as they are; unfinished ones resume from their last Tune checkpoint and their committed
    pipeline stages; errored ones are resumed too. ``plugins`` come from the command line only: the ones search.json
    records are never imported (anyone who can write the folder could name any code there); a search started with
    plugins is refused unless the same ones are given again.
    """
    import ray.tune as tune

    experiment_path = str(experiment_path).rstrip("/")
    if not experiment_path.startswith("s3://"):
        experiment_path = str(Path(experiment_path).resolve())
    if experiment_path.startswith("s3://"):
        from cluster.storage import configure_object_storage

        configure_object_storage()
    check_local_folder_private(experiment_path)
    check_marker(experiment_path)
    spec = read_spec(experiment_path)
    given = [absolute_plugin(p) for p in plugins or []]
    absent = [p for p in spec.plugins if p not in given]
    if absent:
        raise ValueError(f"--resume {experiment_path}: the search was started with --plugin {' --plugin '.join(absent)}; "
                         f"give the same --plugin again (plugins are imported from the command line only, never from "
                         f"the search folder)")
    spec.plugins = given  # trials import what this command line names, nothing else
    if spec.plugins:
        load_plugins(spec.plugins)
    storage_path, filesystem = _storage(spec)
    _ensure_ray(address)
    restore_path = experiment_path if filesystem is None else f"{storage_path.rstrip('/')}/{spec.name}"
    if not tune.Tuner.can_restore(restore_path, storage_filesystem=filesystem):
        raise FileNotFoundError(f"--resume {experiment_path}: no Tune experiment state there (was it interrupted "
                                f"before the first trial started?)")
    open_search_run(spec)
    tuner = tune.Tuner.restore(restore_path, trainable=_trainable(spec), resume_unfinished=True,
                               resume_errored=True, storage_filesystem=filesystem)
    results = tuner.fit()
    return _finish(spec, results)


def _finish(spec: SearchSpec, results) -> SearchOutcome:
    """Collect trials, register the best trial's models when the search is complete, close the parent run."""
    from mlflow import MlflowClient

    trials = []
    for result in results:
        metrics = result.metrics or {}
        trial_id = metrics.get("trial_id") or Path(result.path).name.removeprefix("trial-")
        status = "ERROR" if result.error else ("FINISHED" if metrics.get(TIME_ATTR) == spec.num_tasks
                                               else "STOPPED")
        objective = metrics.get(OBJECTIVE_KEY)
        trials.append(TrialOutcome(trial_id, dict(result.config or {}),
                                   None if objective is None or not math.isfinite(objective) else float(objective),
                                   int(metrics.get(TIME_ATTR) or 0), status, spec.run_dir(trial_id)))
    statuses = [getattr(t, "status", None) for t in results._experiment_analysis.trials]
    complete = len(statuses) >= spec.samples and all(s in ("TERMINATED", "ERROR") for s in statuses)
    trials.sort(key=lambda t: (t.objective is None, -(t.objective or 0.0)))
    finished = [t for t in trials if t.status == "FINISHED" and t.objective is not None]
    best = finished[0] if finished else None
    client = MlflowClient(tracking_uri=spec.tracking_uri)
    version = None
    if complete:
        if best is not None:
            found = client.search_runs([client.get_run(spec.parent_run_id).info.experiment_id],
                                       f"tags.trial_id = '{best.trial_id}' and tags.search = '{spec.name}'",
                                       max_results=1)
            if found:
                version = register_best_models(spec, best.trial_id, found[0].info.run_id)
            client.log_metric(spec.parent_run_id, f"best_{OBJECTIVE_KEY}", best.objective)
        client.set_terminated(spec.parent_run_id, "FINISHED")
    else:
        client.set_terminated(spec.parent_run_id, "KILLED")
        log.warning("search %s interrupted after %d trial(s); continue with `compat tune --resume %s`", spec.name,
                    len(trials), spec.experiment_path)
    return SearchOutcome(spec, trials, complete, best, version)


# ---- `compat compare` of a search ------------------------------------------------------------------------------------
def load_search_summaries(path: Path, top: int = COMPARE_TOP_TRIALS) -> list:
    """RunSummary of the ``top`` finished trials of a local search directory, best objective first."""
    from pipelines.reports_compare import load_run_summary

    spec = read_spec(str(path))
    runs = Path(path) / RUNS_FOLDER
    rows = []
    for run_dir in sorted(runs.iterdir()) if runs.is_dir() else []:
        if not (run_dir / "metrics.json").is_file():
            continue  # stopped early or unfinished: no full matrix to compare
        summary = load_run_summary(run_dir)
        trial = json.loads((run_dir / TRIAL_FILE).read_text()) if (run_dir / TRIAL_FILE).is_file() else {}
        params = ", ".join(f"{key.rsplit('.', 1)[-1]}={_short(value)}"
                           for key, value in sorted((trial.get("params") or {}).items()))
        summary.name = f"trial {run_dir.name}" + (f" ({params})" if params else "")
        summary.label = summary.name
        rows.append(summary)
    objective = spec.objective
    rows.sort(key=lambda s: (math.isnan(s.metrics[objective]), -np.nan_to_num(s.metrics[objective], nan=0.0)))
    return rows[:top]


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def register_run_source() -> None:
    """Let ``compat compare`` read a search directory (``search.json``): its top trials, best objective first."""
    from pipelines.reports_compare import RUN_SOURCES, RunSource

    if "tune-experiment" in RUN_SOURCES.names():
        return
    RUN_SOURCES.register("tune-experiment", RunSource(
        description=f"a `compat tune` search directory ({SEARCH_FILE} + runs/<trial>/): top trials by objective",
        matches=lambda path: (Path(path) / SEARCH_FILE).is_file(),
        load=lambda path: load_search_summaries(Path(path))))


__all__ = [
    "SearchSpec", "SearchOutcome", "TrialOutcome", "OBJECTIVES",
    "first_reported_task", "objective_metric", "load_plugins", "apply_values", "trial_config",
    "check_space_against_config", "run_trial_pipeline", "tune_trainable", "run_search", "resume_search",
    "register_best_models", "load_search_summaries", "register_run_source", "read_spec", "write_spec",
    "default_resources",
]

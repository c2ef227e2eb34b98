"""Hyper-parameter search over whole compatible-learning pipelines: Ray Tune + Optuna, tracked in MLflow, resumable.
This module runs a search (new or resumed) and reads a finished one for `compat compare`; what a search is lives in
cluster.tune.spec, a trial in cluster.tune.trial, its MLflow side in cluster.tune.tracking.

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

MLflow (driver side, ``cluster.tune.tracking.MlflowSearchCallback``): one parent run per search (tag
``run_role=search``), a nested run per trial (``run_role=trial``, tag ``trial_id``) with the sampled parameters,
per-task metrics (step = tasks completed, 1-based count) and, when the trial finishes, ``results/`` (matrix.json,
metrics.json, matrix.csv, report.md, PNGs). After a complete search the best trial's models are registered in the
registered model named after the search, aliases ``best`` (last task's model) and ``best-task-<t>`` (1-based).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cluster.ray.auth import prepare_client_auth, token_for_embedded_ray
from cluster.ray.embedded import start_embedded
from cluster.ray.loopback import prepare_for_address, prepare_loopback
from cluster.ray.memory_check import check_cluster_memory
from cluster.ray.reach import require_answering, require_reachable
from cluster.storage.s3 import configure_object_storage
from cluster.tune.grid import spread_points
from cluster.tune.progress import progress_callback_class
from cluster.tune.search_space import parse_space
from cluster.tune.spec import (
    COMPARE_TOP_TRIALS,
    OBJECTIVE_KEY,
    PAIR_METRICS,
    RUNS_FOLDER,
    SEARCH_FILE,
    TIME_ATTR,
    TRIAL_FILE,
    SearchSpec,
    absolute_plugin,
    check_local_folder_private,
    check_marker,
    check_space_against_config,
    first_reported_task,
    load_plugins,
    read_spec,
    seal_tuner_state,
    trial_config,
    write_spec,
)
from cluster.tune.tracking import (
    mark_best_trial,
    mlflow_callback_class,
    open_search_run,
    params_text,
    register_best_models,
)
from cluster.tune.trial import trial_dirname, tune_trainable
from compat_core import io as cio
from pipelines.reports.compare import RUN_SOURCES, RunSource
from pipelines.results.run_files import load_run

log = logging.getLogger(__name__)


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
    if spec.storage.startswith("s3://"):
        configure_object_storage()
        filesystem, path = cio.resolve(spec.storage)
        return path, filesystem
    return spec.storage, None


def _trainable(spec: SearchSpec):
    import ray.tune as tune

    resources = {"cpu": float(spec.resources.get("cpu", 1.0)), "gpu": float(spec.resources.get("gpu", 0.0))}
    return tune.with_resources(tune.with_parameters(tune_trainable, spec_json=spec.to_json()), resources)


def _callbacks(spec: SearchSpec, experiment_id: str) -> list:
    return [mlflow_callback_class()(spec.tracking_uri, experiment_id, spec.parent_run_id, spec.name,
                                    spec.objective, spec.num_tasks),
            progress_callback_class()(spec.objective, spec.num_tasks, spec.samples)]


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


def ensure_ray(address: str | None) -> None:
    """Connect this driver to Ray for a search: the cluster at ``address`` (its port checked to open and answer
    first), else a new embedded local instance; nothing when Ray is already initialised."""
    import ray

    keep_credentials_out_of_trial_runtime_env()

    if ray.is_initialized():
        return
    if address:
        if address != "auto":
            port = 10001 if address.startswith("ray://") else 6379
            require_reachable(address, "Ray cluster", port)
            require_answering(address, "Ray cluster", port)  # a port that never answers would hang ray.init
        prepare_for_address(address)  # a head on 127.0.0.1: keep this driver on loopback too
        prepare_client_auth()  # a token in Ray's standard places authenticates to a token-protected head
        ray.init(address=address, configure_logging=False)
    else:
        prepare_loopback()
        token_for_embedded_ray()  # Ray itself would write a missing token file readable by every user
        # address "local": a new embedded instance, never another process's cluster on this machine
        start_embedded(object_store_memory=300 * 1024 * 1024)


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
    # the study's "created in memory" line and the sampler's "experimental" warning are about our choice, not the
    # user's; Optuna's warnings and errors still show
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if parameters and all(p.type == "categorical" and not p.when for p in parameters):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.BruteForceSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


@contextlib.contextmanager
def tune_output():
    """Ray Tune without its own start-up box ("Configuration for experiment", "View detailed results here"):
    the driver prints a line per trial event (:mod:`cluster.tune.progress`). Tune's new output engine prints that
    box whatever the verbosity; its classic reporter at verbosity 0 prints nothing but errors (failed trials are
    still logged and raised). A ``RAY_AIR_NEW_OUTPUT`` the user set is kept."""
    import os

    if "RAY_AIR_NEW_OUTPUT" in os.environ:
        yield
        return
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    try:
        yield
    finally:
        os.environ.pop("RAY_AIR_NEW_OUTPUT", None)


def optuna_searcher(space, samples: int, seed: int):
    """Ray Tune's OptunaSearch for ``space`` (maximising the objective) with :func:`make_sampler`'s sampler; a
    budget smaller than a finite grid enqueues a spread-out, seeded choice of grid points as its trials
    (cluster.tune.grid) instead of letting the enumeration spend it in one corner of the grid."""
    from ray.tune.search.optuna import OptunaSearch

    return OptunaSearch(space=space, metric=OBJECTIVE_KEY, mode="max", sampler=make_sampler(space, seed),
                        points_to_evaluate=spread_points(space, samples, seed) or None)


def run_search(spec: SearchSpec, address: str | None = None, extra_callbacks: list | None = None) -> SearchOutcome:
    """Start a new search described by ``spec`` (search.json written first), run it to the end or an interruption."""
    import ray.tune as tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search import ConcurrencyLimiter

    if spec.plugins:
        load_plugins(spec.plugins)
    space = parse_space(spec.space, f"search {spec.name} space")
    check_space_against_config(spec.base_config, space)
    if spec.objective in PAIR_METRICS and spec.num_tasks < 2:
        raise ValueError(f"--objective {spec.objective}: a pair metric needs at least 2 tasks; the scenario has "
                         f"{spec.num_tasks} (use --objective aa)")
    storage_path, filesystem = _storage(spec)

    if cio.exists(cio.join(spec.experiment_path, SEARCH_FILE)):
        raise FileExistsError(f"{spec.experiment_path} already holds a search; continue it with "
                              f"`compat tune --resume {spec.experiment_path}` or choose another --name")
    if spec.tracking_uri is None:
        raise ValueError("--tracking-uri none: a search tracks every trial in MLflow; name a store, or leave the "
                         "option out for this machine's store")
    ensure_ray(address)
    check_trials_memory(spec, space)  # before the search's MLflow run and search.json: nothing to clean up
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
            failure_config=tune.FailureConfig(max_failures=0), verbose=0),  # lines: cluster.tune.progress
    )
    seal_tuner_state(spec.experiment_path)  # tuner.pkl is written by tune.Tuner(...), before any trial
    with tune_output():
        results = tuner.fit()
    return _finish(spec, results)


MEMORY_KEYS = ("model", "training", "pretrain", "replacements", "data", "device", "method")


def check_trials_memory(spec: SearchSpec, space) -> None:
    """The memory preflight of a search: the training stages of the base config and of every representative point
    of the space (both ends of each range, every categorical value) against the largest Ray node that can hold one
    trial (its ``cpu`` / ``gpu``), before any trial starts (cluster.ray.memory_check; each trial alone: trials
    running at once on one node share its memory)."""
    import ray

    nodes = ray.nodes()
    request = {"num_cpus": float(spec.resources.get("cpu", 1.0)), "num_gpus": float(spec.resources.get("gpu", 0.0))}
    seen = set()
    for point in [{}] + space.representative_points():
        config = trial_config(spec.base_config, space.fixed, point, "/tmp/compat-check",
                              source=f"config with {point}")
        identity = config.model_dump_json(include=set(MEMORY_KEYS))
        if identity not in seen:
            seen.add(identity)
            check_cluster_memory(config, nodes, [request], config.resources.autoscaling)


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
    ensure_ray(address)
    restore_path = experiment_path if filesystem is None else f"{storage_path.rstrip('/')}/{spec.name}"
    if not tune.Tuner.can_restore(restore_path, storage_filesystem=filesystem):
        raise FileNotFoundError(f"--resume {experiment_path}: no Tune experiment state there (was it interrupted "
                                f"before the first trial started?)")
    try:
        tuner = tune.Tuner.restore(restore_path, trainable=_trainable(spec), resume_unfinished=True,
                                   resume_errored=True, storage_filesystem=filesystem)
    except (AttributeError, ImportError, pickle.UnpicklingError) as error:
        if not saved_by_other_code(error):
            raise
        raise ValueError(
            f"--resume {experiment_path}: Ray Tune's saved state of this search names code that this version of "
            f"compat does not have ({error}); the search was started by another version, and Tune restores a "
            f"search only with the code that started it. Its finished trials stay readable (`compat compare "
            f"{experiment_path}`); to go on, start a new search: `compat tune CONFIG --space SPACE --objective "
            f"{spec.objective.lower()} --samples {spec.samples} --storage {spec.storage} --name NEW_NAME`") from error
    open_search_run(spec)  # after the state loaded: a refused resume leaves the search's MLflow run as it was
    with tune_output():
        results = tuner.fit()
    return _finish(spec, results)


def saved_by_other_code(error: BaseException) -> bool:
    """Whether unpickling Tune's saved state failed because a class or module it names is gone (moved or renamed
    in another version of the code), rather than for another reason."""
    if isinstance(error, (ModuleNotFoundError, pickle.UnpicklingError)):
        return True
    return isinstance(error, AttributeError) and "Can't get attribute" in str(error)  # pickle's lookup by name


def _finish(spec: SearchSpec, results) -> SearchOutcome:
    """Collect trials, register the best trial's models when the search is complete, close the parent run."""
    from mlflow import MlflowClient

    trials = []
    reported: dict[str, dict] = {}  # trial id -> its last report
    for result in results:
        metrics = result.metrics or {}
        trial_id = metrics.get("trial_id") or Path(result.path).name.removeprefix("trial-")
        reported[trial_id] = metrics
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
                version = register_best_models(spec, best.trial_id, found[0].info.run_id, reported[best.trial_id])
                mark_best_trial(client, spec, found[0].info.run_id, best.objective)
            client.log_metric(spec.parent_run_id, f"best_{OBJECTIVE_KEY}", best.objective)
        client.set_terminated(spec.parent_run_id, "FINISHED")
    else:
        client.set_terminated(spec.parent_run_id, "KILLED")
        log.warning("search %s interrupted after %d trial(s); continue with `compat tune --resume %s`", spec.name,
                    len(trials), spec.experiment_path)
    return SearchOutcome(spec, trials, complete, best, version)


# ---- `compat compare` of a search ------------------------------------------------------------------------------------
def load_search_summaries(path: Path, top: int = COMPARE_TOP_TRIALS) -> list:
    """RunResult of the ``top`` finished trials of a local search directory (named by trial and parameters), best
    objective first."""
    spec = read_spec(str(path))
    runs = Path(path) / RUNS_FOLDER
    rows = []
    for run_dir in sorted(runs.iterdir()) if runs.is_dir() else []:
        if not (run_dir / "metrics.json").is_file():
            continue  # stopped early or unfinished: no full matrix to compare
        trial = json.loads((run_dir / TRIAL_FILE).read_text()) if (run_dir / TRIAL_FILE).is_file() else {}
        params = params_text(trial.get("params") or {})
        name = f"trial {run_dir.name}" + (f" ({params})" if params else "")
        rows.append(dataclasses.replace(load_run(run_dir), name=name, label=name))
    objective = spec.objective
    rows.sort(key=lambda s: (math.isnan(s.headline[objective]), -np.nan_to_num(s.headline[objective], nan=0.0)))
    return rows[:top]


def register_run_source() -> None:
    """Let ``compat compare`` read a search directory (``search.json``): its top trials, best objective first."""
    if "tune-experiment" in RUN_SOURCES.names():
        return
    RUN_SOURCES.register("tune-experiment", RunSource(
        description=f"a `compat tune` search directory ({SEARCH_FILE} + runs/<trial>/): top trials by objective",
        matches=lambda path: (Path(path) / SEARCH_FILE).is_file(),
        load=lambda path: load_search_summaries(Path(path))))


__all__ = ["SearchOutcome", "TrialOutcome", "default_resources", "load_search_summaries", "register_run_source",
           "resume_search", "run_search"]

"""MLflow of a search (driver side): the search's parent run, a nested run per trial logged by the Tune callback
:class:`MlflowSearchCallback`, and the best trial's models registered after a complete search."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from cluster.model_registry.model_cache import content_tags
from cluster.model_registry.versions import ensure_registered_model, register_version, write_model_folder
from cluster.tracking.client import ensure_experiment, log_metrics, log_params, open_client
from cluster.tracking.params import flatten_params
from cluster.tracking.ui import NAME_SEPARATOR
from cluster.tune.callbacks import lazy_callback_class
from cluster.tune.spec import BEST_ALIAS, MODELS_KEY, OBJECTIVE_KEY, RESULT_KEY, TIME_ATTR, TRIAL_FILE, SearchSpec
from compat_core import io as cio
from pipelines.config.model_uri import ModelUri
from pipelines.results.assemble import MATRIX_FILE, METRICS_FILE, RunResult
from pipelines.store.run_store import RunStore


BEST_TRIAL_TAG = "best"


# ---- names in the MLflow UI ------------------------------------------------------------------------------------------
def short_value(value: Any) -> str:
    """A sampled value as a name shows it: floats with 4 significant digits."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def params_text(params: dict) -> str:
    """``lam=0.1, rho=10`` from sampled parameters (dotted config keys shortened to their last part, sorted)."""
    return ", ".join(f"{key.rsplit('.', 1)[-1]}={short_value(value)}" for key, value in sorted(params.items()))


def trial_run_name(trial_id: str, params: dict, objective: str | None = None, value: float | None = None) -> str:
    """``trial-<id> (lam=0.1, rho=10)``, with `` | AA 0.733`` once the trial reported its objective (fraction)."""
    name = f"trial-{trial_id}" + (f" ({params_text(params)})" if params else "")
    return name if value is None else f"{name}{NAME_SEPARATOR}{objective} {value:.3f}"


# ---- MLflow ----------------------------------------------------------------------------------------------------------
def mlflow_callback_class():
    """The Tune callback class, built on first use so that importing this module does not import Ray (slow)."""
    return lazy_callback_class(globals(), "MlflowSearchCallback", _MlflowSearchCallbackMixin)


def __getattr__(name: str):
    # pickle finds the class as ``cluster.tune.runner.MlflowSearchCallback`` (Tune stores callbacks with the experiment)
    if name == "MlflowSearchCallback":
        return mlflow_callback_class()
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
            run = self.client.create_run(self.experiment_id, run_name=trial_run_name(trial_id, trial.config or {}),
                                         tags={
                "mlflow.parentRunId": self.parent_run_id, "run_role": "trial", "trial_id": trial_id,
                "search": self.search_name, "objective_metric": self.objective})
            run_id = run.info.run_id
            params, _ = flatten_params({key: value for key, value in (trial.config or {}).items()})
            log_params(self.client, run_id, params)
        self._runs[trial_id] = run_id
        return run_id

    def on_trial_start(self, iteration, trials, trial, **info):
        self.run_for(trial)

    def on_trial_result(self, iteration, trials, trial, result, **info):
        values = {key: result.get(key) for key in (OBJECTIVE_KEY, "AC", "AA", "ACA", "BC", "FC")}
        run_id = self.run_for(trial)
        log_metrics(self.client, run_id, values, step=int(result.get(TIME_ATTR, 0)))
        if values[OBJECTIVE_KEY] is not None:
            self.client.set_tag(run_id, "mlflow.runName", trial_run_name(
                trial.trial_id, trial.config or {}, self.objective, float(values[OBJECTIVE_KEY])))

    def on_trial_complete(self, iteration, trials, trial, **info):
        run_id = self.run_for(trial)
        result = trial.last_result or {}
        finished = int(result.get(TIME_ATTR, 0)) >= self.num_tasks
        if finished and result.get("run_dir"):
            self._log_results(run_id, result["run_dir"], RunResult.from_json(result.get(RESULT_KEY)))
        else:
            self.client.set_tag(run_id, "early_stopped", "true")
        self.client.set_terminated(run_id, "FINISHED" if finished else "KILLED")

    def on_trial_error(self, iteration, trials, trial, **info):
        self.client.set_terminated(self.run_for(trial), "FAILED")

    def _log_results(self, run_id: str, run_dir: str, result: RunResult) -> None:
        """The trial's result files: matrix.json and metrics.json from the RunResult its last report holds, the
        report, figures, config and trial file uploaded from its run folder."""
        with tempfile.TemporaryDirectory(prefix="compat-tune-results-") as folder:
            for name in cio.list_dir(run_dir):
                if name in ("matrix.csv", "report.md", "config.yaml", TRIAL_FILE) or name.endswith(".png"):
                    Path(folder, name).write_bytes(cio.read_bytes(cio.join(run_dir, name)))
            Path(folder, MATRIX_FILE).write_text(result.matrix_json())
            Path(folder, METRICS_FILE).write_text(result.metrics_json())
            self.client.log_artifacts(run_id, folder, "results")


def open_search_run(spec: SearchSpec) -> tuple[str, str]:
    """Create (or reopen on resume) the search's parent MLflow run; returns (experiment_id, parent_run_id)."""
    client = open_client(spec.tracking_uri)
    experiment_name = spec.mlflow_experiment or f"{spec.base_config['name']}-search"
    experiment_id = ensure_experiment(client, experiment_name)
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
    log_params(client, run.info.run_id, params)
    return experiment_id, run.info.run_id


def register_best_models(spec: SearchSpec, best_trial_id: str, trial_run_id: str, reported: dict) -> Any:
    """Register every task model of the best trial (aliases ``best-task-<t>``, 1-based) and ``best`` = the last one.

    reported: the trial's last report, whose ``MODELS_KEY`` names each task model's stage key and blob table (the
    committed records the trial's engine handed on). The model files, verified against that table, are logged to
    the trial's MLflow run under ``model/task-<t>``. Returns the ``best`` version.
    """
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=spec.tracking_uri)
    store = RunStore(spec.run_dir(best_trial_id))
    models = json.loads(reported.get(MODELS_KEY) or "{}")
    if sorted(models, key=int) != [str(task) for task in range(spec.num_tasks)]:
        raise FileNotFoundError(f"{store.root}: the last report of trial {best_trial_id} names models of tasks "
                                f"{sorted(models, key=int)} (0-based), expected 0..{spec.num_tasks - 1}")
    ensure_registered_model(client, spec.name, {"search": spec.name, "objective_metric": spec.objective})
    version = None
    for task in range(spec.num_tasks):
        key, manifest = models[str(task)]["stage_key"], {"blobs": models[str(task)]["blobs"]}
        artifact_path = f"model/task-{task + 1}"
        with tempfile.TemporaryDirectory(prefix="compat-tune-model-") as folder:
            model_folder = write_model_folder(Path(folder, "model"), store.read_blob(key, "config.json", manifest),
                                              store.read_blob(key, "model.safetensors", manifest))
            client.log_artifacts(trial_run_id, str(model_folder), artifact_path)
        aliases = [f"best-task-{task + 1}"] + ([BEST_ALIAS] if task == spec.num_tasks - 1 else [])
        version = register_version(client, spec.name, trial_run_id, key, {
            "trial_id": best_trial_id, "task_0based": task, "task_1based": task + 1,
            "sha256": manifest["blobs"]["model.safetensors"]["sha256"],
            **content_tags({name: manifest["blobs"][name]["sha256"] for name in ("config.json", "model.safetensors")})},
            aliases, artifact_path=artifact_path)
    client.set_tag(spec.parent_run_id, "best_trial_id", best_trial_id)
    client.set_tag(spec.parent_run_id, "best_model_uri", str(ModelUri(spec.name, alias=BEST_ALIAS)))
    return version


def mark_best_trial(client: Any, spec: SearchSpec, trial_run_id: str, objective: float) -> None:
    """Tag the best trial's run ``best=true`` and name the search's run after the best objective value:
    ``<search> | best AA 0.733`` (fraction)."""
    client.set_tag(trial_run_id, BEST_TRIAL_TAG, "true")
    client.set_tag(spec.parent_run_id, "mlflow.runName",
                   f"{spec.name}{NAME_SEPARATOR}best {spec.objective} {objective:.3f}")

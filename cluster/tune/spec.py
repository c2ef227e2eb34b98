"""What a hyper-parameter search is: its description (``search.json``, :class:`SearchSpec`) with the folder marker
that ``--resume`` checks, the objectives, trial configs (sampled values applied to the base config, local paths made
absolute) and the plugins imported in every trial process."""
from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import os
import re
import stat
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.tune.marker import MARKER_FILE, SEARCH_FILE, TUNER_FILE, check_marker, seal_tuner_state, write_marker
from compat_core import io as cio
from compat_core.codec import encode_manifest, from_json
from pipelines.config.load import ConfigError, apply_override, validate_config
from pipelines.config.schema import parse_increments

RUNS_FOLDER = "runs"
SHARED_FOLDER = "third-party"  # <experiment>/third-party: the trials' shared third-party models
TRIAL_FILE = "trial.json"
TIME_ATTR = "tasks_completed"
OBJECTIVE_KEY = "objective"
RESULT_KEY = "run_result"  # a trial's last report: its RunResult.to_json() (matrix + metrics)
MODELS_KEY = "models"  # a trial's last report: JSON of task (0-based) -> {"stage_key", "blobs"} of its task models
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

    base_config: the resolved scenario config (dict). space: the space mapping (cluster.tune.search_space grammar).
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
        return cio.join(self.storage, self.name)

    @property
    def runs_root(self) -> str:
        return cio.join(self.experiment_path, RUNS_FOLDER)

    @property
    def shared_store(self) -> str:
        """``<experiment>/third-party``: the store of third-party models the trials share (``output.shared_store``)."""
        return cio.join(self.experiment_path, SHARED_FOLDER)

    def run_dir(self, trial_id: str) -> str:
        return cio.join(self.runs_root, trial_id)

    @property
    def num_tasks(self) -> int:
        """Tasks of every trial: the base config's, after the space's ``fixed`` overrides (which may set tasks.spec),
        and one per ``tasks.sources`` entry."""
        document = apply_values(self.base_config, dict((self.space or {}).get("fixed") or {}))
        return len(parse_increments(document["tasks"]["spec"])) + len(document["tasks"].get("sources") or [])

    def to_json(self) -> str:
        """search.json: the stored form of every manifest (:func:`compat_core.codec.encode_manifest`)."""
        return encode_manifest(self).decode("utf-8")

    @classmethod
    def from_json(cls, text: str, source: str = SEARCH_FILE) -> "SearchSpec":
        """The spec of a search.json text; ValueError naming ``source`` and the keys when it is not one."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{source}: not valid JSON ({error})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a JSON object describing the search")
        return from_json(cls, data, source)




def write_spec(spec: SearchSpec) -> str:
    """Write ``search.json`` and the marker that says `compat tune` created this folder (pinning search.json)."""
    data = spec.to_json().encode("utf-8")
    uri = cio.write_bytes(cio.join(spec.experiment_path, SEARCH_FILE), data)
    write_marker(spec.experiment_path, data)
    return uri


def check_local_folder_private(experiment_path: str) -> None:
    """Refuse to resume a local search folder another user can write (its Tune state is unpickled on resume):
    the folder and its state files must be owned by this user and not group- or world-writable."""
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
    path = cio.join(str(experiment_path), SEARCH_FILE)
    if not cio.exists(path):
        raise FileNotFoundError(f"{path}: missing; {experiment_path} is not a search started by `compat tune`")
    return SearchSpec.from_json(cio.read_bytes(path).decode("utf-8"), path)

"""MLflow model registry helpers: one registered model per pipeline, idempotent versions, aliases, URI resolvers.

Naming (user-facing, so task numbers are 1-based here as in the papers):

- registered model: one per scenario, stable across runs: ``output.registered_model`` when set (e.g.
  ``--set output.registered_model=team-retrieval``), else the scenario ``name`` (see :func:`registered_model_name`).
  Every run of the scenario adds its versions there; a version keeps its run id and the run's identity as tags, so
  every run's models stay reachable as ``models:/NAME/V``;
- aliases: ``task-<t+1>`` for the model of 0-based task ``t`` (``task-1`` is the first task), ``latest-task`` for
  the model of the run's highest task (MLflow 3 reserves ``latest``: the highest version number), ``pretrain-<name>``
  for a third-party model pre-trained by the pipeline. Every run sets them in its own namespace,
  ``<run name>__task-3`` (``cluster.tracking.run_identity``: run folder name + pipeline id, unique per run), while
  it runs; a complete run whose ``--set`` overrides left its config file's results unchanged then moves the bare
  scenario aliases (``task-3``) all at once (:func:`move_scenario_aliases`). ``champion`` moves only through
  ``compat gate`` (:func:`register_version` refuses it);
- version tags: ``stage_key`` (makes registration idempotent), ``stage_kind``, ``task_0based``, ``task_1based``,
  ``line``, the run's identity (``pipeline_id``, ``run_folder``, ``run_name``, ``config_hash``,
  ``overrides_digest``, ``code_version``, ``scenario_aliases``), the content digests ``files_sha256`` /
  ``content_sha256`` (config.json and model.safetensors, :mod:`cluster.model_registry.model_cache`) and ``sha256``
  (of model.safetensors), ``parent_version``, ``external_source``, ``source_version``.

:func:`register_mlflow_resolvers` lets ``compat_core.models.load_external_weights`` read ``models:/NAME@ALIAS``,
``models:/NAME/VERSION``, ``models:/NAME/latest`` and ``runs:/RUN_ID/PATH`` URIs by downloading the artifacts into
the user's private cache folder, verified against the version's content digests before every use.

What a version's folder (``runs:/RUN/model``) holds, see :func:`write_model_folder`: an MLflow ``pyfunc`` model
written as code, whose artifacts are ``model.safetensors`` + ``config.json`` (what this project reads back; nothing
is ever pickled), so ``mlflow.pyfunc.load_model("models:/NAME@task-4").unwrap_python_model().model`` returns the
model.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from cluster.model_registry.alias_moves import DEFAULT_ALIAS, version_by_alias
from cluster.model_registry.model_cache import (
    content_tags,
    default_cache_dir,
    expected_files,
    first_mismatch,
    mismatch_error,
    private_dir,
)
from cluster.tracking.client import open_client
from compat_core.integrity import IntegrityError
from compat_core.kinds import ADAPTER_KINDS
from compat_core.models.compat_model import CONFIG_FILE, model_from_bytes
from compat_core.models.weights import register_uri_resolver
from pipelines.config.model_uri import LATEST, ModelUri, is_model_uri, parse_model_uri
from pipelines.config.redaction import redact_uri

_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]+$")
_RUNS_URI = re.compile(r"^runs:/(?P<run_id>[0-9a-fA-F]{32})/(?P<path>.+)$")
MODEL_ARTIFACT_PATH = "model"
LATEST_ALIAS = "latest-task"
# the bare aliases a complete run of an unchanged config moves (never champion, a search's best, or a run's own)
_SCENARIO_ALIAS = re.compile(
    rf"^(?!.*__)(?:(({'|'.join(ADAPTER_KINDS)})-)?task-\d+|latest-task|pretrain-[A-Za-z0-9_-]+)$")
WEIGHTS_FILE = "model.safetensors"
MODEL_FILES_SUBFOLDER = "artifacts"  # where MLflow's pyfunc flavour keeps the declared artifacts
# the pyfunc model written as code (MLflow's models-from-code): MLflow runs that file where the model is loaded;
# it is never imported here (importing it imports MLflow and declares the model)
PYFUNC_MODEL_FILE = Path(__file__).with_name("pyfunc.py")
WEIGHTS_ARTIFACT = "weights"  # names of the pyfunc artifacts: the safetensors weights and the model's config.json
CONFIG_ARTIFACT = "config"
log = logging.getLogger(__name__)


def registered_model_name(scenario: str, override: str | None = None) -> str:
    """The registered model of a scenario: ``override`` (the config's ``output.registered_model``) when given, else
    the scenario name. Stable across runs, so a team finds a scenario's models under one name."""
    name, what = (override, "output.registered_model") if override else (scenario, "scenario name")
    if not isinstance(name, str) or not _NAME_PATTERN.match(name):
        raise ValueError(f"{what} {name!r}: expected letters, digits, '_', '.', '-' only")
    return name


def task_alias(task: int) -> str:
    """Alias of the model of 0-based task ``task``: ``task-<task+1>`` (1-based, as the papers number tasks)."""
    if not isinstance(task, int) or task < 0:
        raise ValueError(f"task: expected a 0-based task index >= 0, got {task!r}")
    return f"task-{task + 1}"


def ensure_registered_model(client: Any, name: str, tags: dict[str, str] | None = None) -> Any:
    """Get or create the registered model ``name`` (tags are set on creation only)."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_registered_model(name)
    except MlflowException as error:
        if error.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
    try:
        return client.create_registered_model(name, tags=tags or {})
    except MlflowException as error:
        if error.error_code != "RESOURCE_ALREADY_EXISTS":  # another process created it in between
            raise
        return client.get_registered_model(name)


def find_version(client: Any, name: str, stage_key: str, pipeline_id: str | None = None) -> Any | None:
    """The version of ``name`` registered for ``stage_key`` (tag) by the pipeline ``pipeline_id`` (tag; any pipeline
    when None), or None: another run of the same stage gets a version of its own."""
    if any("'" in text for text in (name, stage_key, pipeline_id or "")):
        raise ValueError(f"registered model {name!r} / stage key {stage_key!r} / pipeline id {pipeline_id!r}: quotes "
                         f"are not allowed")
    query = f"name = '{name}' and tags.stage_key = '{stage_key}'"
    if pipeline_id:
        query += f" and tags.pipeline_id = '{pipeline_id}'"
    found = client.search_model_versions(query)
    return min(found, key=lambda version: int(version.version)) if found else None


def register_version(client: Any, name: str, run_id: str, stage_key: str, tags: dict[str, str],
                     aliases: list[str], artifact_path: str = MODEL_ARTIFACT_PATH) -> Any:
    """Register ``runs:/<run_id>/<artifact_path>`` as a version of ``name`` once per ``stage_key`` and pipeline (the
    ``pipeline_id`` tag, when given); set ``aliases``.

    Returns the ModelVersion (the existing one when this stage was registered before, e.g. on a resume).
    ``champion`` is never among the aliases: only the compatibility gate (``compat gate``) moves it.
    """
    if DEFAULT_ALIAS in aliases:
        raise ValueError(f"registered model {name!r}: alias {DEFAULT_ALIAS!r} moves only through the compatibility "
                         f"gate (compat gate), never when a version is registered")
    version = find_version(client, name, stage_key, str(tags["pipeline_id"]) if tags.get("pipeline_id") else None)
    if version is None:
        version = client.create_model_version(name, f"runs:/{run_id}/{artifact_path}", run_id=run_id,
                                              tags={**{k: str(v) for k, v in tags.items()}, "stage_key": stage_key})
    for alias in aliases:
        client.set_registered_model_alias(name, alias, version.version)
    return version


def move_scenario_aliases(client: Any, name: str, run_prefix: str) -> dict[str, str]:
    """Point the scenario's bare aliases of registered model ``name`` at one run: every alias ``<run_prefix>X`` gives
    ``X`` its version, and a bare scenario alias (``task-N``, ``latest-task``, ``pretrain-NAME``, ``KIND-task-N``)
    that run does not have is removed, so the bare aliases always name versions of one complete run. Returns the
    bare aliases set ({alias: version}); nothing when the model does not exist."""
    from mlflow.exceptions import MlflowException

    try:
        aliases = dict(client.get_registered_model(name).aliases or {})
    except MlflowException as error:
        if error.error_code == "RESOURCE_DOES_NOT_EXIST":
            return {}
        raise
    mine = {alias[len(run_prefix):]: str(version) for alias, version in aliases.items() if alias.startswith(run_prefix)}
    for alias, version in sorted(mine.items()):
        client.set_registered_model_alias(name, alias, version)
    for alias in sorted(aliases):
        if alias not in mine and _SCENARIO_ALIAS.match(alias):
            client.delete_registered_model_alias(name, alias)
    return mine


def write_model_folder(folder: str | os.PathLike, config_bytes: bytes, weights_bytes: bytes) -> Path:
    """Write the MLflow model folder of one pipeline model into the new folder ``folder``; returns its path.

    An MLflow ``pyfunc`` model written as code (:mod:`cluster.model_registry.pyfunc`): ``artifacts/model.safetensors`` and
    ``artifacts/config.json`` byte for byte (what ``models:/`` replacement sources and :class:`MlflowModelResolver`
    read), ``MLmodel`` and the loader file. Nothing else: no pickle, no second copy of the weights, no d-Simplex
    prototypes (rebuilt from K), so the folder is the safetensors' size plus a few kB.
    ``mlflow.pyfunc.load_model(uri).unwrap_python_model().model`` returns the ``CompatModel``.
    """
    import logging
    from importlib.metadata import PackageNotFoundError, version

    import mlflow.pyfunc
    import safetensors
    import torch


    target = Path(folder)
    model_from_bytes(config_bytes, weights_bytes, where=str(target))  # refuse weights that do not match the config
    try:
        requirements = [f"compat-learning=={version('compat-learning')}"]
    except PackageNotFoundError:  # a checkout that is not pip-installed
        requirements = ["compat-learning"]
    requirements += [f"torch=={torch.__version__.split('+')[0]}", f"safetensors=={safetensors.__version__}"]
    with tempfile.TemporaryDirectory(prefix="compat-model-files-") as staging:
        weights, config = Path(staging, WEIGHTS_FILE), Path(staging, CONFIG_FILE)
        weights.write_bytes(weights_bytes)
        config.write_bytes(config_bytes)
        quiet = logging.getLogger("mlflow")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # models-from-code notes on every save
        try:
            # the digests the version's tags carry, also in MLmodel for the pyfunc's own check at load time
            files = {WEIGHTS_FILE: hashlib.sha256(weights_bytes).hexdigest(),
                     CONFIG_FILE: hashlib.sha256(config_bytes).hexdigest()}
            mlflow.pyfunc.save_model(str(target), python_model=str(PYFUNC_MODEL_FILE),
                                     artifacts={WEIGHTS_ARTIFACT: str(weights), CONFIG_ARTIFACT: str(config)},
                                     pip_requirements=requirements, model_config=content_tags(files))
        finally:
            quiet.setLevel(level)
    return target


def model_files_folder(folder: str | os.PathLike) -> Path:
    """The folder holding ``model.safetensors`` + ``config.json`` inside a downloaded MLflow model folder
    (``artifacts/`` of a pyfunc model; the folder itself for versions logged with both files at the top)."""
    folder = Path(folder)
    nested = folder / MODEL_FILES_SUBFOLDER
    return nested if (nested / WEIGHTS_FILE).exists() and not (folder / WEIGHTS_FILE).exists() else folder


def model_version(client: Any, uri: ModelUri) -> Any:
    """The ModelVersion ``uri`` names now: the one behind its alias, the highest for ``latest``, else that version.
    FileNotFoundError naming the URI and the tracking server when the alias is not set or there is no version."""
    if uri.alias is not None:
        found = version_by_alias(client, uri.name, uri.alias)
        if found is None:
            raise FileNotFoundError(f"{uri}: registered model {uri.name!r} has no alias {uri.alias!r} "
                                    f"(tracking server {redact_uri(client.tracking_uri)})")
        return found
    if uri.version == LATEST:
        versions = client.search_model_versions(f"name = '{uri.name}'")
        if not versions:
            raise FileNotFoundError(f"{uri}: registered model {uri.name!r} has no versions "
                                    f"(tracking server {redact_uri(client.tracking_uri)})")
        return max(versions, key=lambda candidate: int(candidate.version))
    return client.get_model_version(uri.name, uri.version)


def pinned_model_uri(client: Any, uri: ModelUri) -> ModelUri:
    """``models:/NAME/<version>`` of the version ``uri`` names now (a pinned URI is returned as is, unread)."""
    return uri if uri.pinned else uri.at_version(model_version(client, uri).version)


class MlflowModelResolver:
    """Callable ``uri -> local folder`` for ``models:/`` and ``runs:/`` URIs (see module doc).

    Registry aliases are resolved to a version first, so the cache folder
    ``<cache>/<server hash>/models/<name>/<version>`` holds immutable content; every file the version's tags name
    (:mod:`cluster.model_registry.model_cache`: config.json and the weights) is verified before each use, a cached
    copy that differs is downloaded again, and a registry copy that differs raises IntegrityError naming the file.
    ``runs:/`` URIs carry no digest, so they are downloaded anew every time. cache_dir: default
    :func:`~cluster.model_registry.model_cache.default_cache_dir` (per user, mode 0700, checked).
    """

    def __init__(self, tracking_uri: str, cache_dir: str | os.PathLike | None = None):
        self.tracking_uri = tracking_uri
        self.client = open_client(tracking_uri)  # the one way the product opens MLflow (no download bars)
        self.cache_dir = private_dir(cache_dir or default_cache_dir())
        # one cache folder per tracking server: version numbers and run ids are only unique within a server
        self._cache = self.cache_dir / hashlib.sha256(tracking_uri.encode("utf-8")).hexdigest()[:12]

    def __call__(self, uri: str) -> str:
        private_dir(self.cache_dir)  # still this user's own: checked before every use, not only when created
        if is_model_uri(uri):
            return self._resolve_model(parse_model_uri(uri))
        match = _RUNS_URI.match(uri)
        if match is None:
            raise ValueError(f"run URI {uri!r}: expected runs:/<32 hex run id>/<artifact path>")
        downloaded = self._download(match["run_id"], match["path"], self._cache / "runs" / match["run_id"],
                                    reuse=False)
        return str(model_files_folder(downloaded)) if downloaded.is_dir() else str(downloaded)

    def _resolve_model(self, uri: ModelUri) -> str:
        found = model_version(self.client, uri)
        source = _RUNS_URI.match(found.source or "")
        if source is None:
            raise ValueError(f"{uri}: version {found.version} has source {found.source!r}; expected runs:/RUN/PATH")
        what = f"{uri} (version {found.version})"
        expected = expected_files(found.tags or {}, what)
        destination = self._cache / "models" / uri.name / str(found.version)
        if expected is None:
            log.warning("%s: the version carries no content digest; downloaded anew and used unverified", what)
            return str(_model_location(self._download(source["run_id"], source["path"], destination, False)))
        for reuse in (True, False):
            downloaded = self._download(source["run_id"], source["path"], destination, reuse)
            folder, files = _files_to_check(downloaded, expected)
            if CONFIG_FILE not in files and downloaded.is_dir() and reuse:
                log.warning("%s: only %s is covered by the version's sha256 tag (registered by an older compat); "
                            "%s is read unverified", what, WEIGHTS_FILE, CONFIG_FILE)
            mismatch = first_mismatch(folder, files)
            if mismatch is None:
                return str(_model_location(downloaded))
            if reuse:
                log.warning("%s: cached %s differs from the version's digest; downloading it again", what,
                            mismatch[0])
        raise mismatch_error(what, folder, mismatch)

    def _download(self, run_id: str, path: str, destination: Path, reuse: bool) -> Path:
        """The downloaded artifact ``path`` under ``destination`` (a folder keeps its path, MLflow puts a single file
        at the top): the cached copy when ``reuse`` and present, else downloaded into a private staging folder and
        moved into place (a concurrent download that got there first is kept and verified by the caller)."""
        if reuse:
            for cached in (destination / path, destination / Path(path).name):
                if cached.is_file() or (cached.is_dir() and any(cached.iterdir())):
                    return cached
        destination.parent.mkdir(parents=True, exist_ok=True)  # inside the private cache folder
        staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}-", dir=destination.parent))
        try:
            relative = Path(self.client.download_artifacts(run_id, path, dst_path=str(staging))).relative_to(staging)
            shutil.rmtree(destination, ignore_errors=True)
            try:
                os.replace(staging, destination)
            except OSError:
                if not destination.exists():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return destination / relative


def _model_location(downloaded: Path) -> Path:
    """What a resolved version hands its reader: the folder of config.json + weights, or the one file logged."""
    return model_files_folder(downloaded) if downloaded.is_dir() else downloaded


def _files_to_check(downloaded: Path, expected: dict[str, str]) -> tuple[Path, dict[str, str]]:
    """(folder, {file name: sha256}) to verify: a model folder's files, or a version logged as one file (an adapter)
    checked against its one digest whatever its name."""
    if downloaded.is_dir():
        return model_files_folder(downloaded), expected
    digest = expected.get(downloaded.name) or (next(iter(expected.values())) if len(expected) == 1 else None)
    if digest is None:
        raise IntegrityError(f"{downloaded}: the version's tags name {sorted(expected)}, not this file",
                             uri=downloaded, field="files_sha256")
    return downloaded.parent, {downloaded.name: digest}


def register_mlflow_resolvers(tracking_uri: str, cache_dir: str | os.PathLike | None = None) -> MlflowModelResolver:
    """Register ``models`` and ``runs`` URI resolvers in compat_core.models.weights; returns the resolver."""
    resolver = MlflowModelResolver(tracking_uri, cache_dir)
    register_uri_resolver("models", resolver)
    register_uri_resolver("runs", resolver)
    return resolver


__all__ = [
    "registered_model_name", "task_alias", "ensure_registered_model", "find_version", "register_version",
    "version_by_alias", "model_version", "pinned_model_uri", "LATEST_ALIAS", "MlflowModelResolver",
    "register_mlflow_resolvers", "MODEL_ARTIFACT_PATH", "write_model_folder", "model_files_folder",
    "move_scenario_aliases",
]

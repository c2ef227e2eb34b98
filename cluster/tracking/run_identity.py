"""Who a tracked run is: where it writes, what it was asked to run, and the names its registry aliases take.

- **Location**: the absolute run folder, or for ``s3://`` the URI with the S3 endpoint it lives on (two stores may
  hold the same bucket name). The pipeline id hashes (config hash, location), so two runs of one config into two
  folders (two clones, two ``--output``) are two MLflow pipeline runs, and a resume of one folder continues its own.
  The config hash is the one the run was started with: a run grown by appended tasks or replacements
  (pipelines.engine.growth) keeps its pipeline id.
- **Run name**: ``<folder name>-<8 hex of the pipeline id>`` (characters MLflow refuses in an alias become ``-``),
  unique per run folder and config, readable in the UI and in ``models:/NAME@ALIAS``.
- **Intent**: whether ``--set`` overrides changed what the named config file computes (its config hash; overrides
  of the output, resources or description change nothing), and their digest. Only a run of its config file as
  written moves the scenario's bare aliases (``task-N``, ``latest-task``, ``pretrain-NAME``); every run moves its own
  namespaced ones (``<run name>__task-N``).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from cluster.storage.s3 import installed_access
from compat_core import io as cio
from pipelines.config.load import ConfigError, config_hash, load_config, stable_hash
from pipelines.config.local_paths import absolute_location

ALIAS_SEPARATOR = "__"  # MLflow aliases allow only letters, digits, '_' and '-' (no '.', no '/')
_ALIAS_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
INTENT_METADATA_KEY = "compat_scenario_aliases"  # a submitted job's metadata: the intent judged where it was typed


@dataclass(frozen=True)
class RunIntent:
    """What the user asked for. overrides_digest: 16 hex of the ``--set`` list as typed (order kept; the values
    are never recorded, they may hold secrets). scenario_aliases: the config file runs unchanged, so the run may move
    the scenario's bare aliases."""

    overrides_digest: str
    scenario_aliases: bool


AS_WRITTEN = RunIntent(stable_hash([])[:16], True)


def run_location(root: str) -> str:
    """The run folder as an identity: an absolute local path, or ``s3://...`` prefixed by the endpoint it is on."""
    location = absolute_location(str(root).rstrip("/")) or ""
    if not cio.is_remote(location):
        return location
    access = installed_access()
    endpoint = access.settings.endpoint_display if access is not None else "default-endpoint"
    return f"{endpoint}|{location}"


def pipeline_id_of(config_hash_hex: str, location: str) -> str:
    """Stable id of a pipeline = sha256 of (config hash, :func:`run_location`), 16 hex: the same run folder and
    config resumed keep it; another folder or another config is another pipeline. ``config_hash_hex``: the hash
    of the config the run was started with (its founding config, also after it grew)."""
    return stable_hash({"config_hash": config_hash_hex, "run_root": location})[:16]


def run_name_of(location: str, pipeline_id: str) -> str:
    """``<last folder name>-<pipeline_id[:8]>``, restricted to the characters an MLflow alias allows."""
    folder = location.rstrip("/").rsplit("/", 1)[-1] or "run"
    safe = _ALIAS_UNSAFE.sub("-", folder).strip("-")[:64] or "run"
    return f"{safe}-{pipeline_id[:8]}"


def check_run_name(name: str, what: str = "--run-name") -> str:
    """``name`` when it can prefix a run's aliases (letters, digits, '-' and '_', at most 64 characters, no
    ``__``, which separates the run name from the alias); ValueError naming ``what`` otherwise."""
    if not name or len(name) > 64 or _ALIAS_UNSAFE.search(name) or ALIAS_SEPARATOR in name \
            or name.startswith(("-", "_")) or name.endswith(("-", "_")):
        raise ValueError(f"{what} {name!r}: expected 1 to 64 letters, digits, '-' or '_' (not starting or ending "
                         f"with them, no {ALIAS_SEPARATOR!r}): it prefixes the run's registry aliases, e.g. "
                         f"{scoped_alias('my-run', 'task-3')}")
    return name


def scoped_alias(run_name: str, alias: str) -> str:
    """The alias ``alias`` of one run: ``<run name>__<alias>`` (e.g. ``er-1a2b3c4d__task-3``)."""
    return f"{run_name}{ALIAS_SEPARATOR}{alias}"


def run_intent(config_path: str | os.PathLike | None, overrides: list[str] | None, config) -> RunIntent:
    """The intent of running ``config`` (the validated config with ``overrides`` applied) from ``config_path``:
    scenario aliases only when the overrides leave the file's config hash unchanged (a file that validates only
    with its overrides counts as changed). The file is read again with and without the overrides, so what the run
    resolved since (its precision) never counts as an override."""
    overrides = list(overrides or [])
    digest = stable_hash(overrides)[:16]
    if not overrides:
        return RunIntent(digest, True)
    if config_path is None:
        return RunIntent(digest, False)
    try:
        # both read from the file as the user wrote it: what the run resolves later (its precision) is not an override
        unchanged = config_hash(load_config(config_path, [])) == config_hash(load_config(config_path, overrides))
    except ConfigError:
        unchanged = False
    return RunIntent(digest, unchanged)


def submitted_intent() -> bool | None:
    """In a submitted Ray Job: whether the submitter's config ran unchanged (job metadata
    :data:`INTENT_METADATA_KEY`); None outside a job or when the submitter did not say."""
    text = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not text:
        return None
    try:
        value = (json.loads(text).get("metadata") or {}).get(INTENT_METADATA_KEY)
    except (json.JSONDecodeError, AttributeError):
        return None
    return None if value is None else str(value).lower() == "true"


__all__ = ["ALIAS_SEPARATOR", "AS_WRITTEN", "INTENT_METADATA_KEY", "RunIntent", "pipeline_id_of", "run_intent",
           "check_run_name", "run_location", "run_name_of", "scoped_alias", "submitted_intent"]

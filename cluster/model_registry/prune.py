"""Per-run registry aliases whose run folder is gone (``compat models prune``).

Every run sets aliases namespaced by its run name (``<run>__task-3``, see :mod:`cluster.tracking.run_identity`), so
they pile up as runs come and go. An alias is *stale* when it has the ``<run>__`` prefix, the version it names
carries that run name (tag ``run_name``) and a ``run_folder`` tag, and that folder no longer exists. Bare scenario
aliases (``task-3``, ``latest-task``), ``champion`` and any alias whose version does not record its run are never
touched. Folders are checked from this machine: a run folder on another machine's disk (a Ray Job's node) looks
missing here, so the default is a dry run.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.tracking.run_identity import ALIAS_SEPARATOR
from compat_core import io as cio


@dataclass(frozen=True)
class RunAlias:
    """One per-run alias: model, alias, version, the run name and folder its version records, and whether that
    folder exists (None when it could not be checked)."""

    model: str
    alias: str
    version: str
    run_name: str
    run_folder: str
    folder_exists: bool | None


def _folder_exists(folder: str) -> bool | None:
    try:
        return cio.is_dir(folder) if cio.is_remote(folder) else Path(folder).is_dir()
    except Exception:  # noqa: BLE001 - an object store that cannot be asked: unknown, never pruned
        return None


def run_aliases(client: Any, models: list[str] | None = None) -> list[RunAlias]:
    """Every per-run alias of ``models`` (default: every registered model) whose version records its run."""
    names = models or [model.name for model in client.search_registered_models(max_results=1000)]
    found = []
    for name in names:
        registered = client.get_registered_model(name)
        for alias, version in sorted((registered.aliases or {}).items()):
            run_name, separator, _ = alias.partition(ALIAS_SEPARATOR)
            if not separator or not run_name:
                continue   # a bare alias: scenario aliases, champion
            tags = client.get_model_version(name, str(version)).tags or {}
            folder = tags.get("run_folder")
            if tags.get("run_name") != run_name or not folder:
                continue   # the version does not say this alias is its run's: not ours to judge
            found.append(RunAlias(name, alias, str(version), run_name, folder, _folder_exists(folder)))
    return found


def prune_run_aliases(client: Any, models: list[str] | None = None, apply: bool = False) -> list[RunAlias]:
    """The per-run aliases whose run folder is gone (``folder_exists`` False); removed from the registry when
    ``apply``, else only listed."""
    stale = [alias for alias in run_aliases(client, models) if alias.folder_exists is False]
    if apply:
        for alias in stale:
            client.delete_registered_model_alias(alias.model, alias.alias)
    return stale


__all__ = ["RunAlias", "prune_run_aliases", "run_aliases"]

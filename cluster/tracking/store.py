"""The one default MLflow tracking store of a machine (per user), shared by every ``compat`` command.

``compat run``, ``demo``, ``tune`` and ``gate`` track into ``sqlite:///$COMPAT_HOME/mlflow/mlflow.db`` (artifacts in
``$COMPAT_HOME/mlflow/mlartifacts``) unless ``--tracking-uri`` or ``MLFLOW_TRACKING_URI`` names another store, so
one ``compat ui`` shows every run, search and gate decision of the machine; experiments are named after the scenario
(``compat demo``: ``compat-demo``, a search: ``<scenario>-search``, gates: ``compat-gate``).
``COMPAT_HOME`` defaults to ``$XDG_DATA_HOME/compat`` (``~/.local/share/compat``).
"""
from __future__ import annotations

import os
from pathlib import Path

HOME_VARIABLE = "COMPAT_HOME"


def compat_home() -> Path:
    """``$COMPAT_HOME``, else ``$XDG_DATA_HOME/compat``, else ``~/.local/share/compat`` (absolute)."""
    explicit = os.environ.get(HOME_VARIABLE)
    if explicit:
        return Path(explicit).expanduser().resolve()
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return (Path(data).expanduser() / "compat").resolve()


def machine_tracking_uri() -> str:
    """``sqlite:///<compat home>/mlflow/mlflow.db`` (the folder is created)."""
    folder = compat_home() / "mlflow"
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / 'mlflow.db'}"


def default_tracking_uri() -> str:
    """What every command tracks into without ``--tracking-uri``: ``MLFLOW_TRACKING_URI``, else the machine store."""
    return os.environ.get("MLFLOW_TRACKING_URI") or machine_tracking_uri()


__all__ = ["HOME_VARIABLE", "compat_home", "default_tracking_uri", "machine_tracking_uri"]

"""The one default MLflow tracking store of a machine (per user), and the one place a command's tracking target is
resolved (:func:`resolve_tracking`, called by ``app.dispatch`` for every command with ``--tracking-uri``).

Every command that tracks (``compat run``, ``demo``, ``tune``, ``gate``, ``index``, ``serve``, ``ui``) uses
``--tracking-uri``, else ``MLFLOW_TRACKING_URI``, else ``sqlite:///$COMPAT_HOME/mlflow/mlflow.db`` (artifacts in
``$COMPAT_HOME/mlflow/mlartifacts``), so one ``compat ui`` shows every run, search and gate decision of the machine;
``--tracking-uri none`` turns tracking off. Experiments are named after the scenario (``compat demo``:
``compat-demo``, a search: ``<scenario>-search``, gates: ``compat-gate``).
``COMPAT_HOME`` defaults to ``$XDG_DATA_HOME/compat`` (``~/.local/share/compat``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Mapping

from cluster.tracking.client import check_tracking_uri

HOME_VARIABLE = "COMPAT_HOME"
URI_VARIABLE = "MLFLOW_TRACKING_URI"
TRACKING_OFF = "none"
TrackingSource = Literal["--tracking-uri", "MLFLOW_TRACKING_URI", "machine store", "off"]


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


@dataclass(frozen=True)
class TrackingTarget:
    """Where a command tracks. uri: a checked ``sqlite:///PATH`` or ``http(s)://`` URI without credentials, None when
    tracking is off. source: what named it ("--tracking-uri", "MLFLOW_TRACKING_URI", "machine store" or "off")."""

    uri: str | None
    source: TrackingSource

    @property
    def enabled(self) -> bool:
        return self.uri is not None

    @property
    def explicit(self) -> bool:
        """Named by the user (flag or environment) rather than the machine's store by default."""
        return self.source in ("--tracking-uri", "MLFLOW_TRACKING_URI")


def resolve_tracking(flag: str | None, environ: Mapping[str, str] | None = None) -> TrackingTarget:
    """The tracking target of a command: ``flag`` (``--tracking-uri``), else ``MLFLOW_TRACKING_URI``, else the
    machine's store; ``none`` (from either) turns tracking off. The URI is checked and any ``user:password@`` moved to
    MLflow's credential variables (:func:`cluster.tracking.client.check_tracking_uri`). ValueError names the flag or
    variable that gave a bad URI."""
    environ = os.environ if environ is None else environ
    if flag is not None:
        value, source = flag, "--tracking-uri"
    elif environ.get(URI_VARIABLE):
        value, source = environ[URI_VARIABLE], URI_VARIABLE
    else:
        return TrackingTarget(machine_tracking_uri(), "machine store")
    if value == TRACKING_OFF:
        return TrackingTarget(None, "off")
    try:
        return TrackingTarget(check_tracking_uri(value), source)
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None


__all__ = ["HOME_VARIABLE", "TRACKING_OFF", "TrackingTarget", "URI_VARIABLE", "compat_home", "machine_tracking_uri",
           "resolve_tracking"]

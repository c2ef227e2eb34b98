"""Arguments shared by the commands that use a cluster: ``--ray-address``, ``--ray-token-file`` and ``--tracking-uri``
of the commands that join a Ray cluster and read the model registry (``compat index``, ``compat serve``), and
``--executor`` of the commands that run a graph (``compat run``, ``compat submit``), whose choices and help come from
the executor registry (:data:`pipelines.engine.backends.EXECUTORS`, filled by :mod:`cluster.executors`; its cards
import no executor code, so parsing stays light)."""
from __future__ import annotations

import argparse

from cluster.executors import EXECUTORS


def add_cluster_access(parser: argparse.ArgumentParser, cluster: str = "Ray cluster") -> None:
    """Add ``--ray-address`` (its help starts with ``cluster``), ``--ray-token-file`` and ``--tracking-uri``."""
    parser.add_argument("--ray-address", default=None, help=f"{cluster}: its GCS address HOST:PORT, or the job "
                        "server http://HOST:PORT of a `compat cluster up` head (default: $RAY_ADDRESS, else a "
                        "local instance)")
    parser.add_argument("--ray-token-file", default=None, metavar="FILE",
                        help="the cluster's token (default: Ray's standard places, e.g. ~/.ray/auth_token)")
    parser.add_argument("--tracking-uri", default=None, metavar="URI",
                        help="MLflow tracking server holding the registry (default: $MLFLOW_TRACKING_URI, else "
                        "the machine's store, as every compat command)")


def add_executor_argument(parser: argparse.ArgumentParser, default: str, help: str) -> None:
    """``--executor NAME`` with every registered executor as a choice; ``help`` is followed by each one's summary."""
    names = EXECUTORS.names()
    choices = "; ".join(f"{name}: {EXECUTORS.get(name).summary}" for name in names)
    parser.add_argument("--executor", choices=names, default=default, help=f"{help}. {choices}")

"""Arguments shared by the commands that join a Ray cluster and read the model registry (``compat index``,
``compat serve``): ``--ray-address``, ``--ray-token-file`` and ``--tracking-uri``."""
from __future__ import annotations

import argparse


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

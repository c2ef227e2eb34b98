"""`compat ui [--port N] [--tracking-uri URI]`: the MLflow UI on 127.0.0.1 over the store every compat command
tracks into (runs, demos, searches, gate decisions), until Ctrl+C."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cluster.ray.local_head import free_port


def ui_command(tracking_uri: str, port: int) -> list[str]:
    """The ``mlflow server`` command line: loopback only, one worker (a UI for one person), artifacts of a SQLite
    store from its ``mlartifacts`` folder."""
    command = [str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri", tracking_uri,
               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    if tracking_uri.startswith("sqlite:///"):
        command += ["--artifacts-destination", str(Path(tracking_uri[len("sqlite:///"):]).parent / "mlartifacts")]
    return command


def run(args) -> int:
    import os

    tracking_uri = args.tracking.uri
    if tracking_uri is None:
        print("error: --tracking-uri none: there is no store to show", file=sys.stderr)
        return 2
    if tracking_uri.startswith(("http://", "https://")):
        print(f"{tracking_uri} is an MLflow server already: open it in a browser")
        return 0
    port = args.port or free_port()
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    print(f"MLflow UI: http://127.0.0.1:{port}  (store {tracking_uri}; Ctrl+C stops it)", flush=True)
    process = subprocess.Popen(ui_command(tracking_uri, port), env=env)
    try:
        return process.wait()
    except KeyboardInterrupt:
        process.terminate()
        process.wait(timeout=30)
        return 0

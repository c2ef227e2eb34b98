"""`compat ui [--port N] [--tracking-uri URI]`: the MLflow UI on 127.0.0.1 over the store every compat command
tracks into (runs, demos, searches, gate decisions), until Ctrl+C."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from cluster.ray.local_head import free_port

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STOP_GRACE_S = 20.0


def ui_command(tracking_uri: str, port: int) -> list[str]:
    """The ``mlflow server`` command line: loopback only, one worker (a UI for one person), artifacts of a SQLite
    store from its ``mlartifacts`` folder."""
    command = [str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri", tracking_uri,
               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    if tracking_uri.startswith("sqlite:///"):
        command += ["--artifacts-destination", str(Path(tracking_uri[len("sqlite:///"):]).parent / "mlartifacts")]
    return command


def run(args) -> int:
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
    received: list[int] = []
    previous = {signum: signal.signal(signum, lambda signum, _frame: received.append(signum))
                for signum in STOP_SIGNALS}
    # its own process group: the server, its workers and whatever they start are stopped together
    process = subprocess.Popen(ui_command(tracking_uri, port), env=env, start_new_session=True)
    try:
        while process.poll() is None and not received:
            time.sleep(0.2)
        if process.returncode is not None:
            return process.returncode
        print(f"compat ui: {signal.Signals(received[0]).name} received, stopping the MLflow server", file=sys.stderr,
              flush=True)
        return 0
    finally:
        stop_process_group(process, grace_s=STOP_GRACE_S)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def stop_process_group(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the process group ``process`` leads (the server and its workers), wait up to ``grace_s`` seconds for
    every member to exit, then SIGKILL the members left."""
    _signal_group(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        process.poll()   # reap the leader, or it stays a member of the group
        if not _group_alive(process.pid):
            return
        time.sleep(0.1)
    print(f"compat ui: the MLflow server's processes still run {grace_s:.0f} s after SIGTERM; killing them",
          file=sys.stderr)
    _signal_group(process.pid, signal.SIGKILL)
    process.wait(timeout=10)


def _signal_group(group: int, sig: signal.Signals) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True

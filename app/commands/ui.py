"""`compat ui [--port N] [--tracking-uri URI] [--experiment NAME]`: the MLflow UI on 127.0.0.1 over the store every
compat command tracks into (runs, demos, searches, gate decisions), until Ctrl+C; prints the URL of the experiments
list (or of one experiment's runs) in the UI's model-training mode."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from cluster.ray.local_head import free_port
from cluster.tracking.client import open_client
from cluster.tracking.ui import ui_page_url

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


def experiment_id_of(tracking_uri: str, name: str) -> str | None:
    """Id of the live experiment ``name`` in the store, None when it has none."""
    found = open_client(tracking_uri).get_experiment_by_name(name)
    return found.experiment_id if found is not None and found.lifecycle_stage == "active" else None


def recent_experiments(tracking_uri: str, limit: int = 8) -> list[tuple[str, str]]:
    """(name, id) of the store's live experiments that hold runs, most recently updated first."""
    client = open_client(tracking_uri)
    found = client.search_experiments(max_results=limit + 1, order_by=["last_update_time DESC"])
    return [(e.name, e.experiment_id) for e in found
            if e.lifecycle_stage == "active" and client.search_runs([e.experiment_id], max_results=1)][:limit]


def run(args) -> int:
    tracking_uri = args.tracking.uri
    if tracking_uri is None:
        print("error: --tracking-uri none: there is no store to show", file=sys.stderr)
        return 2
    if tracking_uri.startswith(("http://", "https://")):
        experiment_id = experiment_id_of(tracking_uri, args.experiment) if args.experiment else None
        print(f"{tracking_uri} is an MLflow server already: open {ui_page_url(tracking_uri, experiment_id)}")
        return 0
    experiment_id = None
    if args.experiment:
        experiment_id = experiment_id_of(tracking_uri, args.experiment)
        if experiment_id is None:
            print(f"error: --experiment {args.experiment}: no such experiment in {tracking_uri}", file=sys.stderr)
            return 2
    port = args.port or free_port()
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    base = f"http://127.0.0.1:{port}"
    print(f"MLflow UI: {ui_page_url(base, experiment_id)}  (store {tracking_uri}; Ctrl+C stops it)", flush=True)
    if experiment_id is None:
        for name, found in recent_experiments(tracking_uri):  # each one's runs with the summary metrics
            print(f"  {name}: {ui_page_url(base, found)}", flush=True)
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

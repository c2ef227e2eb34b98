"""`compat ui` serves the machine's one tracking store on 127.0.0.1 and prints its URL (that `compat run` tracks
there by default is checked in tests/pipelines/test_run_command_tracking.py)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.request import urlopen

import pytest
import ray  # noqa: F401 - Ray ships psutil: importing ray first puts it on the path
import psutil  # noqa: I001

from cluster.ray.local_head import free_port
from local_services import wait_for_ui

ROOT = Path(__file__).resolve().parents[2]


def test_compat_ui_serves_the_machine_store_on_loopback(tmp_path):
    from mlflow import MlflowClient

    from cluster.tracking.store import machine_tracking_uri

    home = tmp_path / "compat-home"
    env = dict(os.environ, COMPAT_HOME=str(home), PYTHONPATH=str(ROOT))
    env.pop("MLFLOW_TRACKING_URI", None)
    uri = machine_tracking_uri()  # this test's COMPAT_HOME (conftest)
    assert uri == f"sqlite:///{home / 'mlflow' / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("ui-check")
    run = client.create_run(experiment, run_name="visible-run")
    client.log_metric(run.info.run_id, "AA", 0.5)
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "app.cli", "ui", "--port", str(port)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        first_line = process.stdout.readline()
        assert first_line.startswith(f"MLflow UI: http://127.0.0.1:{port}/#/experiments?workflowType=machine_learning")
        assert uri in first_line, first_line
        # then each experiment with runs and the URL of its runs table (the empty Default experiment is left out)
        assert process.stdout.readline().strip() == (f"ui-check: http://127.0.0.1:{port}/#/experiments/{experiment}"
                                                     f"/runs?viewStateShareKey=compat-results&"
                                                     f"workflowType=machine_learning")
        wait_for_ui(process, port, 90)
        body = json.loads(urlopen(f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/get-by-name"
                                  f"?experiment_name=ui-check", timeout=10).read())
        assert body["experiment"]["experiment_id"] == experiment
        listening = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout
        assert f"127.0.0.1:{port}" in listening and f"0.0.0.0:{port}" not in listening
        process.send_signal(signal.SIGTERM)  # to `compat ui` alone, as a service manager stops it
        assert process.wait(timeout=60) == 0
        deadline = time.monotonic() + 30
        while f"127.0.0.1:{port}" in subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout:
            assert time.monotonic() < deadline, "the MLflow server outlived compat ui"
            time.sleep(0.5)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_compat_ui_stops_the_mlflow_server_and_its_workers(tmp_path, stop):
    env = dict(os.environ, COMPAT_HOME=str(tmp_path / "compat-home"), PYTHONPATH=str(ROOT))
    env.pop("MLFLOW_TRACKING_URI", None)
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "app.cli", "ui", "--port", str(port)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_for_ui(process, port, 90)
        tree = psutil.Process(process.pid).children(recursive=True)
        assert any("mlflow" in " ".join(child.cmdline()) for child in tree), [child.cmdline() for child in tree]
        os.kill(process.pid, stop)   # the command only, as `kill PID` does
        assert process.wait(timeout=60) == 0, process.stdout.read()
        _, alive = psutil.wait_procs(tree, timeout=30)
        living = [f"{child.name()}({child.pid})" for child in alive
                  if child.is_running() and child.status() != psutil.STATUS_ZOMBIE]
        assert not living, f"left running after {stop.name}: {living}"
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)

"""The one resolution of a command's tracking target (cluster.tracking.store.resolve_tracking): --tracking-uri, then
MLFLOW_TRACKING_URI, then the machine's store; ``none`` turns tracking off; a bad URI names where it came from."""
from __future__ import annotations

import argparse

import pytest

from app.dispatch import run_command
from cluster.tracking.store import TrackingTarget, resolve_tracking


def test_flag_then_environment_then_machine_store(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPAT_HOME", str(tmp_path / "home"))
    machine = f"sqlite:///{tmp_path / 'home' / 'mlflow' / 'mlflow.db'}"
    server, other = "http://127.0.0.1:5001", f"sqlite:///{tmp_path / 'other.db'}"
    assert resolve_tracking(server, {"MLFLOW_TRACKING_URI": other}) == TrackingTarget(server, "--tracking-uri")
    assert resolve_tracking(None, {"MLFLOW_TRACKING_URI": other}) == TrackingTarget(other, "MLFLOW_TRACKING_URI")
    assert resolve_tracking(None, {}) == TrackingTarget(machine, "machine store")
    assert resolve_tracking(None, {"MLFLOW_TRACKING_URI": ""}) == TrackingTarget(machine, "machine store")
    assert (tmp_path / "home" / "mlflow").is_dir()
    assert resolve_tracking(server, {}).explicit and not resolve_tracking(None, {}).explicit


def test_none_turns_tracking_off_from_the_flag_or_the_environment():
    for target in (resolve_tracking("none", {"MLFLOW_TRACKING_URI": "http://127.0.0.1:5001"}),
                   resolve_tracking(None, {"MLFLOW_TRACKING_URI": "none"})):
        assert target.uri is None and target.source == "off" and not target.enabled


def test_a_bad_uri_names_its_source_and_never_its_password(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    with pytest.raises(ValueError, match=r"^--tracking-uri: tracking URI 'mysql://nope': expected sqlite:///PATH"):
        resolve_tracking("mysql://nope", {})
    with pytest.raises(ValueError, match=r"^MLFLOW_TRACKING_URI: tracking URI 'ftp://ana:\*\*\*@h'") as error:
        resolve_tracking(None, {"MLFLOW_TRACKING_URI": "ftp://ana:hunter2@h"})
    assert "hunter2" not in str(error.value)
    target = resolve_tracking("https://ana:s3cr3t@mlflow.example.com:5000", {})
    assert target.uri == "https://mlflow.example.com:5000"  # the credentials moved to MLflow's variables
    import os

    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "ana" and os.environ["MLFLOW_TRACKING_PASSWORD"] == "s3cr3t"


def test_dispatch_hands_the_resolved_target_down_and_drops_the_raw_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COMPAT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    seen = {}
    fake = argparse.Namespace(command="ui", tracking_uri=None, port=0, debug=False)
    import app.commands.ui as ui

    monkeypatch.setattr(ui, "run", lambda args: seen.update(vars(args)) or 0)
    assert run_command(fake) == 0
    assert "tracking_uri" not in seen
    assert seen["tracking"] == TrackingTarget(f"sqlite:///{tmp_path / 'home' / 'mlflow' / 'mlflow.db'}",
                                              "machine store")
    bad = argparse.Namespace(command="ui", tracking_uri="mysql://nope", port=0, debug=False)
    assert run_command(bad) == 2
    assert "error: --tracking-uri: tracking URI 'mysql://nope'" in capsys.readouterr().err


def test_index_build_reads_the_machine_store_without_the_option(tmp_path, monkeypatch, capsys):
    """`compat index build` (like every command) uses the machine's store when neither --tracking-uri nor
    MLFLOW_TRACKING_URI names one: the model is looked up there (an empty store: the alias is not set)."""
    from pathlib import Path

    from app.cli import main

    monkeypatch.setenv("COMPAT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = Path(__file__).resolve().parents[2] / "configs" / "demo-er.yaml"
    code = main(["index", "build", str(tmp_path / "index"), "--config", str(config), "--model",
                 "models:/absent-model@champion"])
    error = capsys.readouterr().err
    assert code == 2
    store = f"sqlite:///{tmp_path / 'home' / 'mlflow' / 'mlflow.db'}"
    assert f"models:/absent-model@champion: registered model 'absent-model' has no alias 'champion' (tracking " \
           f"server {store})" in error
    assert main(["index", "build", str(tmp_path / "index"), "--config", str(config), "--model",
                 "models:/absent-model:champion"]) == 2
    assert "--model: 'models:/absent-model:champion' is not an MLflow model URI" in capsys.readouterr().err


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("argv", [["gate", "history", "some-model"], ["run", "CONFIG", "--no-progress"]])
def test_a_closed_tracking_port_fails_in_one_line_naming_the_uri(argv, tmp_path):
    """The command says what it waits for, retries for the bounded time, then stops with one line naming the URI:
    no MLflow exception, no traceback, before any stage."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))
    import tiny_scenario_helpers as tiny

    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny.scenario("er", output=str(tmp_path / "run"))))
    uri = f"http://127.0.0.1:{_closed_port()}"
    root = Path(__file__).resolve().parents[2]
    argv = [str(config) if word == "CONFIG" else word for word in argv]
    done = subprocess.run([sys.executable, "-m", "app.cli", *argv, "--tracking-uri", uri], cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root), "COMPAT_TRACKING_WAIT_S": "3"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith(f"waiting for the MLflow tracking server at {uri} (")
    assert lines[-1].startswith(f"error: the MLflow tracking server at {uri} does not answer (")
    assert "retrying for up to 3 s" in lines[0] and "Traceback" not in done.stderr
    assert "MlflowException" not in done.stderr and not (tmp_path / "run").exists()

"""`compat gate` and `compat gate rollback` killed (SIGKILL, a real process) between the steps of an alias move: the
next gate / rollback / history reconciles, so history and the alias always agree."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "pipelines"
sys.path.insert(0, str(TINY))
import tiny_scenario_helpers as tiny  # noqa: E402


def _versions(client, name: str, count: int, folder: Path) -> list[str]:
    client.create_registered_model(name)
    experiment = client.create_experiment(f"{name}-runs")
    found = []
    for index in range(count):
        run = client.create_run(experiment)
        (folder / "weights.txt").write_text(str(index))
        client.log_artifact(run.info.run_id, str(folder / "weights.txt"), "model")
        client.set_terminated(run.info.run_id)
        found.append(client.create_model_version(name, f"runs:/{run.info.run_id}/model", run.info.run_id).version)
    return [str(v) for v in found]


def _killed_at(point: str, args: list[str], env: dict) -> None:
    """Run `compat ARGS` until it pauses at ``point`` of the move, then SIGKILL it."""
    code = (f"import sys; sys.path.insert(0, {str(TINY)!r}); import tiny_scenario_helpers as t; t.register(); "
            f"from app.cli import main; sys.exit(main({args!r}))")
    process = subprocess.Popen([sys.executable, "-c", code], env={**env, "COMPAT_TEST_GATE_PAUSE": point},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        for line in process.stderr:
            if f"gate: paused at {point}" in line:
                break
            assert time.monotonic() < deadline
        else:
            raise AssertionError(f"the gate ended without pausing at {point} (exit {process.wait()})")
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait(timeout=30)


def _history(name: str, uri: str, capsys) -> list[dict]:
    from app.cli import main

    capsys.readouterr()
    assert main(["gate", "history", name, "--tracking-uri", uri, "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    return json.loads("\n".join(lines[max(i for i, line in enumerate(lines) if line in ("[", "[]")):]))


def test_a_killed_gate_or_rollback_never_leaves_history_and_alias_apart(mlflow_server, tmp_path, capsys):
    from mlflow import MlflowClient

    from cluster.model_registry.versions import version_by_alias

    uri = mlflow_server.tracking_uri
    client = MlflowClient(uri)
    name = f"gate-kill-{uuid.uuid4().hex[:6]}"
    v1, v2 = _versions(client, name, 2, tmp_path)
    tiny.register()
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny.scenario("er")))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    gate = ["gate", name, "--candidate", v1, "--config", str(config), "--tracking-uri", uri]

    # killed after recording the intent, before the alias moved: history says interrupted, the alias is unset
    _killed_at("intent", gate, env)
    assert version_by_alias(client, name, "champion") is None
    rows = _history(name, uri, capsys)
    assert [(r["decision"], r["new_version"]) for r in rows] == [("interrupted", None)]
    # killed after the alias moved, before confirming: the move is confirmed by the next reader
    _killed_at("moved", gate, env)
    assert str(version_by_alias(client, name, "champion").version) == v1
    rows = _history(name, uri, capsys)
    assert [(r["decision"], r["new_version"]) for r in rows] == [("interrupted", None), ("promoted", v1)]
    # the same for a rollback: intent only -> interrupted (alias still v1); moved -> confirmed (alias v2)
    rollback = ["gate", "rollback", name, "--to", v2, "--tracking-uri", uri]
    _killed_at("intent", rollback, env)
    assert str(version_by_alias(client, name, "champion").version) == v1
    assert _history(name, uri, capsys)[-1]["decision"] == "interrupted"
    _killed_at("moved", rollback, env)
    rows = _history(name, uri, capsys)
    assert (rows[-1]["decision"], rows[-1]["new_version"]) == ("rolled-back", v2)
    assert str(version_by_alias(client, name, "champion").version) == v2
    # every gate run is ended, none left RUNNING; the next rollback follows the recorded moves (v2 -> v1)
    runs = client.search_runs([client.get_experiment_by_name("compat-gate").experiment_id],
                              f"tags.registered_model = '{name}'")
    assert sorted(r.info.status for r in runs) == ["FINISHED", "FINISHED", "KILLED", "KILLED"]
    from app.cli import main

    assert main(["gate", "rollback", name, "--tracking-uri", uri]) == 0
    assert str(version_by_alias(client, name, "champion").version) == v1

"""A gate and a rollback killed (SIGKILL, a real process) between the steps of an alias move: the next gate /
rollback / history reconciles, so history and the alias always agree. The process stops where the gate's
``on_move_step`` callback tells it (the command line passes none)."""
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

from cluster.model_registry import gate as gate_module

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "pipelines"
sys.path.insert(0, str(TINY))
import tiny_scenario_helpers as tiny  # noqa: E402
from registry_models import register_files, tiny_model_files  # noqa: E402


def _versions(client, name: str, count: int, folder: Path) -> list[str]:
    return [register_files(client, name, tiny_model_files(seed=index), folder) for index in range(count)]


_PAUSING = """
import sys, time
sys.path.insert(0, {tiny!r})
import tiny_scenario_helpers as t
t.register()
from cluster.model_registry import gate
from pipelines.config.load import load_config


def pause(step):
    if step == {point!r}:
        print(f"gate: paused at {{step}}", file=sys.stderr, flush=True)
        while True:
            time.sleep(60)


action, uri, name, value, config = {call!r}
if action == "gate":
    gate.run_gate(uri, name, value, load_config(config), on_move_step=pause)
else:
    gate.rollback(uri, name, to_version=value, on_move_step=pause, force=True)
"""


def _killed_at(point: str, call: tuple, env: dict) -> None:
    """Run a gate or a rollback (``call``: action, tracking URI, model, candidate or target version, config) until
    it pauses at ``point`` of the move, then SIGKILL it."""
    assert point in gate_module.MOVE_STEPS
    code = _PAUSING.format(tiny=str(TINY), point=point, call=call)
    process = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
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


def _install_tags(client, name: str, version: str) -> dict[str, str]:
    tags = client.get_model_version(name, version).tags
    return {key: value for key, value in tags.items() if key.startswith("gate.champion.")}


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
    gate = ("gate", uri, name, v1, str(config))
    assert gate_module.MOVE_STEPS == ("intent", "tagged", "moved")

    # killed after recording the intent, before the alias moved: history says interrupted, the alias is unset
    _killed_at("intent", gate, env)
    assert version_by_alias(client, name, "champion") is None
    rows = _history(name, uri, capsys)
    assert [(r["decision"], r["new_version"]) for r in rows] == [("interrupted", None)]
    assert _install_tags(client, name, v1) == {}
    # killed with the candidate's install tags written, before the alias moved: the tags are put back
    _killed_at("tagged", gate, env)
    assert version_by_alias(client, name, "champion") is None
    assert _install_tags(client, name, v1)["gate.champion.decision"] == "promoted"
    rows = _history(name, uri, capsys)
    assert [(r["decision"], r["new_version"]) for r in rows] == [("interrupted", None)] * 2
    assert _install_tags(client, name, v1) == {}
    # killed after the alias moved, before confirming: the move is confirmed by the next reader
    _killed_at("moved", gate, env)
    assert str(version_by_alias(client, name, "champion").version) == v1
    rows = _history(name, uri, capsys)
    assert [(r["decision"], r["new_version"]) for r in rows] == [("interrupted", None)] * 2 + [("promoted", v1)]
    assert _install_tags(client, name, v1) == {"gate.champion.decision": "promoted",
                                               "gate.champion.run_id": rows[-1]["run_id"]}
    # the same for a rollback: intent or tagged only -> interrupted (alias still v1, no tag written); moved ->
    # confirmed (alias v2) with the tags that follow the move written by the reader
    rollback = ("rollback", uri, name, v2, None)
    for point in ("intent", "tagged"):
        _killed_at(point, rollback, env)
        assert str(version_by_alias(client, name, "champion").version) == v1
        assert _history(name, uri, capsys)[-1]["decision"] == "interrupted"
        assert "gate.champion.rolled_back_by" not in _install_tags(client, name, v1)
        assert _install_tags(client, name, v2) == {}
    _killed_at("moved", rollback, env)
    rows = _history(name, uri, capsys)
    assert (rows[-1]["decision"], rows[-1]["new_version"]) == ("rolled-back", v2)
    assert str(version_by_alias(client, name, "champion").version) == v2
    assert _install_tags(client, name, v1)["gate.champion.rolled_back_by"] == rows[-1]["run_id"]
    assert _install_tags(client, name, v2) == {"gate.champion.decision": "rolled-back"}
    # every gate run is ended, none left RUNNING; the next rollback follows the recorded moves (v2 -> v1)
    runs = client.search_runs([client.get_experiment_by_name("compat-gate").experiment_id],
                              f"tags.registered_model = '{name}'")
    assert sorted(r.info.status for r in runs) == ["FINISHED"] * 2 + ["KILLED"] * 4
    from app.cli import main

    assert main(["gate", "rollback", name, "--tracking-uri", uri]) == 0
    assert str(version_by_alias(client, name, "champion").version) == v1

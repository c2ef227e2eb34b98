"""What `compat tune` prints, from a tiny real search run as a user runs it (its own process, a real embedded Ray
instance, a SQLite MLflow store): the product's own lines per trial event, none of Ray Tune's start-up box, Ray's
per-checkpoint lines or Optuna's notes about the sampler the product chose; and a trial that fails still shows its
error."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "pipelines" / "tiny_scenario_helpers.py"
sys.path.insert(0, str(TINY.parent))
import tiny_scenario_helpers as tiny  # noqa: E402

pytestmark = pytest.mark.integration
SPACE = {"parameters": {"method.params.lam": {"type": "categorical", "values": [0.0, 1.0]}}}
NOISE = ("Configuration for experiment", "View detailed results here", "To visualize your results with TensorBoard",
         "Checkpoint successfully created", "A new study created", "ExperimentalWarning", "Trial Status")
# a plugin that registers the tiny scenario everywhere and fails inside a trial (a Ray actor), not in the driver
FAILING_PLUGIN = f"""
import sys
sys.path.insert(0, {str(TINY.parent)!r})
import tiny_scenario_helpers


def register():
    import ray

    tiny_scenario_helpers.register()
    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        raise RuntimeError("planted failure inside the trial")
"""


def _tune(tmp_path: Path, name: str, plugin: str, samples: int) -> subprocess.CompletedProcess:
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny.scenario("dsimplex-hoc", {"lam": 0.1, "rho": 10.0})))
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE, sort_keys=False))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_AIR_NEW_OUTPUT", None)
    command = [sys.executable, "-m", "app.cli", "tune", str(config), "--space", str(space), "--samples", str(samples),
               "--concurrent", "1", "--scheduler", "none", "--objective", "aa", "--storage", str(tmp_path / "searches"),
               "--name", name, "--plugin", plugin, "--cpus-per-trial", "1",
               "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_tune_prints_its_own_trial_lines_and_none_of_tunes_boxes(tmp_path):
    result = _tune(tmp_path, "quiet", f"{TINY}:register", samples=2)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    for noise in NOISE:
        assert noise not in output, (noise, output[-3000:])
    events = [line for line in result.stdout.splitlines() if line.startswith("[search ")]
    assert sum(line.endswith(": finished") for line in events) == 2, events
    assert sum("reported, AA " in line for line in events) == 2 * 3, events   # 2 trials x 3 tasks
    assert "search quiet: 2 of 2 trials" in result.stdout


def test_a_failing_trial_still_shows_its_error(tmp_path):
    plugin = tmp_path / "failing_plugin.py"
    plugin.write_text(FAILING_PLUGIN)
    result = _tune(tmp_path, "failing", f"{plugin}:register", samples=1)
    output = result.stdout + result.stderr
    # the search summary marks the trial, and the command fails naming it
    assert result.returncode == 1 and "compat tune: 1 of 1 trials failed (" in result.stderr, output[-3000:]
    assert any(line.split()[3:4] == ["ERROR"] for line in result.stdout.splitlines() if line.startswith("  ")), \
        result.stdout[-3000:]
    assert "planted failure inside the trial" in output, output[-3000:]
    assert any(line.startswith("[search ") and line.endswith(
        "failed (its error is in the trial's folder and the search summary)") for line in output.splitlines()), \
        output[-3000:]
    assert "Configuration for experiment" not in output

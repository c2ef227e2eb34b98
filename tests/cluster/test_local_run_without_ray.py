"""`compat run --executor local` needs no Ray: on a machine where `import ray` fails (a bare GPU machine with
PyTorch only), the run completes and its matrix equals the one of the same run with Ray installed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parents[1] / "pipelines"
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import tiny_scenario_helpers as tiny  # noqa: E402

# run before the CLI script: every import of ray (or a submodule) fails as on a machine without it
NO_RAY = """
import importlib.abc, sys
class NoRay(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ModuleNotFoundError("No module named 'ray'", name="ray")
        return None
sys.meta_path.insert(0, NoRay())
"""
REPORT_RAY = """
import atexit, sys
atexit.register(lambda: print("ray imported:", "ray" in sys.modules, file=sys.stderr))
"""


def _run(script: Path, config: Path, output: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(script), "run", str(config), "--output", str(output), "--executor",
                           "local", "--no-progress", "--tracking-uri", "none"], env=env, capture_output=True,
                          text=True, timeout=240)


def test_a_local_run_completes_where_ray_cannot_be_imported(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny.scenario("dsimplex-hoc")))
    cli = tiny.CLI_SCRIPT.format(here=str(HERE))
    without, with_ray = tmp_path / "without_ray.py", tmp_path / "with_ray.py"
    without.write_text(NO_RAY + REPORT_RAY + cli)
    with_ray.write_text(REPORT_RAY + cli)

    bare = _run(without, config, tmp_path / "bare")
    assert bare.returncode == 0, bare.stderr[-3000:]
    assert "ray imported: False" in bare.stderr
    reference = _run(with_ray, config, tmp_path / "reference")
    assert reference.returncode == 0, reference.stderr[-3000:]
    for name in ("matrix.json", "metrics.json"):
        assert json.loads((tmp_path / "bare" / name).read_text()) == json.loads(
            (tmp_path / "reference" / name).read_text())

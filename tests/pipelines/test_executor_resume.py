"""Kill a run (SIGKILL) mid-way, resume it, and get the results of an uninterrupted run; done stages are skipped."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import tiny_scenario_helpers as tiny
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]



def _run(args, script, wait=True):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    command = [sys.executable, str(script), *args]
    if wait:
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_kill_and_resume_matches_uninterrupted_run(tmp_path):
    script = tmp_path / "compat_tiny.py"
    script.write_text(tiny.CLI_SCRIPT.format(here=str(HERE)))
    config_path = tmp_path / "tiny.yaml"
    config_path.write_text(yaml.safe_dump(tiny.scenario("dsimplex-hoc")))

    reference_dir = tmp_path / "reference"
    done = _run(["run", str(config_path), "--output", str(reference_dir), "--no-progress"], script)
    assert done.returncode == 0, done.stderr[-2000:]

    killed_dir = tmp_path / "killed"
    process = _run(["run", str(config_path), "--output", str(killed_dir), "--no-progress"], script, wait=False)
    manifests = killed_dir / "manifests"
    deadline = time.time() + 180
    while time.time() < deadline and process.poll() is None:
        if manifests.exists() and len([p for p in manifests.glob("*.json") if not p.name.startswith(".tmp-")]) >= 3:
            break
        time.sleep(0.05)
    assert process.poll() is None, "the run finished before it could be killed"
    process.send_signal(signal.SIGKILL)
    process.wait()
    # a kill during an atomic write leaves its temporary file (.tmp-*), which is not a committed manifest
    committed_before = {p.stem for p in manifests.glob("*.json") if not p.stem.startswith(("entry-", ".tmp-"))}
    assert len(committed_before) >= 3
    assert not (killed_dir / "matrix.json").exists()

    resumed = _run(["run", "--resume", str(killed_dir), "--no-progress"], script)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    executions = sorted((killed_dir / "executions").glob("*.json"))
    last = json.loads(executions[-1].read_text())
    assert committed_before <= set(last["skipped"])  # every stage committed before the kill was skipped
    assert not committed_before & set(last["executed"])

    for name in ("matrix.json", "metrics.json"):
        assert json.loads((killed_dir / name).read_text()) == json.loads((reference_dir / name).read_text()), name
    for run_dir in (reference_dir, killed_dir):  # the run directory contract of `compat run`
        assert {"config.yaml", "matrix.json", "metrics.json", "report.md", "matrix.png"} <= {
            path.name for path in run_dir.iterdir()}, run_dir

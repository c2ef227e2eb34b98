"""The driver of a tracked run dies (SIGKILL) mid-run; `compat run --resume` marks the stage runs it left RUNNING
KILLED, continues under the same MLflow parent run, and ends with no run RUNNING (SQLite tracking, the default: the
machine's store under COMPAT_HOME, a folder of this test's own). The matrix of a killed-and-resumed run is checked
in test_executor_resume.py."""
import json
import signal
import sqlite3
import time
from pathlib import Path

import pytest

import tiny_scenario_helpers as tiny
import yaml
from test_executor_resume import HERE, _run


def _statuses(database: Path) -> list[tuple[str, str, str]]:
    """(run_uuid, status, run_role tag) of every run in an MLflow SQLite store (plain SQL, no write of ours).

    Not a read-only connection: a driver killed inside a write transaction leaves a hot journal that the next
    connection must roll back, which a read-only one cannot do ("attempt to write a readonly database"; it
    happened under load). Rolling it back is what MLflow's own next connection does too."""
    with sqlite3.connect(str(database)) as connection:
        return connection.execute(
            "select r.run_uuid, r.status, coalesce(t.value, '') from runs r left join tags t "
            "on t.run_uuid = r.run_uuid and t.key = 'run_role'").fetchall()


def test_resume_after_driver_loss_leaves_no_run_running_and_keeps_the_parent(tmp_path):
    script = tmp_path / "compat_tiny.py"
    script.write_text(tiny.CLI_SCRIPT.format(here=str(HERE)))
    config_path = tmp_path / "tiny.yaml"
    config_path.write_text(yaml.safe_dump(tiny.scenario("dsimplex-hoc")))
    run_dir = tmp_path / "run"
    process = _run(["run", str(config_path), "--output", str(run_dir), "--no-progress"], script, wait=False)
    manifests = run_dir / "manifests"
    deadline = time.time() + 180
    while time.time() < deadline and process.poll() is None:
        if manifests.exists() and len(list(manifests.glob("*.json"))) >= 3:
            break
        time.sleep(0.05)
    assert process.poll() is None, "the run finished before its driver could be killed"
    process.send_signal(signal.SIGKILL)
    process.wait()
    database = tmp_path / "compat-home" / "mlflow" / "mlflow.db"  # the machine's store (conftest: per test)
    stale = {uuid for uuid, status, _ in _statuses(database) if status == "RUNNING"}
    parents = [uuid for uuid, _, role in _statuses(database) if role == "pipeline"]
    assert len(parents) == 1 and parents[0] in stale and len(stale) >= 2  # the parent and the stage in progress

    # a resume that stops before it reaches the interrupted stage (here: at once) still ends its run KILLED
    from cluster.tracking.store import resolve_tracking
    from cluster.tracking.tracker import create_tracker
    from pipelines.config.load import load_config
    from pipelines.graph.compile import compile_scenario
    from pipelines.store.run_store import RunStore

    tiny.register()
    from pipelines.store.lease import run_lease

    tracker = create_tracker(resolve_tracking(None).uri)  # the machine's store, as `compat run` resolves it
    graph = compile_scenario(load_config(str(run_dir / "config.yaml")))
    with pytest.raises(RuntimeError, match="does not hold the run folder's lease"):
        tracker.start(graph, RunStore(str(run_dir)))  # without the lease the driver may be alive: nothing marked
    assert {status for uuid, status, _ in _statuses(database) if uuid in stale} == {"RUNNING"}
    with run_lease(str(run_dir)):  # the lease passed to this process: the driver that ran the stages is gone
        tracker.start(graph, RunStore(str(run_dir)))
        tracker.finish("KILLED")
    tracker.close()
    early = dict((uuid, status) for uuid, status, _ in _statuses(database))
    assert {early[uuid] for uuid in stale} == {"KILLED"}

    resumed = _run(["run", "--resume", str(run_dir), "--no-progress"], script)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    after = _statuses(database)
    assert [uuid for uuid, _, role in after if role == "pipeline"] == parents  # continued under the same parent
    assert not [uuid for uuid, status, _ in after if status == "RUNNING"]
    assert dict((uuid, status) for uuid, status, _ in after)[parents[0]] == "FINISHED"
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as connection:
        killed = dict(connection.execute("select value, run_uuid from tags where key = 'stale_runs_killed'"))
    assert killed and int(next(iter(killed))) == len(stale) - 1  # every stale stage run was ended KILLED first
    assert json.loads((run_dir / "metrics.json").read_text())["num_tasks"] == 3

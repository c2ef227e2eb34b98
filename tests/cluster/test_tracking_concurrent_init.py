"""Three processes opening one fresh SQLite MLflow store at the same instant all succeed: creation and migration
happen under a file lock (without it two of three failed: 'duplicate column name', '_alembic_tmp_runs exists')."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

WORKER = """
import sys, time
start = float(sys.argv[2])
from cluster.tracking.tracker import create_tracker
from cluster.tracking.client import ensure_experiment
time.sleep(max(0.0, start - time.time()))  # every process reaches the fresh store at the same instant
tracker = create_tracker(sys.argv[1], experiment="concurrent")
experiment = ensure_experiment(tracker.client, "concurrent")
run = tracker.client.create_run(experiment, tags={"worker": sys.argv[3]})
tracker.client.set_terminated(run.info.run_id)
print("ok", run.info.run_id)
"""


def test_three_processes_initialise_one_fresh_sqlite_store(tmp_path):
    from mlflow import MlflowClient

    database = tmp_path / "runs" / "mlflow.db"
    uri = f"sqlite:///{database}"
    start = time.time() + 8  # after the three interpreters have imported mlflow
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MLFLOW_TRACKING_URI", None)
    processes = [subprocess.Popen([sys.executable, "-c", WORKER, uri, str(start), str(i)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
    outputs = [process.communicate(timeout=240) for process in processes]
    for process, (out, err) in zip(processes, outputs):
        assert process.returncode == 0 and out.startswith("ok"), err[-3000:]
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("concurrent").experiment_id])
    assert sorted(run.data.tags["worker"] for run in runs) == ["0", "1", "2"]
    assert (database.parent / "mlflow.db.lock").exists()

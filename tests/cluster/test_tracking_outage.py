"""An MLflow server that stops answering in the middle of a run (a real ``mlflow server``, SIGSTOPped: its port
still accepts connections, nothing answers): the run says so within 10 s naming the server, goes on computing
while the server is silent, says when it answers again, and ends with every stage tracked."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.request import Request, urlopen

import pytest
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "pipelines"))
import tiny_scenario_helpers as tiny  # noqa: E402
from local_services import MlflowServer  # noqa: E402

from pipelines.config.load import validate_config  # noqa: E402
from pipelines.graph.compile import compile_scenario  # noqa: E402

ROOT = HERE.parents[1]
NOTICE = re.compile(r"MLflow: the tracking server at (\S+) does not answer \(a request has waited (\d+) s and "
                    r"/health gets no answer\); the run goes on and its tracking records wait in order")


def _committed(run_dir: Path) -> int:
    manifests = run_dir / "manifests"
    return len([p for p in manifests.glob("*.json") if not p.name.startswith(".tmp-")]) if manifests.exists() else 0


def _wait(condition, timeout_s: float, what: str, process: subprocess.Popen, log: Path):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        if process.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"{what}: not seen (run exit {process.poll()}); its stderr:\n{log.read_text()[-3000:]}")


def _search(uri: str, experiment_id: str, filter_string: str) -> list[dict]:
    body = json.dumps({"experiment_ids": [experiment_id], "filter": filter_string, "max_results": 1000}).encode()
    request = Request(f"{uri}/api/2.0/mlflow/runs/search", data=body, method="POST",
                      headers={"Content-Type": "application/json"})
    with urlopen(request, timeout=30) as response:
        return json.loads(response.read()).get("runs", [])


@pytest.mark.integration
def test_a_server_that_stops_answering_mid_run_is_named_and_the_run_goes_on(tmp_path):
    tiny.register()
    document = tiny.scenario("dsimplex-hoc", output=str(tmp_path / "run"))
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(document))
    script = tmp_path / "compat_tiny.py"
    script.write_text(tiny.CLI_SCRIPT.format(here=str(HERE.parent / "pipelines")))
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    with MlflowServer(tmp_path / "mlflow") as server:
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        with log.open("w") as stderr:
            process = subprocess.Popen([sys.executable, str(script), "run", str(tmp_path / "tiny.yaml"),
                                        "--tracking-uri", server.tracking_uri, "--no-progress"],
                                       env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        stopped = False
        try:
            _wait(lambda: _committed(run_dir) >= 1, 240, "a first committed stage", process, log)
            os.killpg(server.process.pid, signal.SIGSTOP)  # the server and its workers: frozen, port still open
            stopped, stopped_at, committed_at_stop = True, time.monotonic(), _committed(run_dir)
            notice = _wait(lambda: NOTICE.search(log.read_text()), 60, "the notice", process, log)
            noticed_after = time.monotonic() - stopped_at
            assert notice.group(1) == server.tracking_uri
            # the product's own measure of the request's wait when it spoke, and the wall time since the stop
            assert int(notice.group(2)) <= 10 and noticed_after <= 15, (notice.group(0), noticed_after)
            # the run goes on while the server is silent: more stages commit
            _wait(lambda: _committed(run_dir) > committed_at_stop, 180, "a stage committed while the server is "
                  "stopped", process, log)
            assert "answers again" not in log.read_text()
        finally:
            if stopped:
                os.killpg(server.process.pid, signal.SIGCONT)
        code = process.wait(timeout=300)
        text = log.read_text()
        assert code == 0, text[-3000:]
        assert re.search(rf"MLflow: the tracking server at {re.escape(server.tracking_uri)} answers again after "
                         rf"\d+ s; sending the \d+ queued tracking record\(s\)", text), text[-3000:]
        assert len(NOTICE.findall(text)) == 1  # one line per outage, not one per record
        print(f"notice {noticed_after:.1f} s after SIGSTOP: {notice.group(0)}")
        # every stage is tracked once the server answers: the pipeline run FINISHED with a FINISHED run per stage
        with urlopen(f"{server.tracking_uri}/api/2.0/mlflow/experiments/get-by-name?experiment_name="
                     f"{document['name']}", timeout=30) as response:
            experiment_id = json.loads(response.read())["experiment"]["experiment_id"]
        [parent] = _search(server.tracking_uri, experiment_id, "tags.run_role = 'pipeline'")
        assert parent["info"]["status"] == "FINISHED"
        children = _search(server.tracking_uri, experiment_id,
                           f"tags.`mlflow.parentRunId` = '{parent['info']['run_id']}'")
        graph = compile_scenario(validate_config(document))
        labels = sorted(stage.label for stage in graph if stage.kind != "entry")
        assert sorted(next(t["value"] for t in run["data"]["tags"] if t["key"] == "stage_label")
                      for run in children) == labels
        assert all(run["info"]["status"] == "FINISHED" for run in children)


def test_a_record_the_server_does_not_take_stops_the_tracking_and_is_raised_at_the_end():
    """Error path of the record queue (no server): the records before the failing one are handled in order, the
    ones after it are dropped, one line says so, and drain() raises the error."""
    from cluster.tracking.outage import RecordQueue, ServerWatch

    handled, lines = [], []

    def handle(record):
        if record == 2:
            raise ConnectionError("MLflow gave up after 5 tries")
        handled.append(record)

    records = RecordQueue(handle, ServerWatch("http://127.0.0.1:1", log=lines.append, answers=lambda uri: True))
    for record in range(5):
        records.put(record)
    with pytest.raises(ConnectionError, match="gave up after 5 tries"):
        records.drain()
    assert handled == [0, 1]
    assert len(lines) == 1 and lines[0].startswith("MLflow: tracking of this run stopped at a record the server at "
                                                   "http://127.0.0.1:1 did not take (ConnectionError: ")


def test_the_watch_speaks_once_per_outage_and_not_for_a_slow_server_that_answers():
    """A request that waits past notice_s: silent while /health answers (slow, not gone); one notice when it does
    not, and one line when the request completes."""
    from cluster.tracking.outage import ServerWatch

    lines, answering = [], [True]
    watch = ServerWatch("http://127.0.0.1:1", notice_s=0.2, log=lines.append, answers=lambda uri: answering[0])
    with watch.request(lambda back: "back" if back else "meanwhile"):
        time.sleep(1.2)  # probed once after 0.2 s: it answers, so nothing is said
        assert lines == []
    answering[0] = False
    with watch.request(lambda back: "back" if back else "meanwhile"):
        deadline = time.monotonic() + 10
        while not lines and time.monotonic() < deadline:
            time.sleep(0.05)
    watch.close()
    assert len(lines) == 2, lines
    assert lines[0].startswith("MLflow: the tracking server at http://127.0.0.1:1 does not answer (a request has "
                               "waited ") and lines[0].endswith("; meanwhile")
    assert lines[1].startswith("MLflow: the tracking server at http://127.0.0.1:1 answers again after ") and \
        lines[1].endswith("; back")

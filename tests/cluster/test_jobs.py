"""Ray Job submission against a real Ray head started by the test on 127.0.0.1 (own ports and temp dir).

The head is started as ``.venv/bin/ray start`` WITHOUT the venv on its PATH (as a user who does not activate it):
a bare ``python`` in an entrypoint is then the system interpreter, so jobs must name theirs (cluster.ray.jobs
python_command).

The head is stopped by signalling its own process group and then any process whose command line holds this
head's unique temp dir: never ``ray stop``, which would stop every Ray instance on the machine (the session's
``ray_local`` fixture and other users' clusters included).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from urllib.request import urlopen

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))
import tiny_scenario_helpers as tiny  # noqa: E402

tiny.register()  # the tiny-synth dataset: configs naming it validate only once it is registered

from cluster.ray import jobs  # noqa: E402
from pipelines.config.load import validate_config  # noqa: E402

VENV_BIN = Path(sys.executable).parent
THEORY = jobs.python_command(["-m", "app.cli", "theory", "--samples", "2000", "--dims", "3", "10"])
PYTHON = shlex.quote(sys.executable)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _pids_with(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


GCS_PORTS: dict[str, int] = {}


@pytest.fixture(scope="module")
def ray_head():
    """`ray start --head --block` on loopback, token auth disabled (acceptable on 127.0.0.1 only); yields its URL."""
    with started_head() as address:
        yield address


@contextmanager
def started_head(ports: dict[str, int] | None = None):
    """A head as :func:`ray_head` starts it; ``ports`` overrides the port options it is given (name -> port)."""
    temp_dir = tempfile.mkdtemp(prefix="rayjob-", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
    port, dashboard_port = _free_port(), _free_port()
    # every fixed default port gets a free one: another Ray on this machine (the ray_local fixture, other users)
    # may hold the defaults, and the job agent then silently disables its HTTP server
    extra_ports = [f"--{name}={(ports or {}).get(name) or _free_port()}" for name in (
        "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port",
        "ray-client-server-port", "node-manager-port", "object-manager-port")]
    # the venv is NOT on the head's PATH (nor VIRTUAL_ENV set): `.venv/bin/ray start` from a shell that never
    # activated it, the situation where a bare `python` entrypoint ran the system interpreter
    path = [entry for entry in os.environ.get("PATH", "").split(os.pathsep)
            if entry and Path(entry).resolve() != VENV_BIN.resolve()]
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled",
               PATH=os.pathsep.join(path or ["/usr/bin", "/bin"]))
    env.pop("RAY_ADDRESS", None)
    env.pop("VIRTUAL_ENV", None)
    log_path = Path(temp_dir) / "head.log"
    process = subprocess.Popen(
        [str(VENV_BIN / "ray"), "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}", "--num-cpus=2",
         "--object-store-memory=200000000", "--disable-usage-stats", f"--temp-dir={temp_dir}", *extra_ports],
        env=env, stdout=log_path.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    address = f"http://127.0.0.1:{dashboard_port}"
    GCS_PORTS[address] = port  # the head's own port, for the driver (--address 127.0.0.1:PORT) test
    try:
        deadline = time.monotonic() + 90
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"ray head exited ({process.returncode}): {log_path.read_text()[-2000:]}")
            try:
                urlopen(f"{address}/api/version", timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ray head not ready after 90 s; see {log_path}")
                time.sleep(0.5)
        previous = os.environ.get("RAY_AUTH_MODE")
        os.environ["RAY_AUTH_MODE"] = "disabled"  # the client side of this loopback-only test head
        yield address
    finally:
        if previous is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = previous
        for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        for pid in _pids_with(temp_dir):  # daemons of this head that left the process group
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_submission_id_and_runtime_env_are_deterministic_and_secret_free(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "do-not-ship-this-secret")
    config = validate_config(tiny.scenario("dsimplex-hoc", output="runs/tiny"))
    first = jobs.submission_id_for(config, "s3://bucket/runs/tiny")
    assert first == jobs.submission_id_for(validate_config(tiny.scenario("dsimplex-hoc", output="runs/tiny")),
                                           "s3://bucket/runs/tiny")
    assert re.fullmatch(r"compat-tiny-dsimplex-hoc-[0-9a-f]{12}", first)
    assert jobs.submission_id_for(config, "s3://bucket/runs/other") != first
    changed = tiny.scenario("dsimplex-hoc", output="runs/tiny")
    changed["training"]["epochs"] = 2
    assert jobs.submission_id_for(validate_config(changed), "s3://bucket/runs/tiny") != first

    env = jobs.pipeline_runtime_env(tmp_path)
    assert env["working_dir"] == str(tmp_path)
    assert [Path(p).name for p in env["py_modules"]] == ["compat_core", "pipelines", "cluster", "app"]
    assert "env_vars" not in env
    for pattern in (".venv", ".git", "runs", "__pycache__"):
        assert pattern in env["excludes"]
    assert "do-not-ship-this-secret" not in json.dumps(env)
    entrypoint = jobs.pipeline_entrypoint("s3://b/r")
    assert entrypoint.startswith(f"py={PYTHON}; ")
    assert entrypoint.endswith('exec "$py" -m app.cli run scenario.yaml --executor ray --no-progress --address auto '
                               '--output s3://b/r')
    assert jobs.pipeline_entrypoint(None, python="python3") == ("exec python3 -m app.cli run scenario.yaml "
                                                                "--executor ray --no-progress --address auto")


def test_job_round_trip_and_idempotent_resubmission(ray_head, tmp_path, capsys):
    client = jobs.job_client(ray_head)
    base_id = f"compat-theory-test-{os.getpid()}"
    env = jobs.pipeline_runtime_env(tmp_path)
    outcome = jobs.submit_entrypoint(client, base_id, THEORY, env)
    assert outcome.submitted and outcome.submission_id == base_id and outcome.attempt == 1
    status = jobs.wait_for(client, base_id, timeout_s=120, poll_s=0.5)
    assert status == "SUCCEEDED", client.get_job_logs(base_id)[-2000:]
    logs = client.get_job_logs(base_id)
    assert "Theorem 1: both inequalities hold" in logs

    jobs_before = len(client.list_jobs())
    again = jobs.submit_entrypoint(client, base_id, THEORY, env)
    assert not again.submitted and again.submission_id == base_id and again.status == "SUCCEEDED"
    assert len(client.list_jobs()) == jobs_before  # no new job

    from app.cli import main

    assert main(["status", base_id, "--address", ray_head]) == 0
    assert f"{base_id}: SUCCEEDED" in capsys.readouterr().out
    assert main(["logs", base_id, "--address", ray_head]) == 0
    assert "Theorem 1: both inequalities hold" in capsys.readouterr().out
    assert main(["status", "--address", ray_head]) == 0
    listing = capsys.readouterr().out
    assert re.search(rf"^{re.escape(base_id)}\s+SUCCEEDED", listing, flags=re.M)
    assert re.match(r"SUBMISSION ID\s+STATUS\s+STARTED\s+MESSAGE\n", listing)  # a header names the columns


def test_failed_job_is_resubmitted_as_a_new_attempt(ray_head):
    client = jobs.job_client(ray_head)
    base_id = f"compat-failing-test-{os.getpid()}"
    failing = f"{PYTHON} -c 'import sys; print(\"stage exploded\"); sys.exit(3)'"
    first = jobs.submit_entrypoint(client, base_id, failing)
    assert jobs.wait_for(client, first.submission_id, timeout_s=120, poll_s=0.5) == "FAILED"
    second = jobs.submit_entrypoint(client, base_id, f"{PYTHON} -c 'print(42)'")
    assert second.submitted and second.attempt == 2 and second.submission_id == f"{base_id}-r2"
    assert jobs.wait_for(client, second.submission_id, timeout_s=120, poll_s=0.5) == "SUCCEEDED"
    assert [(n, s) for n, _, s in jobs.attempts(client, base_id)] == [(1, "FAILED"), (2, "SUCCEEDED")]
    # the latest attempt succeeded: a third submission is a no-op on attempt 2
    third = jobs.submit_entrypoint(client, base_id, f"{PYTHON} -c 'print(42)'")
    assert not third.submitted and third.submission_id == f"{base_id}-r2"


def test_jobs_run_with_the_submitting_interpreter_not_the_heads_path(ray_head, tmp_path):
    """Issue 12: a head started from the venv without activating it ran the system `python` for the entrypoint."""
    client = jobs.job_client(ray_head)
    probe = ["-c", "import sys; print('interpreter:', sys.executable)"]
    cases = {  # submission id -> (entrypoint, expected status, text the log must hold)
        f"compat-python-default-{os.getpid()}": (jobs.python_command(probe), "SUCCEEDED",
                                                 f"interpreter: {sys.executable}\n"),
        f"compat-python-explicit-{os.getpid()}": (jobs.python_command(probe, str(VENV_BIN / "python3")),
                                                  "SUCCEEDED", f"interpreter: {VENV_BIN / 'python3'}\n"),
        f"compat-python-missing-{os.getpid()}": (jobs.python_command(probe, str(tmp_path / "no" / "python")),
                                                 "FAILED", f"--python {tmp_path / 'no' / 'python'} is not an "
                                                           f"executable file on this node"),
    }
    # what the head's shell finds as `python` is not the venv's (the bug's precondition on this machine)
    bare = f"compat-python-bare-{os.getpid()}"
    jobs.submit_entrypoint(client, bare, "command -v python || echo 'no python on PATH'")
    assert jobs.wait_for(client, bare, timeout_s=120, poll_s=0.5) == "SUCCEEDED"
    assert str(VENV_BIN) not in client.get_job_logs(bare)
    # and the driver of a submitted job reads its submission id (what `compat status` shows; tagged in MLflow)
    tagged = f"compat-python-submission-id-{os.getpid()}"
    cases[tagged] = (jobs.python_command(["-c", "from cluster.tracking.tracker import ray_submission_id as s; "
                                                "print('submission id:', s())"]), "SUCCEEDED",
                     f"submission id: {tagged}\n")
    for submission_id, (entrypoint, _, _) in cases.items():
        jobs.submit_entrypoint(client, submission_id, entrypoint, jobs.pipeline_runtime_env(tmp_path))
    for submission_id, (_, status, text) in cases.items():
        assert jobs.wait_for(client, submission_id, timeout_s=120, poll_s=0.5) == status
        assert text in client.get_job_logs(submission_id), client.get_job_logs(submission_id)[-2000:]


def test_driver_address_on_loopback_reaches_the_head_there(ray_head, tmp_path):
    """`--address 127.0.0.1:PORT` against a head started as docs/cluster.md says: the driver joins it (and runs a
    task) instead of dialling the machine's other address and hanging; an unreachable port fails within 10 s."""
    port = GCS_PORTS[ray_head]
    root = Path(__file__).resolve().parents[2]
    code = ("import sys, time, ray; from cluster.ray.task_backend import connect; connect(sys.argv[1]); "
            "print('task', ray.get(ray.remote(lambda: 41 + 1).remote(), timeout=120), flush=True); ray.shutdown()")
    env = dict(os.environ, PYTHONPATH=str(root), RAY_AUTH_MODE="disabled")
    for name in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", code, f"127.0.0.1:{port}"], env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0 and "task 42" in done.stdout, done.stderr[-3000:]


RAY_NO_AGENT = RuntimeError("Request failed with status code 500: No available agent to submit job, please try again "
                            "later..")  # Ray 2.60's JobSubmissionClient, word for word


class _HeadWithoutAgent:
    """A job client whose head answers as one whose job agent never started."""

    def __init__(self) -> None:
        self.calls = 0

    def submit_job(self, **request) -> None:
        self.calls += 1
        raise RAY_NO_AGENT

    def get_address(self) -> str:
        return "http://127.0.0.1:8265"


def test_a_head_without_job_agent_is_one_line_naming_the_cause_and_the_fix():
    client = _HeadWithoutAgent()
    with pytest.raises(RuntimeError) as raised:
        jobs._submit_with_retry(client, "true", "compat-x", {}, {}, patience_s=3.0)
    message = str(raised.value)
    assert client.calls >= 2  # quick answers are retried within the patience
    assert "\n" not in message and "http://127.0.0.1:8265 accepts no jobs" in message
    assert "No available agent" in message and "dashboard_agent.log" in message
    port = int(re.search(r"ray start --head --dashboard-agent-listen-port=(\d+)", message).group(1))
    with socket.socket() as probe:  # the port it suggests is free
        probe.bind(("127.0.0.1", port))


def test_submitting_to_a_head_whose_agent_port_is_taken_fails_with_the_fix(tmp_path):
    """A real `ray start --head` whose job agent cannot bind its listen port (held here, as another Ray instance
    holds the default one): the submission ends in one line naming the port option, not Ray's 500."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        with started_head({"dashboard-agent-listen-port": taken}) as address:
            client = jobs.job_client(address)
            with pytest.raises(RuntimeError, match=r"accepts no jobs.*--dashboard-agent-listen-port=\d+"):
                jobs.submit_entrypoint(client, f"compat-no-agent-{os.getpid()}", THEORY,
                                       jobs.pipeline_runtime_env(tmp_path))


def test_submit_refuses_a_training_stage_no_node_has_the_memory_for(ray_head, tmp_path, capsys):
    """`compat submit --set model.num_slots=100000000` against a real head: exit 2 before anything is submitted,
    naming the key, the estimate and the `memory` total the head's node reports (read here through the same
    state API, independently of the check)."""
    from ray.util.state import list_nodes

    from app.cli import main

    tiny.register()
    config = tmp_path / "tiny.yaml"
    config.write_text(json.dumps(tiny.scenario("dsimplex-hoc", output=str(tmp_path / "run"))))
    code = main(["submit", str(config), "--address", ray_head, "--set", "model.num_slots=100000000"])
    err = capsys.readouterr().err
    assert code == 2, err
    # junction 32 x 99999999 fp32 floats: 99999999 * 32 * 4 bytes = 11.92 GiB of parameters (hand-worked)
    assert "model.num_slots=100000000 with training.batch_size=8" in err and "parameters 11.92" in err
    [node] = list_nodes(address=ray_head)
    memory = node.resources_total["memory"] / float(1 << 30)
    assert f"the largest Ray node that can hold the stage (127.0.0.1, of 1) has {memory:.2f} GiB" in err
    client = jobs.job_client(ray_head)
    assert not [job for job in client.list_jobs() if (job.submission_id or "").startswith("compat-tiny")]

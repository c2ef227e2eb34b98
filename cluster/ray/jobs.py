"""Submission of pipelines to a Ray cluster as Ray Jobs (``compat submit`` / ``status`` / ``logs``).

A pipeline job is the resolved scenario (``--set`` overrides applied) written to ``scenario.yaml`` in a staging
folder that becomes the job's ``working_dir``; the project's packages (compat_core, pipelines, cluster, app) travel as
``py_modules`` (caches, ``.venv``, ``runs``, ``.git`` never do). The entrypoint is
``PYTHON -m app.cli run scenario.yaml --executor ray --address auto --output OUT`` (= ``compat run``), with the
submitting command and its ``--set`` overrides passed on as ``--origin-command`` / ``--origin-set``, which the run
records in its config.yaml (the staged scenario already holds the overridden values).

Interpreter (``compat submit --python``): Ray runs the entrypoint in a shell with the head's environment, so a bare
``python`` is whatever comes first on the PATH of the process that started the head: the system Python when the head
was started as ``.venv/bin/ray start`` without activating the venv. By default the job therefore runs the
interpreter that submitted it (``sys.executable``) when that file exists on the node that runs the job (a head
started from the same checkout or image), and otherwise falls back to ``python`` from the PATH with a line in the
job log saying so; ``--python PATH`` names the interpreter explicitly (the job fails at once, saying why, when it
does not exist there).

Idempotent submission: the submission id is ``compat-<scenario name>-<12 hex>``, the hex hashing the config hash
(results-relevant content), the output location and the entrypoint. Submitting again while the latest attempt with
that id is PENDING, RUNNING or SUCCEEDED does nothing but report it. When the latest attempt FAILED or was STOPPED,
a new attempt is submitted as ``<id>-r2``, ``<id>-r3``...: pipelines resume from their committed stages, so a new
attempt redoes only what is missing.

Secrets: the runtime env carries no environment variables at all (whatever a runtime env holds is visible in the
dashboard and the job table). Storage and tracking credentials must come from the cluster's own environment
(instance roles / IAM, a secret mounted on the pods, ``~/.aws`` on the nodes). The client authenticates to a
token-protected cluster through Ray's standard variables (``RAY_AUTH_MODE=token`` with ``RAY_AUTH_TOKEN`` or
``RAY_AUTH_TOKEN_PATH`` / ``~/.ray/auth_token``), which Ray's client reads itself; this module never reads,
prints or forwards the token. See docs/cluster.md.
"""
from __future__ import annotations

import importlib
import os
import re
import shlex
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from cluster.ray.auth import prepare_client_auth, require_token_if_needed
from cluster.ray.local_head import free_port
from cluster.ray.reach import host_port, is_this_machine, require_answering, require_reachable
from cluster.tracking.run_identity import INTENT_METADATA_KEY
from pipelines.config.load import config_hash, dump_config, stable_hash
from pipelines.config.local_paths import absolute_config, absolute_location, is_local_path, local_config_paths
from pipelines.config.run_origin import RunOrigin
from pipelines.engine.growth import judge_folder
from pipelines.graph.code_version import code_version, package_folder

ID_PREFIX = "compat-"
TERMINAL_STATUSES = ("SUCCEEDED", "FAILED", "STOPPED")
REUSABLE_STATUSES = ("PENDING", "RUNNING", "SUCCEEDED")  # a resubmission is a no-op while the latest is one of these
PACKAGES = ("compat_core", "pipelines", "cluster", "app")
# the memory preflight builds backbones on torch's meta device: imported only when a job is about to be submitted
MEMORY_CHECK_MODULE = "cluster.ray.memory_check"
# Patterns (gitignore syntax) kept out of what is uploaded to the cluster.
RUNTIME_EXCLUDES = (".venv", ".git", "runs", "mlruns", "__pycache__", "*.pyc", "*.egg-info", ".pytest_cache",
                    "*.safetensors", "*.parquet")


@dataclass
class SubmitOutcome:
    """What a submission did. submitted: False when an existing attempt was reused. attempt: 1-based attempt number
    (the ``-rN`` suffix). status: the job status string (PENDING | RUNNING | SUCCEEDED | FAILED | STOPPED)."""

    submission_id: str
    status: str
    submitted: bool
    attempt: int
    message: str = ""
    output: str = ""


def job_client(address: str | None, token_file: str | None = None):
    """JobSubmissionClient for ``address`` (``http(s)://HOST:8265``; None: Ray's RAY_ADDRESS / RAY_API_SERVER_ADDRESS
    variables). A token-protected head is authenticated with the token from Ray's standard places or ``token_file``
    (cluster.ray.auth; Ray's client adds the header, the token is never printed); a head that wants a token when
    none is available is refused with the fix before any request."""
    from ray.job_submission import JobSubmissionClient

    if address is not None and not address.startswith(("http://", "https://")):
        raise ValueError(f"--address {address!r}: expected the cluster's job server, http(s)://HOST:8265")
    source = prepare_client_auth(token_file)
    resolved = address or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS")
    if resolved and resolved.startswith(("http://", "https://")):
        require_reachable(resolved, "Ray job server", 8265)
        require_answering(resolved, "Ray job server", 8265)  # a server that never answers would hang the client
        require_token_if_needed(resolved, source)
    return JobSubmissionClient(address)


def status_name(status: Any) -> str:
    """JobStatus enum (or string) -> its plain name, e.g. 'RUNNING'."""
    return str(getattr(status, "value", status)).split(".")[-1].upper()


def submission_id_for(config: Any, output: str | None, entrypoint_kind: str = "run") -> str:
    """``compat-<name>-<12 hex>`` from the config hash, the output location and the entrypoint kind."""
    name = re.sub(r"[^a-z0-9-]+", "-", str(config.name).lower()).strip("-")[:40] or "scenario"
    digest = stable_hash({"config": config_hash(config), "output": output, "entrypoint": entrypoint_kind})
    return f"{ID_PREFIX}{name}-{digest[:12]}"


def _attempt_of(submission_id: str, base_id: str) -> int | None:
    if submission_id == base_id:
        return 1
    match = re.fullmatch(re.escape(base_id) + r"-r(\d+)", submission_id)
    return int(match.group(1)) if match else None


def attempts(client, base_id: str) -> list[tuple[int, str, str]]:
    """Existing attempts of ``base_id`` on the cluster as (attempt number, submission id, status), oldest first."""
    found = []
    for job in client.list_jobs():
        submission_id = getattr(job, "submission_id", None)
        if not submission_id:
            continue
        attempt = _attempt_of(submission_id, base_id)
        if attempt is not None:
            found.append((attempt, submission_id, status_name(job.status)))
    return sorted(found)


def submit_entrypoint(client, base_id: str, entrypoint: str, runtime_env: dict | None = None,
                      metadata: dict[str, str] | None = None) -> SubmitOutcome:
    """Submit ``entrypoint`` under ``base_id`` unless an attempt is pending, running or succeeded (see module doc)."""
    if not base_id or len(base_id) > 120:
        raise ValueError(f"submission id {base_id!r}: expected 1..120 characters")
    existing = attempts(client, base_id)
    attempt = 1
    if existing:
        number, latest, status = existing[-1]
        if status in REUSABLE_STATUSES:
            return SubmitOutcome(latest, status, False, number, f"job {latest} is already {status}; nothing submitted")
        attempt = number + 1
    submission_id = base_id if attempt == 1 else f"{base_id}-r{attempt}"
    try:
        _submit_with_retry(client, entrypoint, submission_id, runtime_env or {}, metadata or {})
    except RuntimeError as error:
        # another client submitted the same attempt between our listing and our submission
        if "already" not in str(error).lower():
            raise
        status = status_name(client.get_job_status(submission_id))
        return SubmitOutcome(submission_id, status, False, attempt, f"job {submission_id} was submitted "
                                                                    f"concurrently; it is {status}")
    previous = f" (attempt {attempt}: attempt {attempt - 1} ended {existing[-1][2]}; committed stages are reused)" \
        if attempt > 1 else ""
    return SubmitOutcome(submission_id, status_name(client.get_job_status(submission_id)), True, attempt,
                         f"submitted {submission_id}{previous}")


NO_AGENT_TEXT = "no available agent"  # Ray's answer when the head's job agent never registered
AGENT_PATIENCE_S = 15.0
DEFAULT_AGENT_PORT = 52365  # ray start's --dashboard-agent-listen-port


def _submit_with_retry(client, entrypoint: str, submission_id: str, runtime_env: dict, metadata: dict,
                       patience_s: float = AGENT_PATIENCE_S) -> None:
    """submit_job, retried while the head answers "no available agent" and another attempt can end within
    ``patience_s`` seconds of the first (the head itself waits 10 s for its agent before answering so); then
    :func:`no_agent_error`."""
    started = time.monotonic()
    while True:
        attempt_started = time.monotonic()
        try:
            client.submit_job(entrypoint=entrypoint, submission_id=submission_id, runtime_env=runtime_env,
                              metadata=metadata)
            return
        except RuntimeError as error:
            if NO_AGENT_TEXT not in str(error).lower():
                raise
            now = time.monotonic()
            if now + (now - attempt_started) + 1.0 > started + patience_s:
                raise no_agent_error(client.get_address(), now - started) from error
            time.sleep(1.0)


def no_agent_error(address: str, waited_s: float) -> RuntimeError:
    """One line for a head that accepts no job: its job agent is not running, in practice because the agent could
    not bind its port (another Ray instance on the machine holds the default one); names the fix."""
    host, _ = host_port(address, 8265)
    held = ""
    if is_this_machine(host) and port_taken(DEFAULT_AGENT_PORT):
        held = f"; port {DEFAULT_AGENT_PORT}, the default, is in use on this machine"
    return RuntimeError(
        f"the Ray head at {address} accepts no jobs: its job agent is not running (Ray answered \"No available agent "
        f"to submit job\" for {waited_s:.0f} s). Usually the agent could not bind its port, taken by another Ray "
        f"instance on the head's machine{held} (the head's session_latest/logs/dashboard_agent.log says so). Fix: "
        f"stop the other Ray instance, or start this head again with a free agent port: `ray start --head "
        f"--dashboard-agent-listen-port={free_port()}` (`compat cluster up` picks free ports itself)")


def port_taken(port: int) -> bool:
    """Whether a process listens on TCP ``port`` of 127.0.0.1."""
    with socket.socket() as probe:
        probe.settimeout(1.0)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def pipeline_runtime_env(staging_dir: str | Path) -> dict:
    """Runtime env of a pipeline job: the staging folder (scenario.yaml) as working_dir, packages as py_modules
    (each from where this interpreter imports it: the checkout, or site-packages for an installed wheel).

    No ``env_vars``: credentials must come from the cluster's environment (see module docstring)."""
    modules = [str(package_folder(package)) for package in PACKAGES]
    return {"working_dir": str(staging_dir), "py_modules": modules, "excludes": list(RUNTIME_EXCLUDES)}


def python_command(arguments: list[str], python: str | None = None) -> str:
    """Shell command running ``PYTHON arguments...`` on the node that runs the job (see the module doc).

    python: None = the submitting interpreter (``sys.executable``) when it exists there, else ``python`` from the
    node's PATH (said in the job log); a path = exactly that interpreter, failing with a message when it is not an
    executable file there; a bare name (``python3``) = looked up on the node's PATH."""
    tail = shlex.join(arguments)
    if python is None:
        chosen = shlex.quote(sys.executable)
        note = shlex.quote(f"compat submit: {sys.executable} (the submitting interpreter) is not on this node; "
                           f"running python from PATH (choose one with --python)")
        return f'py={chosen}; [ -x "$py" ] || {{ echo {note} >&2; py=python; }}; exec "$py" {tail}'
    if not python.strip():
        raise ValueError("--python: expected an interpreter path or name, got an empty string")
    if "/" not in python:
        return f"exec {shlex.quote(python)} {tail}"
    missing = shlex.quote(f"compat submit: --python {python} is not an executable file on this node")
    return f"[ -x {shlex.quote(python)} ] || {{ echo {missing} >&2; exit 127; }}; exec {shlex.quote(python)} {tail}"


def pipeline_entrypoint(output: str | None, config_file: str = "scenario.yaml", executor: str = "ray",
                        python: str | None = None, origin: RunOrigin | None = None) -> str:
    """Shell command the job runs: ``compat run`` on the staged scenario (module form, so the uploaded packages are
    imported rather than whatever ``compat`` is installed on the node), with the interpreter of
    :func:`python_command`. origin: the submitting command and its overrides, which the job records in the run's
    config.yaml (credentials already redacted by :class:`RunOrigin`)."""
    command = ["-m", "app.cli", "run", config_file, "--executor", executor, "--no-progress"]
    if executor == "ray":
        command += ["--address", "auto"]
    if output:
        command += ["--output", output]
    if origin is not None and origin.command:
        command += ["--origin-command", shlex.join(origin.command)]
        command += [item for override in origin.overrides for item in ("--origin-set", override)]
    return python_command(command, python)


def submit_pipeline(config: Any, address: str | None, output: str | None = None, wait: bool = False,
                    follow: bool = False, timeout_s: float | None = None, stream: TextIO | None = None,
                    executor: str = "ray", python: str | None = None,
                    shared_filesystem: bool = False, token_file: str | None = None,
                    origin: RunOrigin | None = None, scenario_aliases: bool = True) -> SubmitOutcome:
    """Submit a validated scenario as a Ray Job (no-op when already pending/running/succeeded).

    output: run directory (s3://... for a multi-node cluster; default: the config's output.dir); local paths are
    made absolute here, where the user typed them, and refused when the head is on another machine unless
    ``shared_filesystem`` says every node mounts them at the same place (:func:`require_paths_reachable`).
    wait: block until the job ends; follow: print its logs meanwhile. python: the job's interpreter (None: the
    submitting one when the node has it, see :func:`python_command`). origin: the command line and overrides the
    job records in config.yaml. scenario_aliases: False when ``--set`` changed what the named config file computes
    (cluster.tracking.run_identity.run_intent): the job then moves only its own registry aliases (sent as job
    metadata, since the job runs the resolved scenario.yaml). Before anything is submitted, a training stage that
    no node of the cluster has the memory for is refused (PreflightError, cluster.ray.memory_check). Returns the
    outcome, with the final status when waiting.
    """
    stream = stream or sys.stdout
    config = absolute_config(config)
    output = absolute_location(output or config.output_dir())
    config = config.model_copy(update={"output": config.output.model_copy(update={"dir": output})})
    if not shared_filesystem:
        require_paths_reachable(config, output, address)
    if is_local_path(output):  # a run folder this machine reads: a change that is no growth is refused here
        judge_folder(config, output, code_version())  # (the job judges it again, before any stage, on the cluster)
    client = job_client(address, token_file)
    # before anything is submitted: a training stage no node of the cluster has the memory for is refused here
    importlib.import_module(MEMORY_CHECK_MODULE).check_job_memory(config, client.get_address())
    base_id = submission_id_for(config, output)
    with tempfile.TemporaryDirectory(prefix="compat-submit-") as staging:
        Path(staging, "scenario.yaml").write_text(dump_config(config))
        outcome = submit_entrypoint(
            client, base_id, pipeline_entrypoint(output, executor=executor, python=python, origin=origin),
            pipeline_runtime_env(staging),
            metadata={"compat_scenario": str(config.name), "compat_config_hash": config_hash(config)[:16],
                      "compat_output": str(output), INTENT_METADATA_KEY: str(scenario_aliases).lower()},
        )
    outcome.output = output
    print(outcome.message, file=stream)
    if wait:
        outcome.status = wait_for(client, outcome.submission_id, timeout_s=timeout_s, follow=follow, stream=stream)
    return outcome


def require_paths_reachable(config: Any, output: str, address: str | None) -> None:
    """Raise ValueError naming each local path (run directory, data roots, shared store) of a job for a head on
    another machine, with the fix (an ``s3://`` location, or ``--shared-filesystem`` when every node mounts it).
    A head on this machine (loopback, this host's name or address) reaches local paths and passes."""
    address = address or os.environ.get("RAY_ADDRESS") or os.environ.get("RAY_API_SERVER_ADDRESS")
    if not address:
        return  # job_client reports the missing address
    host, _ = host_port(address, 8265)
    if is_this_machine(host):
        return
    local = {"--output": output} if is_local_path(output) else {}
    local.update({key: value for key, value in local_config_paths(config).items() if key != "output.dir"})
    if local:
        listed = ", ".join(f"{key} {value}" for key, value in local.items())
        raise ValueError(
            f"the head at {host} is another machine and cannot reach this machine's paths ({listed}); give an "
            f"s3:// location (e.g. --output s3://BUCKET/runs/{config.name}, --set data.root=s3://BUCKET/...) or, "
            f"when every node mounts these paths at the same place, add --shared-filesystem")


def wait_for(client, submission_id: str, timeout_s: float | None = None, poll_s: float = 1.0, follow: bool = False,
             stream: TextIO | None = None) -> str:
    """Poll until the job is SUCCEEDED, FAILED or STOPPED (returned); with ``follow`` print new log text meanwhile.

    Raises TimeoutError naming the job when ``timeout_s`` seconds pass first."""
    stream = stream or sys.stdout
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    printed = 0
    while True:
        status = status_name(client.get_job_status(submission_id))
        if follow:
            printed = _print_new_logs(client, submission_id, printed, stream)
        if status in TERMINAL_STATUSES:
            if follow:
                _print_new_logs(client, submission_id, printed, stream)
            return status
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"job {submission_id} still {status} after {timeout_s:g} s")
        time.sleep(poll_s)


def _print_new_logs(client, submission_id: str, printed: int, stream: TextIO) -> int:
    text = client.get_job_logs(submission_id)
    if len(text) > printed:
        stream.write(text[printed:])
        stream.flush()
    return max(printed, len(text))


def list_pipeline_jobs(client) -> list[dict]:
    """compat jobs on the cluster (ids starting with ``compat-``): id, status, start time (s since epoch), message."""
    jobs = []
    for job in client.list_jobs():
        submission_id = getattr(job, "submission_id", None) or ""
        if submission_id.startswith(ID_PREFIX):
            started = getattr(job, "start_time", None)
            jobs.append({"submission_id": submission_id, "status": status_name(job.status),
                         "start_time": None if started is None else started / 1000.0,
                         "message": getattr(job, "message", "") or ""})
    return sorted(jobs, key=lambda job: job["start_time"] or 0.0)


__all__ = ["SubmitOutcome", "job_client", "submission_id_for", "submit_entrypoint", "submit_pipeline",
           "pipeline_runtime_env", "pipeline_entrypoint", "python_command", "wait_for", "attempts",
           "list_pipeline_jobs", "status_name", "TERMINAL_STATUSES", "REUSABLE_STATUSES", "RUNTIME_EXCLUDES"]

"""A Ray address whose port accepts connections but never answers fails within the configured wait, naming the
address and what to check, instead of hanging ``ray.init`` or Ray's job client forever (real sockets, real Ray)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.ray.reach import ANSWER_TIMEOUT_VARIABLE, answer_timeout_s, require_answering

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def silent_port():
    """A listening TCP socket on 127.0.0.1 that accepts connections (the kernel completes the handshake) and never
    sends a byte."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    yield server.getsockname()[1]
    server.close()


def _driver(code: str, timeout_s: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), **{ANSWER_TIMEOUT_VARIABLE: timeout_s})
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def test_ray_executor_connect_to_a_silent_head_fails_naming_the_address(silent_port):
    # its own process: this one may already hold the session's Ray, and connect() then reuses it
    result = _driver(f"from cluster.ray.task_backend import connect; connect('127.0.0.1:{silent_port}')", "2")
    assert result.returncode != 0
    assert "ConnectionError" in result.stderr
    assert f"the Ray cluster at 127.0.0.1:{silent_port} accepted the connection but did not answer within 2 s" \
        in result.stderr
    assert ANSWER_TIMEOUT_VARIABLE in result.stderr


def test_job_client_of_a_silent_job_server_fails_naming_the_address(silent_port):
    result = _driver(f"from cluster.ray.jobs import job_client; job_client('http://127.0.0.1:{silent_port}')", "2")
    assert result.returncode != 0
    assert f"the Ray job server at 127.0.0.1:{silent_port} accepted the connection but did not answer" \
        in result.stderr


def test_a_real_ray_head_answers(ray_local):
    address = ray_local.get_runtime_context().gcs_address
    require_answering(address, "Ray cluster", 6379, timeout_s=30)  # returns: the GCS completes the handshake


def test_the_wait_is_configurable_and_checked(monkeypatch):
    monkeypatch.delenv(ANSWER_TIMEOUT_VARIABLE, raising=False)
    assert answer_timeout_s() == 60.0
    monkeypatch.setenv(ANSWER_TIMEOUT_VARIABLE, "7.5")
    assert answer_timeout_s() == 7.5
    for bad in ("0", "-1", "soon", "nan"):
        monkeypatch.setenv(ANSWER_TIMEOUT_VARIABLE, bad)
        with pytest.raises(ValueError, match=f"{ANSWER_TIMEOUT_VARIABLE}='{bad}': expected a number of seconds"):
            answer_timeout_s()

"""`compat cluster up/down`, Ray 2.60 token authentication and paths, against real Ray heads on 127.0.0.1.

Every `compat` command runs as a subprocess, as a user types it: Ray's client caches the authentication mode and
token per process, and each case needs its own environment (HOME with or without Ray's standard token file). The
heads are started by `compat cluster up` (own temp dir and ports) and stopped by `compat cluster down`, which
touches no other Ray instance on the machine.
"""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from user_shell import PYTHON, compat, glyph_scenario
from user_shell import user_env as _env

from cluster.ray.local_head import pids_naming, read_state

# a two-task scenario on the offline glyph set, small enough to run as a Ray Job in tens of seconds
TINY_GLYPHS = glyph_scenario("tiny-glyphs", num_slots=8)


def _new_token(path: Path) -> str:
    from ray._private.authentication.authentication_token_generator import generate_new_authentication_token

    token = generate_new_authentication_token()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(token)
    path.chmod(0o600)
    return token


@pytest.fixture(scope="module")
def token_head(tmp_path_factory):
    """`compat cluster up` (token auth, the token in a file named by RAY_AUTH_TOKEN_PATH so the head's jobs keep
    the real HOME and its caches); yields (state, token file, token, state dir)."""
    base = tmp_path_factory.mktemp("token-head")
    token_file = base / "cluster-token"
    token = _new_token(token_file)
    state_dir = base / "state"
    env = dict(_env(Path.home()), RAY_AUTH_TOKEN_PATH=str(token_file))
    try:  # `cluster down` also when `cluster up` failed or timed out: its head may be running already
        started = compat("cluster", "up", "--num-cpus", "2", "--object-store-memory", "200000000",
                         "--state-dir", str(state_dir), env=env, timeout=600)
        assert started.returncode == 0, started.stdout + started.stderr
        state = read_state("local", state_dir)
        yield state, token_file, token, state_dir
    finally:
        recorded = read_state("local", state_dir)
        stopped = compat("cluster", "down", "--state-dir", str(state_dir), env=env)
        assert stopped.returncode == 0, stopped.stderr
        assert recorded is None or pids_naming(recorded.temp_dir) == []


def test_cluster_up_prints_the_submit_command_and_binds_loopback(token_head):
    state, _, token, state_dir = token_head
    assert state.auth == "token" and state.address.startswith("http://127.0.0.1:")
    shown = compat("cluster", "status", "--state-dir", str(state_dir), env=_env(Path.home()))
    assert f"compat submit CONFIG --address {state.address}" in shown.stdout
    assert token not in shown.stdout + json.dumps(state.__dict__)
    # every TCP port a process of this head listens on is on 127.0.0.1
    pids = set(pids_naming(state.temp_dir)) | {state.pid}
    listening = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
    ours = [line.split()[3] for line in listening if any(f"pid={pid}," in line for pid in pids)]
    assert ours, listening
    assert all("127.0.0.1" in address for address in ours), ours


def test_token_head_refuses_without_token_and_works_with_the_standard_file(token_head, tmp_path):
    state, token_file, token, _ = token_head
    refused = compat("status", "--address", state.address, env=_env(tmp_path / "empty-home"))
    assert refused.returncode == 1
    assert "requires token authentication" in refused.stderr and "--ray-token-file" in refused.stderr
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(token)  # Ray's standard place, RAY_AUTH_MODE unset
    listed = compat("status", "--address", state.address, env=_env(home))
    assert listed.returncode == 0, listed.stderr
    assert token not in listed.stdout + listed.stderr


def test_submit_with_relative_output_lands_where_the_user_asked(token_head, tmp_path):
    state, token_file, token, _ = token_head
    work = tmp_path / "work"
    work.mkdir()
    (work / "tiny.yaml").write_text(TINY_GLYPHS)
    env = _env(tmp_path / "empty-home")  # no token in Ray's standard places: only --ray-token-file authenticates
    submitted = compat("submit", "tiny.yaml", "--address", state.address, "--output", "results/tiny",
                       "--executor", "local", "--wait", "--timeout", "200", "--ray-token-file", str(token_file),
                       env=env, cwd=work, timeout=260)
    assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-3000:]
    assert f"run directory: {work / 'results' / 'tiny'}" in submitted.stdout
    # --wait streams the job's own progress lines as they come, before the command's summary
    streamed = re.search(r"^\[\d+/\d+\] evaluate\[row=1\]: done", submitted.stdout, flags=re.M)
    assert streamed and streamed.start() < submitted.stdout.index("submission id: "), submitted.stdout[-3000:]
    matrix = json.loads((work / "results" / "tiny" / "matrix.json").read_text())
    assert len(matrix["values"]) == 2 and matrix["values"][1][1] is not None
    submission_id = submitted.stdout.split("submission id: ")[1].split()[0]
    logs = compat("logs", submission_id, "--address", state.address, "--ray-token-file", str(token_file), env=env)
    assert logs.returncode == 0 and f"run directory: {work / 'results' / 'tiny'}" in logs.stdout
    assert token not in submitted.stdout + submitted.stderr + logs.stdout + logs.stderr


def test_submit_refuses_local_paths_for_a_head_on_another_machine(tmp_path):
    """A head on another machine cannot reach this machine's folders: refused before any request, with the fix.
    192.0.2.1 (TEST-NET-1) is never this machine; nothing is sent to it."""
    from cluster.ray.jobs import require_paths_reachable
    from pipelines.config.load import load_config

    (tmp_path / "tiny.yaml").write_text(TINY_GLYPHS)
    config = load_config(tmp_path / "tiny.yaml")
    with pytest.raises(ValueError, match=r"--output /.*/runs/tiny.*s3://.*--shared-filesystem"):
        require_paths_reachable(config, "/data/runs/tiny", "http://192.0.2.1:8265")
    require_paths_reachable(config, "s3://bucket/runs/tiny", "http://192.0.2.1:8265")  # reachable: passes
    require_paths_reachable(config, "/data/runs/tiny", "http://127.0.0.1:8265")  # same machine: passes
    require_paths_reachable(config, "/data/runs/tiny", "http://localhost:8265")


def test_default_ray_head_with_a_token_in_the_standard_place(tmp_path):
    """The situation of a plain `ray start --head` (RAY_AUTH_MODE unset) on a machine with ~/.ray/auth_token: Ray
    enables token auth on the head, and the client, without RAY_AUTH_MODE, used to fail with AuthenticationError."""
    from cluster.ray.local_head import stop_head

    home = tmp_path / "home"
    token = _new_token(home / ".ray" / "auth_token")
    env = _env(home)
    state_dir = tmp_path / "state"
    script = ("import sys; from cluster.ray.local_head import start_head; "
              f"start_head('default', {str(state_dir)!r}, num_cpus=1, object_store_memory=100_000_000, auth=None)")
    try:
        started = subprocess.run([PYTHON, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        assert started.returncode == 0, started.stderr[-3000:]
        state = read_state("default", state_dir)
        assert "token" in subprocess.run(["curl", "-s", f"{state.address}/api/authentication_mode"],
                                         capture_output=True, text=True).stdout
        listed = compat("status", "--address", state.address, env=env)
        assert listed.returncode == 0, listed.stderr
        assert "no compat jobs on this cluster" in listed.stdout
        assert token not in listed.stdout + listed.stderr
    finally:
        recorded = read_state("default", state_dir)
        stop_head("default", state_dir)
        assert recorded is None or pids_naming(recorded.temp_dir) == []


def test_run_joins_the_token_head_with_the_token_from_rays_standard_variable(token_head, tmp_path):
    """`compat run --executor ray --address HOST:PORT` (the head's GCS) with RAY_AUTH_MODE unset and the token
    where Ray looks for it: the stages run on the head, the results land in the (relative) --output."""
    state, token_file, token, _ = token_head
    work = tmp_path / "work"
    work.mkdir()
    (work / "tiny.yaml").write_text(TINY_GLYPHS)
    env = dict(_env(Path.home()), RAY_AUTH_TOKEN_PATH=str(token_file))
    ran = compat("run", "tiny.yaml", "--executor", "ray", "--address", state.gcs_address, "--output", "out",
                 "--no-progress", "--tracking-uri", "none", env=env, cwd=work, timeout=300)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
    assert f"run directory: {work / 'out'}" in ran.stdout
    assert json.loads((work / "out" / "matrix.json").read_text())["values"][1][1] is not None
    assert token not in ran.stdout + ran.stderr

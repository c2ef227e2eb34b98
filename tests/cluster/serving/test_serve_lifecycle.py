"""`compat serve` as a process with its own local Ray instance (real Ray Serve, a real MLflow server, HTTP on
127.0.0.1): every socket any process of the command listens on is on loopback, /healthz says "degraded" while the
alias names a version the service cannot load, a signal stops every process the command started, an alias naming
no version, a first load that fails and settings that open replica ports end the command with a non-zero exit and
a one-line error."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import ray  # noqa: F401 - Ray ships psutil: importing ray first puts it on the path
import psutil  # noqa: I001
import serving_helpers as helpers
from local_services import free_port
from user_shell import PYTHON, user_env
from user_shell import compat as run_compat

from app.cli import main

pytestmark = pytest.mark.integration
NAME = "serve-lifecycle-test"
LOOPBACK_ADDRESSES = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


def register_unloadable_version(client, name: str, folder: Path) -> str:
    """A version whose config is a real cnn4's and whose weights file is 1,000 zero bytes (its sha256 tag matches,
    so only loading the weights fails)."""
    from cluster.model_registry.versions import register_version, write_model_folder
    from cluster.tracking.client import ensure_experiment
    from compat_core.models.compat_model import create_model, model_to_bytes
    from pipelines.store.run_store import sha256_bytes

    blobs = model_to_bytes(create_model("cnn4", num_slots=10, backbone_config={"in_chans": 1, "width": 4}))
    target = write_model_folder(folder / "unloadable", blobs["config.json"], blobs["model.safetensors"])
    weights = bytes(1000)
    files = list(target.rglob("model.safetensors"))
    assert len(files) == 1, files
    files[0].write_bytes(weights)   # after the folder was written: the registry holds what a broken upload leaves
    run = client.create_run(ensure_experiment(client, "serve-test-models"))
    client.log_artifacts(run.info.run_id, str(target), "model")
    client.set_terminated(run.info.run_id)
    return str(register_version(client, name, run.info.run_id, "unloadable", {"sha256": sha256_bytes(weights)},
                                []).version)


@pytest.fixture(scope="module")
def served(mlflow_server, tmp_path_factory):
    """v1 (loadable, @champion) and v2 (unloadable) of one model; the tiny gallery indexed by v1."""
    from mlflow import MlflowClient

    folder = tmp_path_factory.mktemp("serve-lifecycle")
    client = MlflowClient(mlflow_server.tracking_uri)
    v1 = helpers.register_random_model(client, NAME, 0, folder)
    client.set_registered_model_alias(NAME, "champion", v1)
    v2 = register_unloadable_version(client, NAME, folder)
    client.set_registered_model_alias(NAME, "broken", v2)
    config = helpers.write_config(folder)
    root = str(folder / "index")
    assert main(["index", "build", root, "--config", str(config), "--model", f"models:/{NAME}@champion",
                 "--tracking-uri", mlflow_server.tracking_uri]) == 0
    home = folder / "home"
    home.mkdir()
    env = user_env(home, MLFLOW_TRACKING_URI=mlflow_server.tracking_uri, XDG_CACHE_HOME=str(folder / "cache"))
    return {"client": client, "v1": v1, "v2": v2, "root": root, "env": env, "folder": folder}


def _start(served, model: str, log: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with log.open("w") as handle:
        process = subprocess.Popen([PYTHON, "-m", "app.cli", "serve", served["root"], "--model", model, "--port",
                                    str(port), "--num-cpus", "0", "--poll-s", "0.3", *extra], env=served["env"],
                                   stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    return process, f"http://127.0.0.1:{port}"


def _wait_for(process: subprocess.Popen, log: Path, what: str, check, timeout_s: float = 300.0):
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert process.poll() is None, f"compat serve exited {process.returncode}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)
    return found


def _health(url: str):
    try:
        return helpers.call(url, "/healthz", timeout=10)
    except OSError:
        return None, None


def _living(processes: list) -> list:
    living = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                living.append(f"{process.name()}({process.pid})")
        except psutil.NoSuchProcess:
            continue
    return living


def _listening(processes: list) -> dict:
    """(address, port) -> process name of every listening TCP socket of ``processes``."""
    sockets = {}
    for process in processes:
        try:
            for connection in process.net_connections(kind="inet"):
                if connection.status == psutil.CONN_LISTEN and connection.type == socket.SOCK_STREAM:
                    sockets[(connection.laddr.ip, connection.laddr.port)] = process.name()
        except psutil.NoSuchProcess:
            continue
    return sockets


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_every_port_is_on_loopback_degraded_is_reported_and_a_signal_stops_every_process(served, tmp_path, stop):
    log = tmp_path / "serve.log"
    process, url = _start(served, f"models:/{NAME}@champion", log)
    try:
        _wait_for(process, log, "serving line", lambda: "serving " in log.read_text())
        status, health = _health(url)
        assert status == 200 and health["status"] == "ok" and health["model_version"] == served["v1"]
        tree = [psutil.Process(process.pid)] + psutil.Process(process.pid).children(recursive=True)
        listening = _listening(tree)
        names = " ".join(process.name() for process in tree)
        assert all(part in names for part in ("raylet", "gcs_server", "DashboardAgent", "RuntimeEnvAgent",
                                              "ServeReplica", "ProxyActor")), names
        assert ("127.0.0.1", int(url.rpartition(":")[2])) in listening
        assert any("ServeReplica" in name for name in listening.values()), listening  # its gRPC server, too
        exposed = {address: name for address, name in listening.items() if address[0] not in LOOPBACK_ADDRESSES}
        assert not exposed, f"listening beyond loopback: {exposed}"

        served["client"].set_registered_model_alias(NAME, "champion", served["v2"])   # a version it cannot load
        try:
            status, health = _wait_for(process, log, "degraded /healthz",
                                       lambda: (lambda h: h if h[0] and h[1].get("status") == "degraded" else None)(
                                           _health(url)), timeout_s=120)
        finally:
            served["client"].set_registered_model_alias(NAME, "champion", served["v1"])
        assert status == 200 and health["model_version"] == served["v1"]   # still answering with v1
        assert health["alias"]["target_version"] == served["v2"] and health["alias"]["error"]
        assert helpers.call(url, "/search", {"embedding": [0.1] * 9, "k": 1})[0] == 200
        _wait_for(process, log, "ok /healthz again", lambda: _health(url)[1].get("status") == "ok", timeout_s=120)

        os.kill(process.pid, stop)   # the command only, as `kill PID` does
        assert process.wait(timeout=180) == 128 + stop, log.read_text()[-3000:]
        _, alive = psutil.wait_procs(tree[1:], timeout=30)
        assert not _living(alive), f"left running after {stop.name}: {_living(alive)}"
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", int(url.rpartition(":")[2])), timeout=5).close()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def test_the_http_proxy_refuses_a_body_over_the_limit_before_holding_it(served, tmp_path):
    """Serve's HTTP proxy of a `compat serve` that started its own Ray: a 400 MiB chunked POST is answered 413 by
    the proxy once the limit (64 KiB) is passed, the proxy process grows by less than 16 MiB; a Content-Length over
    the limit gets 413 though no byte of the body was sent; searches still work."""
    limit, chunk, chunks = 64 << 10, b"x" * (256 << 10), 1600   # 1600 x 256 KiB = 400 MiB
    log = tmp_path / "serve.log"
    process, url = _start(served, f"models:/{NAME}@champion", log, "--max-body-bytes", str(limit))
    try:
        _wait_for(process, log, "serving line", lambda: "serving " in log.read_text())
        tree = [psutil.Process(process.pid)] + psutil.Process(process.pid).children(recursive=True)
        [proxy] = [p for p in tree if "ProxyActor" in p.name()]
        before = proxy.memory_info().rss
        sent, status, answer = helpers.send_chunked(url, "/search", chunk, chunks)
        grown = proxy.memory_info().rss - before
        assert status == 413 and answer["error"]["field"] == "body", answer
        read = int(re.search(r"the HTTP proxy stopped reading after (\d+) bytes", answer["error"]["message"]).group(1))
        assert limit < read <= limit + len(chunk), answer
        assert sent < len(chunk) * chunks // 4, sent   # the client was stopped long before 400 MiB
        assert grown < 16 << 20, f"the proxy grew by {grown / (1 << 20):.1f} MiB"
        status, answer = helpers.refused_before_the_body(url, 1 << 30)
        assert status == 413 and "refused by the HTTP proxy before the body was read" in answer["error"]["message"]
        assert helpers.call(url, "/search", {"embedding": [0.1] * 9, "k": 1})[0] == 200
        print(f"proxy RSS growth {grown / (1 << 20):.2f} MiB; client sent {sent / (1 << 20):.2f} MiB; proxy read {read}")
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=180)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


def test_an_alias_naming_no_version_fails_before_ray_starts(served):
    result = run_compat("serve", served["root"], "--model", f"models:/{NAME}@nosuchalias", "--port",
                        str(free_port()), env=served["env"], timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    first = result.stderr.splitlines()[0]
    assert first.startswith("error: ") and "no alias 'nosuchalias'" in first, result.stderr
    assert "serving" not in result.stdout and "Started Serve" not in result.stderr


def test_a_first_load_that_fails_ends_the_command_non_zero(served, tmp_path):
    log = tmp_path / "serve.log"
    process, _ = _start(served, f"models:/{NAME}@broken", log)
    try:
        code = process.wait(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    text = log.read_text()
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    # the command's own check of the model against the index loads it before Ray starts: a bad input, exit 2
    assert code == 2 and len(errors) == 1, text[-3000:]
    assert "model.safetensors: not a safetensors file" in errors[0], errors[0]
    assert "serving " not in text


def test_a_first_load_that_fails_only_in_the_replicas_ends_the_command_with_exit_1(served, tmp_path):
    """The replicas' load environment differs from the command's: the head `compat serve` joins was started from a
    shell whose COMPAT_MODEL_CACHE is a shared folder others may write (mode 0777). The command's own check loads
    the model through its private cache and passes; every replica refuses the shared cache, so the first load fails
    in the replicas only, and the command ends with exit 1 and one line carrying the replicas' error."""
    from cluster.ray.local_head import read_state

    shared = tmp_path / "shared-models"
    shared.mkdir()
    shared.chmod(0o777)
    home, state_dir = tmp_path / "home", tmp_path / "heads"
    home.mkdir()
    head_shell = dict(served["env"], HOME=str(home), XDG_CACHE_HOME=str(tmp_path / "head-cache"),
                      COMPAT_MODEL_CACHE=str(shared))
    try:
        up = run_compat("cluster", "up", "--num-cpus", "2", "--object-store-memory", "200000000", "--state-dir",
                        str(state_dir), env=head_shell, timeout=600)
        assert up.returncode == 0, up.stdout + up.stderr
        head = read_state("local", state_dir)
        # the same user (the head's token in ~/.ray/auth_token), the model cache of its own shell
        result = run_compat("serve", served["root"], "--model", f"models:/{NAME}@champion", "--port",
                            str(free_port()), "--num-cpus", "0", "--ray-address", head.gcs_address,
                            "--first-load-timeout-s", "240", env=dict(served["env"], HOME=str(home)), timeout=600)
    finally:
        down = run_compat("cluster", "down", "--state-dir", str(state_dir), env=head_shell)
    assert down.returncode == 0, down.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 1 and len(errors) == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"--model models:/{NAME}@champion: the first load failed: PermissionError: model cache {shared} is " \
           f"writable by group and others (mode 0777)" in errors[0], errors[0]
    assert "serving " not in result.stdout
    assert list(shared.iterdir()) == []  # nothing was downloaded into the folder others may write


def test_settings_that_open_replica_ports_are_refused_before_ray_starts(served):
    result = run_compat("serve", served["root"], "--model", f"models:/{NAME}@champion", "--port", str(free_port()),
                        env=dict(served["env"], RAY_SERVE_ENABLE_DIRECT_INGRESS="1"), timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    first = result.stderr.splitlines()[0]
    assert first.startswith("error: compat serve's environment: RAY_SERVE_ENABLE_DIRECT_INGRESS=1 makes Ray Serve")
    assert "Unset RAY_SERVE_ENABLE_DIRECT_INGRESS" in first and "serving" not in result.stdout

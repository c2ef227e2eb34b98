"""A local Ray head that ``compat`` starts and stops itself (``compat cluster up`` / ``down``).

``ray stop`` stops every Ray process of the user on the machine, other people's clusters and a running
``compat run --executor ray`` included. A head started here instead gets:

- its own temp dir (``/tmp/compat-ray-XXXX``: short, Ray's socket paths must stay under 108 characters) and its own
  free ports, so it never collides with another Ray instance on the machine;
- every address on 127.0.0.1 (``--node-ip-address``, ``--dashboard-host`` and ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``,
  without which Ray 2.60 still advertises the machine's routable address for some ports);
- token authentication by default (Ray 2.60's ``RAY_AUTH_MODE=token``), with a token generated into Ray's standard
  file ``~/.ray/auth_token`` when none exists, which is where ``compat submit`` / ``status`` / ``logs`` find it;
- ``ray start --head --block`` in a process group of its own. ``down`` signals that group, then any process whose
  command line names the head's temp dir (Ray daemons that left the group), and nothing else.

The state (pid, temp dir, addresses; never the token) is a JSON file in the state folder
(``~/.cache/compat/cluster/<name>.json`` by default).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.error import HTTPError
from urllib.request import urlopen

from cluster.ray.auth import default_token_path, prepare_token_file, secure_token_file
from cluster.serving.proxy_limits import head_environment

# ports Ray would otherwise take at fixed defaults; another Ray instance on the machine may hold them
EXTRA_PORT_OPTIONS = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
                      "runtime-env-agent-port", "ray-client-server-port", "node-manager-port", "object-manager-port")
AUTH_MODES = ("token", "disabled")


@dataclass
class HeadState:
    """A started head: ``address`` is the job server (``compat submit --address``), ``gcs_address`` what
    ``compat run --executor ray --address`` joins."""

    name: str
    pid: int
    temp_dir: str
    address: str
    gcs_address: str
    auth: str
    log: str


def default_state_dir() -> Path:
    """Where head state files live: ``$XDG_CACHE_HOME/compat/cluster`` (``~/.cache/compat/cluster``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "compat" / "cluster"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _state_file(state_dir: Path, name: str) -> Path:
    return Path(state_dir) / f"{name}.json"


def read_state(name: str = "local", state_dir: str | Path | None = None) -> HeadState | None:
    """The recorded head ``name`` (None when there is none)."""
    path = _state_file(Path(state_dir or default_state_dir()), name)
    if not path.is_file():
        return None
    return HeadState(**json.loads(path.read_text()))


def ensure_token() -> Path:
    """Ray's standard token file, generated mode 0600 with Ray's own generator when it does not exist; one other
    users can read is made 0600 when it is this user's and refused otherwise; a token given as ``RAY_AUTH_TOKEN`` /
    ``RAY_AUTH_TOKEN_PATH`` is used as it is, secured the same way (returns the default path anyway)."""
    prepare_token_file()
    return default_token_path()


def start_head(name: str = "local", state_dir: str | Path | None = None, num_cpus: int | None = None,
               object_store_memory: int = 500_000_000, dashboard_port: int | None = None, auth: str | None = "token",
               timeout_s: float = 180.0, ray_executable: str | None = None) -> HeadState:
    """Start a Ray head on 127.0.0.1 with its own temp dir and ports (see the module doc); returns its state.

    num_cpus: CPUs it offers (None: all of the machine's). object_store_memory: bytes. auth: 'token' (default),
    'disabled' (acceptable only because everything listens on 127.0.0.1) or None (Ray's default: token mode when a
    token exists in Ray's standard places). Raises RuntimeError naming the log when
    the head does not come up within ``timeout_s`` seconds, FileExistsError when ``name`` is already running."""
    if auth is not None and auth not in AUTH_MODES:
        raise ValueError(f"--auth {auth!r}: expected one of {list(AUTH_MODES)}")
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            return _start_once(name, state_dir, num_cpus, object_store_memory, dashboard_port, auth, timeout_s,
                               ray_executable)
        except RuntimeError as error:
            # Ray gives a raylet a fixed 30 s to register with the GCS; on a loaded machine it may miss that
            if attempt == START_ATTEMPTS or "timed out during startup" not in str(error):
                raise
            print(f"ray head: the node timed out during startup (attempt {attempt}); starting it again",
                  file=sys.stderr)
    raise AssertionError("unreachable")


START_ATTEMPTS = 3


def _start_once(name: str, state_dir: str | Path | None, num_cpus: int | None, object_store_memory: int,
                dashboard_port: int | None, auth: str | None, timeout_s: float,
                ray_executable: str | None) -> HeadState:
    state_dir = Path(state_dir or default_state_dir())
    existing = read_state(name, state_dir)
    if existing is not None and _alive(existing.pid):
        raise FileExistsError(f"a head named {name!r} is already running at {existing.address} (pid {existing.pid}); "
                              f"stop it with `compat cluster down --name {name}` or pick another --name")
    # its Serve proxy refuses request bodies over the limit before holding them (a service on this head)
    env = head_environment(dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0"))
    if auth is not None:  # None: Ray's own default (token mode when a token exists in its standard places)
        env["RAY_AUTH_MODE"] = auth
    env.pop("RAY_ADDRESS", None)
    if auth == "token":
        ensure_token()
    elif auth is None and default_token_path().is_file():  # Ray's default mode uses an existing token
        secure_token_file(default_token_path())
    temp_dir = tempfile.mkdtemp(prefix="compat-ray-", dir="/tmp")
    port, dashboard_port = free_port(), dashboard_port or free_port()
    ray = ray_executable or str(Path(sys.executable).with_name("ray"))
    if not Path(ray).exists():
        ray = shutil.which("ray") or ray
    command = [ray, "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
               "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
               f"--object-store-memory={int(object_store_memory)}", "--disable-usage-stats", f"--temp-dir={temp_dir}",
               *[f"--{option}={free_port()}" for option in EXTRA_PORT_OPTIONS]]
    if num_cpus is not None:
        command.append(f"--num-cpus={int(num_cpus)}")
    log = Path(temp_dir) / "compat-head.log"
    with log.open("w") as handle:
        process = subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    state = HeadState(name=name, pid=process.pid, temp_dir=temp_dir, address=f"http://127.0.0.1:{dashboard_port}",
                      gcs_address=f"127.0.0.1:{port}", auth=auth or "ray default", log=str(log))
    state_dir.mkdir(parents=True, exist_ok=True)
    _state_file(state_dir, name).write_text(json.dumps(asdict(state), indent=1))
    try:
        _wait_ready(state, process, timeout_s)
    except BaseException:
        stop_head(name, state_dir)
        raise
    return state


STARTED_MESSAGE = "Ray runtime started."  # what `ray start` prints once the node (GCS, raylet) is up


def _wait_ready(state: HeadState, process: subprocess.Popen, timeout_s: float) -> None:
    """Until ``ray start`` says the node is up and the job server answers; a head that dies meanwhile (e.g. its
    raylet times out on a loaded machine) raises RuntimeError with the end of its log."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            tail = Path(state.log).read_text(errors="replace")[-2000:]
            raise RuntimeError(f"ray head exited with {process.returncode}; its log {state.log} ends:\n{tail}")
        if STARTED_MESSAGE in Path(state.log).read_text(errors="replace"):
            try:
                urlopen(f"{state.address}/api/healthz", timeout=2).read()
                return
            except HTTPError:
                return  # it answers (an auth-protected route); ready
            except OSError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"ray head not ready after {timeout_s:g} s; see {state.log}") from None
        time.sleep(0.5)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pids_naming(marker: str) -> list[int]:
    """Processes of this user whose command line contains ``marker``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if entry.stat().st_uid == os.getuid() and \
                        marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def stop_head(name: str = "local", state_dir: str | Path | None = None, grace_s: float = 15.0) -> HeadState | None:
    """Stop the head ``name`` started by :func:`start_head` and only its processes; returns its state (None when
    there was none). SIGTERM to its process group, SIGKILL after ``grace_s`` seconds, then SIGKILL to any process
    still naming its temp dir; the temp dir and the state file are removed."""
    state_dir = Path(state_dir or default_state_dir())
    state = read_state(name, state_dir)
    if state is None:
        return None
    for sig, grace in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(state.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _group_alive(state.pid):
            time.sleep(0.2)
        if not _group_alive(state.pid):
            break
    for pid in pids_naming(state.temp_dir):  # Ray daemons that left the process group
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(state.temp_dir, ignore_errors=True)
    _state_file(state_dir, name).unlink(missing_ok=True)
    return state


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie leader keeps the group "alive" until reaped; reap it when it is our child
    try:
        os.waitpid(pgid, os.WNOHANG)
    except ChildProcessError:
        pass
    return True


__all__ = ["HeadState", "AUTH_MODES", "default_state_dir", "ensure_token", "free_port", "pids_naming",
           "read_state", "start_head", "stop_head"]

"""Real servers on 127.0.0.1 for the tests (fixtures in tests/conftest.py): SeaweedFS S3 and an MLflow server.

Both are started as child processes, bound to loopback, and stopped (with their whole process tree) on exit.
Credentials are passed to SeaweedFS through its config file, never on a command line or in a log line.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.error import URLError
from urllib.request import urlopen

LOOPBACK = "127.0.0.1"


def free_port(exclude: set[int] | None = None) -> int:
    """A TCP port that is free on 127.0.0.1 now, whose +10000 gRPC twin is free as well (SeaweedFS uses both)."""
    exclude = exclude or set()
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((LOOPBACK, 0))
            port = probe.getsockname()[1]
        if port in exclude or port + 10000 > 65535 or port + 10000 in exclude:
            continue
        if _port_is_free(port + 10000):
            return port
    raise RuntimeError("could not find a free port pair on 127.0.0.1")


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def minimal_environment() -> dict[str, str]:
    """PATH, HOME, TMPDIR and locale of this process: what a server binary needs, and no credentials."""
    keep = ("PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "TZ")
    return {name: os.environ[name] for name in keep if name in os.environ}


def _wait_until(check, timeout_s: float, what: str, process: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode}; see {log_path}")
        if check():
            return
        time.sleep(0.2)
    raise TimeoutError(f"{what} was not ready after {timeout_s:.0f} s; see {log_path}")


def wait_for_ui(process: subprocess.Popen, port: int, timeout_s: float = 90.0) -> None:
    """Poll ``compat ui``'s MLflow server at 127.0.0.1:``port`` until ``/health`` answers; fails when the command
    exits first or ``timeout_s`` seconds pass."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            return
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, "compat ui did not come up"
            time.sleep(0.5)


def _stop(process: subprocess.Popen | None, timeout_s: float = 15.0) -> None:
    if process is None or process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=timeout_s)


def _tool(name: str) -> str:
    """An executable installed next to the running interpreter (the project's venv), else on PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if not found:
        raise FileNotFoundError(f"'{name}' is not installed; run the README's setup command (make test) first")
    return found


@dataclass
class S3Credentials:
    access_key: str
    secret_key: str = field(repr=False)

    @classmethod
    def generate(cls) -> "S3Credentials":
        return cls(access_key="compat" + secrets.token_hex(4), secret_key=secrets.token_urlsafe(24))


class SeaweedS3Server:
    """A SeaweedFS ``weed mini`` S3 endpoint on 127.0.0.1 with one identity allowed to do everything.

    ``stop()`` then ``start()`` restarts it on the same ports and data folder, so stored objects survive.
    """

    def __init__(self, data_dir: str | os.PathLike, credentials: S3Credentials | None = None,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.data_dir = Path(data_dir)
        self.credentials = credentials or S3Credentials.generate()
        self.extra_args = tuple(extra_args)  # more `weed mini` flags (e.g. -metricsPort for a benchmark)
        used: set[int] = set()
        self.ports: dict[str, int] = {}
        for role in ("s3", "master", "volume", "filer"):
            port = free_port(used)
            used.update({port, port + 10000})
            self.ports[role] = port
        self.process: subprocess.Popen | None = None
        self.log_path = self.data_dir / "weed.log"

    @property
    def endpoint_url(self) -> str:
        return f"http://{LOOPBACK}:{self.ports['s3']}"

    def environment(self) -> dict[str, str]:
        """The standard AWS variables that point boto3 and pyarrow at this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.credentials.access_key,
            "AWS_SECRET_ACCESS_KEY": self.credentials.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_REGION": "us-east-1",
        }

    def _write_config(self) -> Path:
        config = {
            "identities": [
                {
                    "name": "compat",
                    "credentials": [
                        {"accessKey": self.credentials.access_key, "secretKey": self.credentials.secret_key}
                    ],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                }
            ]
        }
        path = self.data_dir / "s3.json"
        path.write_text(json.dumps(config))
        path.chmod(0o600)
        return path

    def _ready(self) -> bool:
        try:
            with urlopen(self.endpoint_url, timeout=1) as response:  # anonymous request: 403 means it is serving
                return response.status < 500
        except URLError as error:
            return getattr(error, "code", 0) in (400, 403)
        except OSError:
            return False

    def start(self, timeout_s: float = 60.0) -> "SeaweedS3Server":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config_path = self._write_config()
        command = [
            _tool("weed"), "mini",
            f"-dir={self.data_dir / 'data'}",
            f"-ip={LOOPBACK}", f"-ip.bind={LOOPBACK}",
            f"-s3.port={self.ports['s3']}", f"-master.port={self.ports['master']}",
            f"-volume.port={self.ports['volume']}", f"-filer.port={self.ports['filer']}",
            f"-s3.config={config_path}", "-admin.ui=false", "-webdav=false",
            # every bucket is a collection with volumes of its own; left at 0, weed caps the volumes at the
            # host's free disk / 128 MB, and on a host with ~16 GB free the suite's buckets ran out of volumes
            # ("No writable volumes and no free volumes left"); volumes are created lazily, so a high cap costs
            # nothing
            "-volume.max=1000",
            *self.extra_args,
        ]
        (self.data_dir / "data").mkdir(exist_ok=True)
        log = open(self.log_path, "ab")
        # Only what weed needs: given AWS_* variables it would add an identity of its own (and log it to /tmp).
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                        env=minimal_environment())
        log.close()
        _wait_until(self._ready, timeout_s, "SeaweedFS S3 server", self.process, self.log_path)
        stored = self._volumes_on_disk()
        if stored:
            # a restart: the S3 gateway answers before the volume server has told the master about the volumes
            # it loaded, and a read in between gets "volume N not found" (a broken response stream to the client)
            # (volumes of a collection deleted meanwhile may never be served: after the wait the server is used
            # as it is)
            try:
                _wait_until(lambda: stored <= self._volumes_served(), timeout_s / 2, "SeaweedFS volumes",
                            self.process, self.log_path)
            except TimeoutError:
                pass
        return self

    def _volumes_on_disk(self) -> set[tuple[str, int]]:
        """(collection, volume id) of every volume file in the data folder (``<collection>_<id>.dat``, ``<id>.dat``)."""
        found = set()
        for path in (self.data_dir / "data").glob("*.dat"):
            collection, _, number = path.stem.rpartition("_")
            if number.isdigit():
                found.add((collection, int(number)))
        return found

    def _volumes_served(self) -> set[tuple[str, int]]:
        """(collection, volume id) of every volume the master knows (its ``/vol/status``); empty while it cannot
        answer."""
        try:
            with urlopen(f"http://{LOOPBACK}:{self.ports['master']}/vol/status", timeout=1) as response:
                status = json.loads(response.read())
        except (OSError, ValueError):
            return set()
        served, pending = set(), [status]
        while pending:
            item = pending.pop()
            if isinstance(item, dict):
                if "Id" in item and "Collection" in item:
                    served.add((item["Collection"], int(item["Id"])))
                else:
                    pending.extend(item.values())
            elif isinstance(item, list):
                pending.extend(item)
        return served

    def stop(self) -> None:
        _stop(self.process)
        self.process = None

    def __enter__(self) -> "SeaweedS3Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class MlflowServer:
    """``mlflow server`` on 127.0.0.1 with a SQLite backend store, one worker and job execution disabled."""

    def __init__(self, root: str | os.PathLike, artifacts_destination: str | None = None,
                 extra_env: dict[str, str] | None = None) -> None:
        self.root = Path(root)
        self.port = free_port()
        self.artifacts_destination = artifacts_destination or str(self.root / "artifacts")
        self.extra_env = dict(extra_env or {})
        self.process: subprocess.Popen | None = None
        self.log_path = self.root / "mlflow-server.log"

    @property
    def tracking_uri(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def _ready(self) -> bool:
        try:
            with urlopen(f"{self.tracking_uri}/health", timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    def start(self, timeout_s: float = 120.0) -> "MlflowServer":
        self.root.mkdir(parents=True, exist_ok=True)
        command = [
            _tool("mlflow"), "server",
            "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination", self.artifacts_destination,
            "--host", LOOPBACK, "--port", str(self.port), "--workers", "1",
        ]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **self.extra_env}
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        log.close()
        _wait_until(self._ready, timeout_s, "MLflow server", self.process, self.log_path)
        return self

    def stop(self) -> None:
        _stop(self.process)
        self.process = None

    def __enter__(self) -> "MlflowServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

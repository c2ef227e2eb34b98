"""Fixtures shared by the whole suite: real servers on 127.0.0.1 started by the tests themselves."""
from __future__ import annotations

import atexit
import gc
import os
import shutil
import sys
import tempfile

import pytest
from local_services import MlflowServer, SeaweedS3Server  # tests/ is on sys.path (this conftest's folder)

# "auto" precisions time nothing inside tests of unrelated code: they mean fp32, identical on every machine (set
# before any Ray node or CLI subprocess starts, so those inherit it). tests/compat_core/test_calibration.py switches
# calibration on against a temporary cache folder.
os.environ["COMPAT_CALIBRATION"] = "off"
# Serve kills an HTTP proxy not ready within 5 s (Ray's default) and the test's Serve never comes up; on a loaded
# 2-core CI machine, with test workers in parallel, starting that actor can take longer. Inherited by every Ray
# instance the tests start (in process or as `compat` subprocesses).
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
# the machine's MLflow store (cluster.tracking.store) of tests is never the user's: a session folder, and a folder of
# its own per test (autouse fixture below) so that tests counting runs see only their own
os.environ["COMPAT_HOME"] = tempfile.mkdtemp(prefix="compat-home-tests-")
atexit.register(shutil.rmtree, os.environ["COMPAT_HOME"], True)


_SESSION_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _SESSION_EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """After pytest has reported, a process that loaded Ray's core worker ends with pytest's exit status without
    running the interpreter's finalisation: Ray's C++ core worker can crash there (a segfault in a freed metrics
    callback after ``ray.shutdown()``, seen once at the end of a fully passing suite), which would turn a green run
    into a failed one. Session fixtures (servers, Ray) are already torn down here; the one atexit cleanup this file
    registers (the session's COMPAT_HOME) runs here, other atexit handlers are skipped."""
    if not _SESSION_EXIT_STATUS or hasattr(config, "workerinput") or "ray._raylet" not in sys.modules:
        return
    shutil.rmtree(os.environ["COMPAT_HOME"], ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_SESSION_EXIT_STATUS[-1])


@pytest.fixture(autouse=True)
def _own_compat_home(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPAT_HOME", str(tmp_path / "compat-home"))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real SeaweedFS S3 server on 127.0.0.1 for the whole session (restartable: ``stop()`` / ``start()``)."""
    server = SeaweedS3Server(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The standard AWS variables pointing at the test S3 server (restored after the test)."""
    for name, value in s3_server.environment().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return s3_server.environment()


@pytest.fixture
def s3_bucket(s3_server, s3_env, request):
    """A fresh bucket (named after the test) on the test S3 server; returns its name."""
    import re
    import uuid

    import boto3
    from botocore.config import Config

    stem = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    name = f"t-{stem}-{uuid.uuid4().hex[:6]}"
    client = boto3.client(
        "s3",
        endpoint_url=s3_env["AWS_ENDPOINT_URL"],
        region_name=s3_env["AWS_REGION"],
        config=Config(request_checksum_calculation="when_required", s3={"addressing_style": "path"}),
    )
    client.create_bucket(Bucket=name)
    return name


@pytest.fixture
def fresh_object_storage(monkeypatch):
    """This process as a command starts it: no S3 filesystem, conditional writes or access installed
    (``cluster.storage.s3.configure_object_storage`` not called yet); whatever the test or the commands it runs
    install is undone after the test."""
    from cluster.storage import s3
    from compat_core import io as cio
    from pipelines.store import lease

    monkeypatch.setattr(cio, "_s3_factory", None)
    monkeypatch.setattr(lease, "_CONDITIONAL", None)
    monkeypatch.setattr(s3, "_installed", None)


@pytest.fixture
def uri_resolvers(monkeypatch):
    """The URI resolvers of compat_core.models.weight_sources as they are now, restored after the test: resolvers the
    test (or a command it runs) registers with ``register_uri_resolver`` are forgotten then."""
    from compat_core.models import weight_sources

    monkeypatch.setattr(weight_sources, "_URI_RESOLVERS", dict(weight_sources._URI_RESOLVERS))


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real ``mlflow server`` (SQLite backend, one worker, job execution off) on 127.0.0.1 for the session."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray instance (2 CPUs, small object store, no dashboard) shared by the session's Ray tests."""
    import ray

    from cluster.ray.loopback import prepare_loopback

    if not ray.is_initialized():
        prepare_loopback()
        ray.init(
            address="local",  # a fresh instance of this session, never another process' cluster on the machine
            num_cpus=2,
            object_store_memory=200 * 1024 * 1024,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            configure_logging=False,
            log_to_driver=False,
        )
    yield ray
    # objects of the session that hold Ray handles in reference cycles are freed while Ray still runs, not by the
    # interpreter's final collection after Ray's core worker is gone
    gc.collect()
    ray.shutdown()

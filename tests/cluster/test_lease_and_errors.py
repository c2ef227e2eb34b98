"""One writer per run folder (local lock, S3 lease object on the real SeaweedFS server), and integrity errors that
print one line with the fix (`--recompute`) instead of a traceback, through the real `compat` command line."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from pipelines.store import lease as lease_module
from pipelines.store.lease import LeaseLostError, RunFolderBusyError, run_lease

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests" / "pipelines"))
import tiny_scenario_helpers as tiny  # noqa: E402


def _compat(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "compat_tiny.py"
    script.write_text(tiny.CLI_SCRIPT.format(here=str(ROOT / "tests" / "pipelines")))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True,
                          timeout=600)  # the Ray variant of the S3-resume test took over 240 s on a loaded machine


def test_second_run_on_a_held_local_folder_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); "
         "from pipelines.store.lease import run_lease\nwith run_lease(sys.argv[2]):\n    print('held', flush=True); "
         "time.sleep(600)", str(ROOT), str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        config = tmp_path / "tiny.yaml"
        config.write_text(yaml.safe_dump(tiny.scenario("er")))
        done = _compat(tmp_path, "run", str(config), "--output", str(run_dir), "--no-progress",
                       "--tracking-uri", "none")
        assert done.returncode == 1
        assert f"run folder {run_dir} is in use by another compat process (pid {holder.pid}" in done.stderr
        assert "Traceback" not in done.stderr
        assert not (run_dir / "manifests").exists()  # nothing was computed
    finally:
        holder.kill()
        holder.wait()
    with run_lease(str(run_dir)):  # the kernel dropped the killed holder's lock
        pass


def test_s3_lease_refuses_a_second_driver_and_is_released(s3_env, s3_bucket, monkeypatch):
    from cluster.storage.s3 import object_storage

    root = f"s3://{s3_bucket}/runs/leased"
    with object_storage():
        entered = threading.Event()
        leave = threading.Event()

        def first() -> None:
            with run_lease(root):
                entered.set()
                leave.wait(30)

        thread = threading.Thread(target=first)
        thread.start()
        assert entered.wait(30)
        with pytest.raises(RunFolderBusyError, match=f"run folder {root} is in use by another compat process"):
            with run_lease(root):
                pass
        leave.set()
        thread.join(30)
        with run_lease(root):  # released on exit: the next driver takes it at once
            pass
        # a dead driver's lease (no heartbeat for STALE_S) is taken over, and the holder it was taken from learns
        # it when its block ends (it must not believe its writes were fenced)
        monkeypatch.setattr(lease_module, "STALE_S", 0.0)
        with pytest.raises(LeaseLostError, match="lost its lease to another driver"):
            with run_lease(root):
                time.sleep(0.05)
                with run_lease(root):
                    pass


_HOLDER = """
import sys, time
from cluster.storage.s3 import object_storage
from pipelines.store.lease import run_lease
with object_storage():
    with run_lease(sys.argv[1]):
        print("held", flush=True)
        time.sleep(600)
"""


def _holder(root: str, env: dict) -> subprocess.Popen:
    """A real driver process holding the s3:// lease of ``root`` (its heartbeat fresh) until it is killed."""
    process = subprocess.Popen([sys.executable, "-c", _HOLDER, root], env={**env, "PYTHONPATH": str(ROOT)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    assert line.strip() == "held", process.stderr.read()[-3000:] if process.poll() is not None else line
    return process


def test_an_s3_lease_of_a_dead_process_on_this_host_is_taken_over_at_once(s3_env, s3_bucket, capsys):
    """kill -9 of a driver on this host: its pid is gone, so the next driver takes the lease at once, though its
    heartbeat is fresh (STALE_S is 90 s); a live holder's lease is still refused."""
    from cluster.storage.s3 import object_storage

    root = f"s3://{s3_bucket}/runs/killed"
    env = {**os.environ, **s3_env}
    live = _holder(root, env)
    try:
        with object_storage():
            with pytest.raises(RunFolderBusyError, match=f"in use by another compat process \\(pid {live.pid} "):
                with run_lease(root):
                    pass
    finally:
        live.kill()
        live.wait(30)
    assert lease_module.stale_s() == 90.0
    with object_storage():
        with run_lease(root):  # the killed holder's heartbeat is seconds old: taken over because its pid is gone
            pass
    assert f"its previous holder (pid {live.pid} on " in capsys.readouterr().err


def test_a_holder_on_another_host_is_judged_by_its_heartbeat_only():
    import socket

    assert not lease_module.holder_gone({"pid": 2 ** 22 + 7, "host": socket.gethostname() + "-other",
                                         "space": lease_module._process_space()})
    assert not lease_module.holder_gone({"pid": os.getpid(), "host": socket.gethostname(),
                                         "space": lease_module._process_space()})   # alive
    assert not lease_module.holder_gone({"pid": 2 ** 22 + 7, "host": socket.gethostname()})  # facts not recorded


def test_corrupt_blob_prints_the_fix_and_recompute_repairs_the_run(tmp_path):
    config = tmp_path / "tiny.yaml"
    run_dir = tmp_path / "run"
    config.write_text(yaml.safe_dump(tiny.scenario("er")))
    first = _compat(tmp_path, "run", str(config), "--output", str(run_dir), "--no-progress", "--tracking-uri", "none")
    assert first.returncode == 0, first.stderr[-2000:]
    feature_blob = sorted(run_dir.glob("artifacts/extract-t000-gallery-*/features-*.npy"))[0]
    key = feature_blob.parent.name
    original = feature_blob.read_bytes()
    feature_blob.write_bytes(original + b"garbage")
    broken = _compat(tmp_path, "eval", str(run_dir), "--gallery", "class_means")
    assert broken.returncode == 1
    assert "Traceback" not in broken.stderr
    assert f"recompute that stage with: compat run --resume {run_dir} --recompute {key[:24]}" in broken.stderr
    debug = _compat(tmp_path, "eval", str(run_dir), "--gallery", "class_means", "--debug")
    assert "Traceback" in debug.stderr and "IntegrityError" in debug.stderr
    fixed = _compat(tmp_path, "run", "--resume", str(run_dir), "--recompute", key[:24], "--no-progress",
                    "--tracking-uri", "none")
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert f"recompute: stage {key} uncommitted" in fixed.stderr
    assert feature_blob.read_bytes() == original  # the stage is deterministic: the same bytes come back
    again = _compat(tmp_path, "eval", str(run_dir), "--gallery", "class_means")
    assert again.returncode == 0, again.stderr[-2000:]


def test_weed_gets_no_credentials_from_the_environment(tmp_path, monkeypatch):
    """Given AWS_* variables weed would add an identity of its own: the server starts with a minimal environment."""
    from local_services import SeaweedS3Server

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIASHOULDNOTLEAK")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "should-not-leak-secret")
    server = SeaweedS3Server(tmp_path / "weed")
    server.start()
    try:
        environ = Path(f"/proc/{server.process.pid}/environ").read_bytes().split(b"\0")
        names = {item.split(b"=", 1)[0].decode() for item in environ if item}
        assert not {name for name in names if name.startswith("AWS_")}
        assert "PATH" in names
    finally:
        server.stop()
    logs = b"".join(p.read_bytes() for p in (tmp_path / "weed").rglob("*.log") if p.is_file())
    assert b"AKIASHOULDNOTLEAK" not in logs and b"should-not-leak-secret" not in logs


@pytest.mark.parametrize("executor", ["local", "ray"])
def test_resume_of_an_s3_run_uses_the_endpoint_of_the_aws_profile(s3_server, s3_bucket, tmp_path, monkeypatch,
                                                                  executor):
    """The endpoint lives only in an AWS profile (no AWS_ENDPOINT_URL): `compat run` and `compat run --resume`
    of an s3:// run folder both reach the SeaweedFS server (before, --resume read config.yaml before configuring),
    in-process and on Ray, whose stage tasks get the driver's S3 settings (never its secrets) and resolve
    credentials from their own chain."""
    config = tmp_path / "aws-config"
    config.write_text("[profile seaweed]\nregion = us-east-1\n"
                      f"endpoint_url = {s3_server.endpoint_url}\ns3 =\n    addressing_style = path\n")
    credentials = tmp_path / "aws-credentials"
    credentials.write_text(f"[seaweed]\naws_access_key_id = {s3_server.credentials.access_key}\n"
                           f"aws_secret_access_key = {s3_server.credentials.secret_key}\n")
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_PROFILE", "seaweed")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    scenario = tmp_path / "tiny.yaml"
    document = tiny.scenario("er")
    # a registered dataset (Ray's stage tasks run in workers that only know the registry): scikit-learn's digits,
    # classes 0-5 for training, 6-9 as the open-set query/gallery
    document.pop("pretrain")
    document.pop("replacements")
    document["data"] = {"dataset": "digits", "split": "train", "classes": [0, 1, 2, 3, 4, 5]}
    document["evaluation"]["query_set"] = {"dataset": "digits", "split": "test", "classes": [6, 7, 8, 9],
                                           "per_class": 8}
    document["evaluation"]["gallery_set"] = {"dataset": "digits", "split": "train", "classes": [6, 7, 8, 9],
                                             "per_class": 8}
    document["model"] = {"backbone": "resnet32_cifar", "backbone_config": {"in_chans": 1}, "num_slots": 8}
    scenario.write_text(yaml.safe_dump(document))
    run_dir = f"s3://{s3_bucket}/runs/tiny"
    run_dir = f"{run_dir}-{executor}"
    first = _compat(tmp_path, "run", str(scenario), "--output", run_dir, "--no-progress", "--tracking-uri", "none",
                    "--executor", executor)
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = _compat(tmp_path, "run", "--resume", run_dir, "--no-progress", "--tracking-uri", "none")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "stages run, " in resumed.stdout and "(0 stages run" in resumed.stdout

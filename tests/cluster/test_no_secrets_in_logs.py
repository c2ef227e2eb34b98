"""No secret in any file a run or a Tune search leaves behind: the S3 secret key of the environment and the password
of a tracking URI are looked for in the output, the run folder on S3, the MLflow server's store, the search folder
and every file of the Ray session of the test's own Ray instance (runtime-env agent log included)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "pipelines" / "tiny_scenario_helpers.py"
sys.path.insert(0, str(TINY.parent))
import tiny_scenario_helpers as tiny  # noqa: E402

PASSWORD = "pw-marker-7f3c9e1d"
SPACE = {"parameters": {"method.params.lam": {"type": "categorical", "values": [0.0, 1.0]}}}


def _cli(args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    """`compat ARGS` in a fresh interpreter with the tiny dataset registered."""
    code = (f"import sys; sys.path.insert(0, {str(TINY.parent)!r}); import tiny_scenario_helpers as t; t.register(); "
            f"from app.cli import main; sys.exit(main({args!r}))")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=420)


def _files_holding(root: Path, secrets: list[str]) -> list[str]:
    found = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            try:
                data = path.read_bytes()
            except OSError:
                continue
            found += [f"{path}: {secret[:4]}..." for secret in secrets if secret.encode() in data]
    return found


def test_run_and_tune_leave_no_secret_behind(s3_server, s3_env, s3_bucket, mlflow_server, tmp_path):
    import boto3

    secret_key = s3_env["AWS_SECRET_ACCESS_KEY"]
    secrets = [secret_key, PASSWORD]
    port = mlflow_server.tracking_uri.rsplit(":", 1)[1]
    tracking = f"http://compat-user:{PASSWORD}@127.0.0.1:{port}"
    ray_tmp = Path(tempfile.mkdtemp(prefix="rs", dir="/tmp"))  # short: Ray's socket paths have a length limit
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_TMPDIR": str(ray_tmp), "MLFLOW_TRACKING_URI": tracking,
           "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    config = tmp_path / "tiny.yaml"
    document = tiny.scenario("dsimplex-hoc", {"lam": 0.1, "rho": 10.0})
    document["tasks"] = {"spec": "2+2"}
    document["replacements"] = []
    config.write_text(yaml.safe_dump(document))
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(SPACE))

    run = _cli(["run", str(config), "--output", f"s3://{s3_bucket}/run", "--no-progress"],
               env, tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # the URI is printed without its credentials (they went to MLFLOW_TRACKING_USERNAME / _PASSWORD)
    assert f"MLflow: http://127.0.0.1:{port} (experiment" in run.stdout
    tune = _cli(["tune", str(config), "--space", str(tmp_path / "space.yaml"), "--samples", "2", "--concurrent", "1",
                 "--scheduler", "none", "--storage", str(tmp_path / "searches"), "--name", "s",
                 "--plugin", f"{TINY}:register", "--cpus-per-trial", "1"], env, tmp_path)
    assert tune.returncode == 0, tune.stdout[-3000:] + tune.stderr[-3000:]

    leaks = [f"{name}: {secret[:4]}..." for name, text in (("run output", run.stdout + run.stderr),
                                                            ("tune output", tune.stdout + tune.stderr))
             for secret in secrets if secret in text]
    assert list(ray_tmp.rglob("runtime_env_agent.log")), "the Ray session of this test was not where expected"
    leaks += _files_holding(ray_tmp, secrets)
    leaks += _files_holding(tmp_path, secrets)
    leaks += _files_holding(Path(mlflow_server.root), secrets)
    client = boto3.client("s3", endpoint_url=s3_env["AWS_ENDPOINT_URL"], region_name=s3_env["AWS_REGION"])
    keys = [item["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=s3_bucket)
            for item in page.get("Contents", [])]
    assert any(key.endswith("matrix.json") for key in keys)
    for key in keys:
        body = client.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
        leaks += [f"s3://{s3_bucket}/{key}: {secret[:4]}..." for secret in secrets if secret.encode() in body]
    assert not leaks, leaks

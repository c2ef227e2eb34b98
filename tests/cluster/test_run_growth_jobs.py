"""A run grown by one task as Ray Jobs on a real Ray head on 127.0.0.1 (``started_head`` of test_jobs.py), with the
run store in a local folder and on the S3 test server: each job runs what ``compat submit`` runs (``compat run
scenario.yaml --executor ray --address auto --output OUT``, the runtime env of :func:`cluster.ray.jobs.
pipeline_runtime_env`), first the 2-task scenario, then the same with a third task appended into the same OUT. The
second job computes only the new task's stages (counted from the engine's invocation record) and the grown matrix
equals byte for byte the 3-task scenario run from scratch on the local executor."""
from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import pytest
import yaml

from test_code_identity_job import run_job, staging_folder
from test_jobs import started_head

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))
import tiny_scenario_helpers as tiny  # noqa: E402

from app.cli import main  # noqa: E402
from cluster.ray import jobs  # noqa: E402
from cluster.storage.s3 import configure_object_storage  # noqa: E402
from compat_core import io as cio  # noqa: E402

pytestmark = pytest.mark.integration

NEW_TASK = {"finetune": 1, "extract": 2, "entry": 3, "evaluate": 1}  # T = 2 -> 3: 1 + 2 + 3 + 1


def scenarios(tmp_path: Path) -> tuple[dict, dict]:
    short = tiny.scenario("er", output=str(tmp_path / "unused"))
    short.pop("replacements")
    short["tasks"]["spec"] = "2+1x2"
    long = yaml.safe_load(yaml.safe_dump(short))
    long["tasks"]["spec"] = "2+2x2"
    return short, long


def invocations(run_dir: str) -> dict[str, list[str]]:
    """executions/*.json of a run folder (local or s3://): name -> the stage keys it computed."""
    folder = cio.join(run_dir, "executions")
    return {name: json.loads(cio.read_bytes(cio.join(folder, name)))["executed"] for name in cio.list_dir(folder)}


def test_a_run_grows_through_ray_jobs_in_a_folder_and_on_s3(s3_env, s3_bucket, tmp_path, monkeypatch,
                                                            fresh_object_storage):
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    configure_object_storage()  # this process reads the S3 run back
    short, long = scenarios(tmp_path)
    scratch = tmp_path / "scratch"
    long_file = tmp_path / "long.yaml"
    long_file.write_text(yaml.safe_dump(long))
    tiny.register()
    assert main(["run", str(long_file), "--output", str(scratch), "--no-progress", "--tracking-uri", "none"]) == 0
    outputs = {"folder": str(tmp_path / "grown"), "s3": f"s3://{s3_bucket}/runs/grown"}
    counted = {}
    with started_head() as address:  # started here: the head (and so each job) has the test server's AWS variables
        client = jobs.job_client(address)
        for where, output in outputs.items():
            for step, document in (("short", short), ("grow", long)):
                staging = staging_folder(tmp_path / f"staging-{where}-{step}", document)
                command = jobs.python_command(["cli.py", "run", "scenario.yaml", "--executor", "ray", "--address",
                                               "auto", "--no-progress", "--tracking-uri", "none", "--output",
                                               output])
                env = dict(jobs.pipeline_runtime_env(staging), worker_process_setup_hook="tiny_scenario_helpers.register")
                known = set(invocations(output)) if step == "grow" else set()
                logs = run_job(client, f"compat-growth-{where}-{step}-{tmp_path.name}", command, env)
                if step == "grow":
                    assert "7 stages run, 12 already done" in logs, logs[-3000:]
            (new,) = set(invocations(output)) - known
            executed = invocations(output)[new]
            counted[where] = dict(collections.Counter(key.split("-", 1)[0] for key in executed))
            assert counted[where] == NEW_TASK, (where, executed)
            for name in ("matrix.json", "metrics.json"):
                assert cio.read_bytes(cio.join(output, name)) == (scratch / name).read_bytes(), (where, name)
            growth = cio.list_dir(cio.join(output, "extensions"))
            assert len(growth) == 1
            record = json.loads(cio.read_bytes(cio.join(output, "extensions", growth[0])))
            assert record["new_stages_by_kind"] == NEW_TASK and record["tasks"] == 3
            assert yaml.safe_load(cio.read_bytes(cio.join(output, "config.yaml")))["tasks"]["spec"] == "2+2x2"
    print("stage counts of the growth:", json.dumps(counted))

"""One code identity on every executor, against a real Ray head on 127.0.0.1 (``ray_head`` of test_jobs.py).

The tiny scenario runs twice from this checkout: in this process with the local executor, and as a Ray Job submitted
with the runtime env ``compat submit`` builds (``cluster.ray.jobs.pipeline_runtime_env``: the packages travel as
``py_modules``, so the job imports copies unpacked elsewhere) running ``compat run --executor ray --address auto``
(a worker setup hook registers the test-only dataset in the workers).
Both runs must hold the same stage keys and manifests that record the same code version. A job whose packages come
from a copy of the tree with an edited loss reports another code version.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import yaml

from test_jobs import ray_head  # noqa: F401  (the module-scoped real Ray head fixture)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))
import tiny_scenario_helpers as tiny  # noqa: E402

from app.cli import main  # noqa: E402
from cluster.ray import jobs  # noqa: E402
from pipelines.graph.code_version import code_version  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# the job's `compat`: the tiny dataset registered (from the job's working_dir), then the CLI; says where the
# packages were imported from
JOB_CLI = """
import os, sys
sys.path.insert(0, os.getcwd())
import torch
torch.set_num_threads(1)
import tiny_scenario_helpers as tiny
tiny.register()
import compat_core
print("compat_core imported from", os.path.dirname(compat_core.__file__), flush=True)
from app.cli import main
sys.exit(main(sys.argv[1:]))
"""
VERSION_PROBE = ("import compat_core, os; from pipelines.graph.code_version import code_version; "
                 "print('code version', code_version(), 'from', os.path.dirname(compat_core.__file__))")


def stage_manifests(run_dir: Path) -> dict[str, dict]:
    """stage key -> manifest of every committed stage of a run directory."""
    return {path.stem: json.loads(path.read_text()) for path in sorted((run_dir / "manifests").glob("*.json"))}


def blob_digests(manifests: dict[str, dict]) -> dict[str, dict[str, str]]:
    """stage key -> {blob name: sha256} (a manifest's record also says where the stage ran, which may differ)."""
    return {key: {name: blob["sha256"] for name, blob in manifest["blobs"].items()}
            for key, manifest in manifests.items()}


def staging_folder(folder: Path, scenario: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "scenario.yaml").write_text(yaml.safe_dump(scenario, sort_keys=False))
    (folder / "cli.py").write_text(JOB_CLI)
    shutil.copy(Path(tiny.__file__), folder / "tiny_scenario_helpers.py")
    return folder


def run_job(client, submission_id: str, entrypoint: str, runtime_env: dict) -> str:
    outcome = jobs.submit_entrypoint(client, submission_id, entrypoint, runtime_env)
    status = jobs.wait_for(client, outcome.submission_id, timeout_s=900, poll_s=1.0)
    logs = client.get_job_logs(outcome.submission_id)
    assert status == "SUCCEEDED", logs[-4000:]
    return logs


def test_local_run_and_ray_job_have_the_same_stage_keys_and_code_version(ray_head, tmp_path):  # noqa: F811
    scenario = tiny.scenario("dsimplex-hoc", output=str(tmp_path / "unused"))
    local_dir, job_dir = tmp_path / "local", tmp_path / "job"
    staging = staging_folder(tmp_path / "staging", scenario)
    assert main(["run", str(staging / "scenario.yaml"), "--output", str(local_dir), "--no-progress",
                 "--tracking-uri", "none"]) == 0

    client = jobs.job_client(ray_head)
    command = jobs.python_command(["cli.py", "run", "scenario.yaml", "--executor", "ray", "--address", "auto",
                                   "--no-progress", "--tracking-uri", "none", "--output", str(job_dir)])
    # the product's env, plus a hook that registers the test-only dataset in the Ray workers that run the stages
    job_env = dict(jobs.pipeline_runtime_env(staging), worker_process_setup_hook="tiny_scenario_helpers.register")
    logs = run_job(client, f"compat-code-identity-{tmp_path.name}", command, job_env)
    imported_from = Path(logs.split("compat_core imported from ")[1].split()[0])
    assert (ROOT / "compat_core").resolve() != imported_from.resolve()  # the job's own copy of the packages

    local, job = stage_manifests(local_dir), stage_manifests(job_dir)
    assert len(local) > 10 and sorted(job) == sorted(local)  # 100 % of the stage keys equal
    assert {manifest["code_version"] for manifest in local.values()} == {code_version()}
    assert {manifest["code_version"] for manifest in job.values()} == {code_version()}
    assert blob_digests(job) == blob_digests(local)  # and the same bytes under each key
    # each run's config.yaml names the folder it ran in (the staged scenario said output.dir: .../unused)
    assert yaml.safe_load((job_dir / "config.yaml").read_text())["output"]["dir"] == str(job_dir)
    assert yaml.safe_load((local_dir / "config.yaml").read_text())["output"]["dir"] == str(local_dir)

    # the same job env with the packages of a copy whose loss differs: the job hashes another code version
    copy = tmp_path / "edited"
    for package in jobs.PACKAGES:
        shutil.copytree(ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    losses = copy / "compat_core" / "losses.py"
    losses.write_text(losses.read_text().replace("return F.cross_entropy(_at_least_fp32(logits)",
                                                 "return 0.5 * F.cross_entropy(_at_least_fp32(logits)"))
    edited_env = dict(jobs.pipeline_runtime_env(staging), py_modules=[str(copy / p) for p in jobs.PACKAGES])
    probe = jobs.python_command(["-c", VERSION_PROBE])
    same = run_job(client, f"compat-code-same-{tmp_path.name}", probe, jobs.pipeline_runtime_env(staging))
    edited = run_job(client, f"compat-code-edited-{tmp_path.name}", probe, edited_env)
    assert f"code version {code_version()} from" in same
    assert "code version " in edited and f"code version {code_version()} from" not in edited

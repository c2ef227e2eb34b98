"""benchmarks/real_job.py --smoke: the GPU job's every step at tiny shapes on the CPU, through the product's own path
(CelebA-layout JPEGs ingested into a real SeaweedFS S3 server, ``compat run --executor ray`` of the real CelebA
config with its roots overridden, the bare step, one matrix entry against fp64), and its report."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.integration
def test_real_job_smoke_runs_the_product_path_and_reports(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "real_job.py"), "--smoke", "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "real_job.json").read_text())
    product = report["product"]
    assert product["executor"] == "ray" and product["data"].startswith("s3")
    tasks = {task["task"]: task for task in product["tasks"]}
    assert sorted(tasks) == [0, 1]
    for task in tasks.values():
        assert task["images_per_s"] > 0 and 0.0 <= task["input_stall_fraction"] <= 1.0
        assert task["first_step_seconds"] > 0
    assert report["bare"]["images_per_s"] > 0
    # the eager and the compiled step, each through the product path, each against the bare eager step
    products = {product["compile"]: product for product in report["products"]}
    assert sorted(products) == ["off", "on"]
    for mode, run in products.items():
        assert {task["compiled"] for task in run["tasks"]} == {mode}
        assert run["product_over_bare"] > 0
    workers = report["workers"]
    assert workers["second_task_first_step_per_stage_s"] > 0 and workers["second_task_first_step_persistent_s"] > 0
    entry = report["entry"]
    assert entry["product_entry_cpu_equal_to_fp64"]
    assert entry["product_entry_cpu_recall_at_1"] == entry["fp64_recall_at_1"]
    assert "no CUDA" in report["cuda_tests"]["status"]
    assert "| product path" in (tmp_path / "real_job.md").read_text()

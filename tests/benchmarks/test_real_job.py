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
    # the eager baseline and each option on alone, each through the product path against the bare eager step
    products = {product["variant"]: product for product in report["products"]}
    assert sorted(products) == ["compiled", "eager", "gpu decode", "prefetch first batches"]
    assert products.pop("gpu decode")["status"] == "not measured: no CUDA device"
    for variant, run in products.items():
        assert {task["compiled"] for task in run["tasks"]} == {"on" if variant == "compiled" else "off"}
        assert {task["channels_last"] for task in run["tasks"]} == {"off"}  # a ViT: nothing to lay out
        assert run["product_over_bare"] > 0
    workers = report["workers"]
    for name in ("per-stage_workers", "per-stage_prefetch", "persistent_workers", "persistent_prefetch"):
        assert workers[f"{name}: tasks 2..3 first step s"] > 0
        assert 0.0 <= workers[f"{name}: tasks 2..3 input stall"] <= 1.0
        # persistent workers outlive tasks whose replay memory makes a new source each time
        assert workers[f"{name}: same worker processes over the run"] is name.startswith("persistent")
    decode = report["decode"]
    assert decode["cpu_worker_images_per_s"] > 0 and decode["device_decoder_on_cpu_images_per_s"] > 0
    assert decode["device_decoder_max_abs_difference"] <= 6 and decode["device_decoder_mean_abs_difference"] <= 2
    assert decode["gpu_decode_images_per_s"] == "not measured: no CUDA device"
    assert decode["gpu_decode_at_load"].startswith("refused: ")
    assert any(key.startswith("cpu workers per GPU at the product's") for key in decode)
    layout = report["channels_last"]
    assert layout["contiguous_step_s"] > 0 and layout["channels_last_step_s"] > 0
    assert layout["vit_config_with_on"].startswith("refused: training.channels_last: on needs convolutional")
    entry = report["entry"]
    assert entry["product_entry_cpu_equal_to_fp64"]
    assert entry["product_entry_cpu_recall_at_1"] == entry["fp64_recall_at_1"]
    assert "no CUDA" in report["cuda_tests"]["status"]
    markdown = (tmp_path / "real_job.md").read_text()
    assert "| product path, eager" in markdown
    assert "| product path, gpu decode (1 input workers) | not measured: no CUDA device |" in markdown

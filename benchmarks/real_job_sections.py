"""Sections 6-8 of ``benchmarks/real_job.py`` (see its module doc): input workers across tasks, JPEG decode on the
CPU and on the GPU, and the channels_last layout probe. Each returns a flat dict of measured values (never an
estimate: what was not measured says so)."""
from __future__ import annotations

import importlib.util
import math
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "iam-cl2r-celeba-dinov3-t16.yaml"


def _finish(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- 6. input workers that outlive a task --------------------------------------------------------------------------
def run_workers(shape, repeats: int) -> dict:
    """The time to first step and input stall of tasks 2..3 of a run, each with a new replay memory (the pool
    followed by JPEG exemplars of every earlier class, as a fine-tuning stage reads its replay shard), with input
    workers started per task and with persistent ones (``training.persistent_workers``), each with and without
    ``training.prefetch_first_batches``, three tasks in this process (``benchmarks/persistent_workers.py``; pool reads
    cost 2 ms per image, as a JPEG decode); medians over rounds and tasks, and whether the worker processes stayed
    the same over the run."""
    spec = importlib.util.spec_from_file_location("persistent_workers", ROOT / "benchmarks" / "persistent_workers.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    workers = max(1, shape.input_workers)
    tasks = 3
    measured = bench.measure(256, 32, workers, 2, repeats, decode_ms=2.0, tasks=tasks)
    base = measured["per-stage workers"]["first_step_s"]
    result: dict = {"input_workers": workers, "decode_ms_per_image": 2.0, "repeats": repeats,
                    "tasks (from the second with replay memory)": tasks}
    for name, values in measured.items():
        key = name.replace(" + ", "_").replace(" ", "_")
        result[f"{key}: tasks 2..{tasks} first step s"] = values["first_step_s"]
        result[f"{key}: over per-stage workers"] = values["first_step_s"] / base
        result[f"{key}: tasks 2..{tasks} input stall"] = values["input_stall_fraction"]
        result[f"{key}: same worker processes over the run"] = values["same_workers"]
    return result


# ---- 7. JPEG decode on the CPU and on the GPU ----------------------------------------------------------------------
def run_decode(shape, data_root: Path, device: torch.device, product_rate: float | None,
               bare_rate: float | None) -> dict:
    """Decode throughput of one input worker (one core, the shards' CPU decoder) and of the GPU decoder
    (``training.decode: gpu``) on the job's JPEGs at its image size, the GPU decoder's pixels against the CPU's,
    and the CPU workers one GPU needs to decode at the product's and the bare step's images/s."""
    import cv2

    from compat_core.data.device_decode import decode_on_device
    from compat_core.data.encoded import decode_batch
    from pipelines.training.settings import TrainConfig

    files = sorted((data_root / "img_align_celeba").glob("*.jpg"))[:256]
    blobs = [path.read_bytes() for path in files]
    size = shape.image_size
    threads, cv2_threads = torch.get_num_threads(), cv2.getNumThreads()
    torch.set_num_threads(1)   # as an input worker decodes (compat_core.data.stream)
    cv2.setNumThreads(1)
    try:
        decode_batch(blobs[:8], size, "warm-up")
        started = time.perf_counter()
        reference = decode_batch(blobs, size, "celeba")
        cpu_rate = len(blobs) / (time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
        cv2.setNumThreads(cv2_threads)
    result: dict = {"images": len(blobs), "image_size": size, "cpu_worker_images_per_s": cpu_rate}
    where = device if device.type == "cuda" else torch.device("cpu")
    decode_on_device(blobs[:8], size, where, "warm-up")
    _finish(where)
    started = time.perf_counter()
    decoded = decode_on_device(blobs, size, where, "celeba")
    _finish(where)
    rate = len(blobs) / (time.perf_counter() - started)
    difference = (decoded.cpu().to(torch.int16) - torch.from_numpy(reference).to(torch.int16)).abs()
    result["device_decoder_max_abs_difference"] = int(difference.max())
    result["device_decoder_mean_abs_difference"] = float(difference.float().mean())
    if where.type == "cuda":
        result["gpu_decode_images_per_s"] = rate
    else:
        result["gpu_decode_images_per_s"] = "not measured: no CUDA device"
        result["device_decoder_on_cpu_images_per_s"] = rate
        try:
            TrainConfig(decode="gpu")
            result["gpu_decode_at_load"] = "accepted"
        except ValueError as error:
            reason = [line.strip() for line in str(error).splitlines() if "CUDA" in line]
            result["gpu_decode_at_load"] = "refused: " + (reason or [str(error)])[0][:160]
    for name, value in (("product", product_rate), ("bare step", bare_rate)):
        if value:
            result[f"cpu workers per GPU at the {name}'s {value:.4g} images/s"] = math.ceil(value / cpu_rate)
    return result


# ---- 8. the channels_last layout -----------------------------------------------------------------------------------
def run_layout(shape, device: torch.device) -> dict:
    """``training.channels_last: auto``'s probe on a convolutional backbone (ResNet-18 at the job's image size, the
    probe batch, under bf16 on CUDA) and the job's ViT config refusing ``on`` at load."""
    from compat_core.hardware.layout_probe import measure_layouts
    from compat_core.models.compat_model import create_model
    from pipelines.config.load import ConfigError, load_config

    torch.manual_seed(0)
    model = create_model("resnet18", shape.num_slots, classifier="simplex")
    example = torch.rand(16, 3, shape.image_size, shape.image_size)
    dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    measured = measure_layouts(model, example, device, dtype)
    result = {"backbone": "resnet18", "dtype": str(dtype or "fp32").replace("torch.", ""),
              "contiguous_step_s": measured["contiguous_s"], "channels_last_step_s": measured["channels_last_s"],
              "contiguous_over_channels_last": measured["contiguous_s"] / measured["channels_last_s"],
              "auto_choice": measured["choice"]}
    try:
        load_config(str(CONFIG), ['training.channels_last="on"'])
        result["vit_config_with_on"] = "accepted"
    except ConfigError as error:
        result["vit_config_with_on"] = "refused: " + str(error).splitlines()[-1].strip()[:160]
    return result


__all__ = ["run_decode", "run_layout", "run_workers"]

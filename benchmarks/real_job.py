"""The CelebA / DINOv3 job at its real shape, in one command, for the day a GPU is lent.

    python benchmarks/real_job.py                 # on a CUDA machine: ViT-B/16 at 224 px, K = 22,000, batch 320
    python benchmarks/real_job.py --smoke         # tiny shapes on the CPU (what CI runs): every step, in seconds

What it does, in order, and what it reports (one table, as JSON and markdown, under ``--out``):

1. ``cuda tests``: the test suite's CUDA-only tests (``pytest -m cuda``), passed / failed / skipped.
2. ``data``: CelebA-layout synthetic JPEGs (178 x 218 aligned-face size, ``img_align_celeba/``,
   ``identity_CelebA.txt``, ``list_eval_partition.txt``): 2 tasks of 512 identities with 12 train images each, and
   512 other identities with 4 test images each (CelebA's partitions are identity-disjoint). With an S3 server and Ray available (``--executor ray``, what the test suite's machine has),
   they are ingested into the local S3 server with ``compat ingest`` and read from the bucket.
3. ``product``: once per variant (``--variants``): ``eager`` (every option below off: the eager step, input workers
   started per task, the stream opened when the epochs start, CPU decode), then each option on alone against it:
   ``compiled`` (``training.compile: on``, the compile time inside the run's time to first step), ``persistent
   workers``, ``prefetch first batches`` (``training.prefetch_first_batches``) and ``gpu decode``
   (``training.decode: gpu``, CUDA only: "not measured" elsewhere), each a ``compat run`` of the real config
   ``configs/iam-cl2r-celeba-dinov3-t16.yaml`` with its data roots overridden, 2 of its 16 tasks (task 1 trains d-Simplex-HOC against the frozen task-0 model, K = 22,000), no
   third-party stages (random initial weights: speed does not depend on them) and a step budget
   (``training.steps_per_epoch``). From the stage records: images/s (mean over the task's steps, the wait for the
   first batch included, so start-up counts against the product), device
   busy fraction (NVML samples inside the training loop), input-stall fraction (device idle while waiting for a
   batch, an upper bound), peak GPU memory, time to the first step.
4. ``bare``: the same step in bare PyTorch/timm on the same device: the same timm ViT, junction, closed-form
   d-Simplex logits and HOC loss, batches already on the device, no input pipeline; product / bare is the ratio.
5. ``entry``: one matrix entry at CelebA's evaluation shape (about 10,000 query x 10,000 gallery features of
   d = 21,999, as stored: fp16) through the product's entry function (``pipelines.stages.entry_metrics.compute_entry``) on
   the GPU, as an entry stage with a GPU runs it, and on the CPU, both checked against an fp64 brute-force Recall@1.

6. ``workers``: the time to first step and input stall of tasks 2..3, each with a new replay memory as IAM-CL2R's
   tasks have, with input workers started per task and with workers that outlive a task
   (``training.persistent_workers``), each with and without ``training.prefetch_first_batches``, in one process
   (``benchmarks/persistent_workers.py``), and whether the worker processes stayed the same over the run.
7. ``decode``: JPEG decode throughput of one input worker (the shards' CPU decoder on one core) and on the GPU
   (``training.decode: gpu``'s decoder; "not measured" without CUDA) on the job's JPEGs, its pixels against the CPU
   decoder's, and the CPU workers one GPU needs at the product's rate (the eager product's task-1 images/s, and the
   bare step's) over one worker's decode rate.
8. ``channels_last``: the layout probe behind ``training.channels_last: auto`` on a convolutional backbone (ResNet-18
   at the job's image size: contiguous and channels_last step seconds), and the job's ViT config refusing ``on``.

Where Ray, MLflow or the S3 server are not installed (a bare GPU machine), step 3 runs the same stages through
``compat run --executor local --tracking-uri none`` and the table says so. Never reports a number it did not measure.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.real_job_sections import run_decode, run_layout, run_workers  # noqa: E402
from compat_core.losses import compatibility_info_nce, simplex_cross_entropy  # noqa: E402
from compat_core.simplex import dsimplex_logits  # noqa: E402

CONFIG = ROOT / "configs" / "iam-cl2r-celeba-dinov3-t16.yaml"


@dataclass(frozen=True)
class Shape:
    """Everything that differs between the real shape and the smoke test."""

    image_size: int
    num_slots: int
    identities_per_task: int
    train_images: int          # per identity
    test_identities: int       # of the test partition (disjoint from the training identities, as CelebA's)
    test_images: int           # per test identity
    batch_size: int
    steps: int                 # optimiser steps per epoch (the step budget)
    epochs: int                # epochs per task (more epochs: the input stream's start-up weighs less)
    backbone_config: dict
    entry_rows: int            # query = gallery rows of the matrix entry
    input_workers: int
    variants: tuple = ("eager", "compiled", "persistent workers", "prefetch first batches", "gpu decode")


FULL = Shape(image_size=224, num_slots=22000, identities_per_task=512, train_images=12, test_identities=512,
             test_images=4,
             batch_size=320, steps=40, epochs=1, backbone_config={}, entry_rows=10_000, input_workers=3)
SMOKE = Shape(image_size=32, num_slots=64, identities_per_task=8, train_images=4, test_identities=8, test_images=2,
              batch_size=16,
              steps=3, epochs=1, backbone_config={"img_size": 32, "depth": 1, "embed_dim": 64, "num_heads": 2},
              entry_rows=200, input_workers=1, variants=("eager", "compiled", "prefetch first batches", "gpu decode"))
TASKS = 2
# every option of the product off: the eager baseline each variant turns one option on against
BASELINE = {"training.compile": "off", "training.persistent_workers": False, "training.prefetch_first_batches": False,
            "training.decode": "cpu", "training.channels_last": "off"}
VARIANTS = {
    "eager": {},
    "compiled": {"training.compile": "on"},
    "persistent workers": {"training.persistent_workers": True},
    "prefetch first batches": {"training.prefetch_first_batches": True},
    "gpu decode": {"training.decode": "gpu"},
}


def log(message: str) -> None:
    print(f"[real_job {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---- 1. CUDA-only tests --------------------------------------------------------------------------------------------
def run_cuda_tests(timeout_s: float, out: Path) -> dict:
    """``pytest -m cuda`` in a subprocess; counts parsed from its summary line."""
    if not torch.cuda.is_available():
        return {"status": "skipped: no CUDA device"}
    if importlib.util.find_spec("pytest") is None:
        return {"status": "skipped: pytest not installed"}
    # only the files that hold CUDA tests: others import the cluster stack, which a bare GPU machine may lack
    files = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
                   if "pytest.mark.cuda" in path.read_text())
    command = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", *files]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    (out / "cuda_tests.log").write_text(done.stdout + done.stderr)
    tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
    counts = {}
    for line in tail:
        for word in ("passed", "failed", "skipped", "error", "deselected"):
            for part in line.replace(",", " ").split(" in ")[0].split("  "):
                pieces = part.split()
                if len(pieces) >= 2 and pieces[-1].startswith(word) and pieces[-2].isdigit():
                    counts[word] = int(pieces[-2])
    return {"status": "ok" if done.returncode == 0 else f"exit {done.returncode}", "seconds": time.perf_counter() -
            started, **counts, "tail": tail[-6:]}


# ---- 2. data -------------------------------------------------------------------------------------------------------
def _face_like(identity: int, index: int, rng: np.random.Generator) -> np.ndarray:
    """A 218 x 178 RGB image with smooth structure (JPEG sizes near real aligned faces, ~10-20 kB)."""
    h, w = 218, 178
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.array([(identity * 37) % 200 + 30, (identity * 91) % 200 + 30, (identity * 53) % 200 + 30], np.float32)
    cy, cx = 109 + 6 * np.sin(index), 89 + 6 * np.cos(index)
    face = np.exp(-(((yy - cy) / 70) ** 2 + ((xx - cx) / 55) ** 2))[..., None]
    image = base * (0.4 + 0.6 * face) + rng.normal(0, 12, (h, w, 3)).astype(np.float32)
    return np.clip(image, 0, 255).astype(np.uint8)


def _encode(args: tuple[int, int, int]) -> bytes:
    from PIL import Image

    identity, index, seed = args
    buffer = io.BytesIO()
    Image.fromarray(_face_like(identity, index, np.random.default_rng(seed))).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def write_celeba(root: Path, shape: Shape) -> dict:
    """CelebA's published layout: img_align_celeba/NNNNNN.jpg, identity_CelebA.txt, list_eval_partition.txt."""
    from concurrent.futures import ProcessPoolExecutor

    images = root / "img_align_celeba"
    images.mkdir(parents=True, exist_ok=True)
    entries = []  # (file, identity 1-based, partition)
    jobs = []
    number = 0
    train_ids = TASKS * shape.identities_per_task
    # CelebA's partitions are identity-disjoint (the open-set guard checks it): test identities come after
    plan = [(identity, shape.train_images, 0) for identity in range(1, train_ids + 1)]
    plan += [(identity, shape.test_images, 2) for identity in range(train_ids + 1, train_ids + shape.test_identities + 1)]
    for identity, count, partition in plan:
        for index in range(count):
            number += 1
            entries.append((f"{number:06d}.jpg", identity, partition))
            jobs.append((identity, index, number))
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        encoded = list(pool.map(_encode, jobs, chunksize=64))
    total = 0
    for (name, _, _), data in zip(entries, encoded):
        (images / name).write_bytes(data)
        total += len(data)
    (root / "identity_CelebA.txt").write_text("".join(f"{n} {i}\n" for n, i, _ in entries))
    (root / "list_eval_partition.txt").write_text("".join(f"{n} {p}\n" for n, _, p in entries))
    return {"images": len(entries), "identities": len(plan), "mean_jpeg_bytes":
            total / len(entries), "seconds": time.perf_counter() - started}


# ---- device sampling -----------------------------------------------------------------------------------------------
class DeviceSampler:
    """NVML utilisation (percent of time a kernel ran, per ~1/6 s window) sampled every 50 ms, with timestamps."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.available = torch.cuda.is_available()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.time(), float(torch.cuda.utilization())))
            except Exception:  # NVML missing: no busy fraction (reported as such)
                self.available = False
                return
            self._stop.wait(0.05)

    def __enter__(self) -> "DeviceSampler":
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def busy_between(self, start: float, end: float) -> float | None:
        inside = [u for t, u in self.samples if start <= t <= end]
        return float(np.mean(inside)) / 100.0 if inside and self.available else None


# ---- 3. the product ------------------------------------------------------------------------------------------------
def _has_cluster_stack() -> bool:
    try:
        return all(importlib.util.find_spec(name) is not None for name in ("ray", "mlflow", "boto3"))
    except ImportError:
        return False


def _s3_server(folder: Path):
    """The SeaweedFS server the test suite uses (tests/local_services.py), or None when its binary is missing."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from local_services import SeaweedS3Server
    except ImportError:
        return None
    server = SeaweedS3Server(folder)
    try:
        server.start()
    except (FileNotFoundError, RuntimeError, OSError) as error:
        log(f"no S3 server ({error}); reading local files")
        return None
    return server


def _create_bucket(environment: dict, name: str) -> None:
    import boto3
    from botocore.config import Config

    boto3.client("s3", endpoint_url=environment["AWS_ENDPOINT_URL"], region_name=environment["AWS_REGION"],
                 aws_access_key_id=environment["AWS_ACCESS_KEY_ID"],
                 aws_secret_access_key=environment["AWS_SECRET_ACCESS_KEY"],
                 config=Config(request_checksum_calculation="when_required", s3={"addressing_style": "path"}),
                 ).create_bucket(Bucket=name)


def _compat(arguments: list[str], env: dict, timeout_s: float) -> float:
    started = time.perf_counter()
    command = [sys.executable, "-m", "app.cli", *arguments]
    log("$ compat " + " ".join(arguments))
    done = subprocess.run(command, cwd=ROOT, env=env, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"compat {arguments[0]} failed with exit {done.returncode}")
    return time.perf_counter() - started


@dataclass
class ProductData:
    """Where every product run of a report reads the CelebA JPEGs: ingested once into the S3 server (Ray executor),
    else the local files; ``env`` is the runs' environment."""

    executor: str
    pool: dict
    env: dict
    server: object = None

    @property
    def description(self) -> str:
        return "s3 (ingested shards)" if self.server is not None else "local JPEG files"


@contextlib.contextmanager
def product_data(shape: Shape, work: Path, data_root: Path, executor: str, timeout_s: float):
    """The :class:`ProductData` of a report (the S3 server stopped at exit)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")
    server = _s3_server(work / "s3") if executor == "ray" else None
    try:
        pool = {"dataset": "celeba", "root": str(data_root), "options": {"image_size": shape.image_size}}
        if server is not None:
            env.update(server.environment())
            _create_bucket(server.environment(), "real-job")
            root_uri = "s3://real-job/celeba-shards"
            _compat(["ingest", "celeba", "--root", str(data_root), "--split", "train", "--split", "test",
                     "--out", root_uri, "--workers", "0", "--option", f"image_size={shape.image_size}"], env,
                    timeout_s)
            pool = {"dataset": "shards", "root": root_uri, "options": {"decoder": "torchvision"}}
        yield ProductData("ray" if server is not None else "local", pool, env, server)
    finally:
        if server is not None:
            server.stop()


def run_product(shape: Shape, work: Path, data: ProductData, timeout_s: float, variant: str = "eager") -> dict:
    """``compat run`` of the CelebA config at ``shape`` with the baseline's options and ``variant``'s one turned on;
    per-task numbers read back from the run's stage records."""
    from pipelines.store.run_store import RunStore

    executor, pool, env = data.executor, data.pool, data.env
    gpus = 1 if torch.cuda.is_available() else 0
    cpus = max(1, min(8, (os.cpu_count() or 2) - 1))
    overrides = {
        "data.dataset": pool["dataset"], "data.root": pool["root"], "data.options": pool["options"],
        "tasks.spec": f"{TASKS}x{shape.identities_per_task}",
        "model.num_slots": shape.num_slots, "model.backbone_config": shape.backbone_config,
        "pretrain": [], "initial_model": None, "replacements": [],
        "training.epochs": shape.epochs, "training.steps_per_epoch": shape.steps,
        "training.batch_size": shape.batch_size, "training.input_workers": shape.input_workers,
        **BASELINE, **VARIANTS[variant],
        **{f"evaluation.{name}.{field}": pool[field] for name in ("query_set", "gallery_set")
           for field in ("dataset", "root", "options")},
        "resources.finetune": {"num_gpus": gpus, "num_cpus": cpus},
        "resources.extract": {"num_gpus": gpus, "num_cpus": min(4, cpus)},
    }
    arguments = ["run", str(CONFIG), "--output", str(work / "run"), "--executor", executor, "--no-progress"]
    for key, value in overrides.items():
        arguments += ["--set", f"{key}={json.dumps(value)}"]
    if executor == "local" or not _has_cluster_stack():
        arguments += ["--tracking-uri", "none"]
    else:
        arguments += ["--tracking-uri", f"sqlite:///{work / 'mlflow.db'}"]
    with DeviceSampler() as sampler:
        wall = _compat(arguments, env, timeout_s)
    store = RunStore(str(work / "run"))
    tasks, entry_devices, entry_seconds = [], set(), 0.0
    for key in sorted(store.stage_keys()):
        record = store.load_record(key)
        if key.startswith("entry-"):
            features = record.get("features") or {}
            entry_devices.add(str(features.get("device")))
            entry_seconds += float(features.get("seconds") or 0.0)
        if not key.startswith("finetune-"):
            continue
        manifest = store.load_manifest(key)
        training = record.get("training") or {}
        window = training.get("loop_unix_seconds") or [0.0, 0.0]
        tasks.append({
            "task": int(record["task"]),
            "images_per_s": training.get("images_per_s"),
            "input_stall_fraction": training.get("input_stall_fraction"),
            "device_busy_fraction": sampler.busy_between(*window) if len(window) == 2 else None,
            "first_step_seconds": training.get("first_step_seconds"),
            "peak_gpu_memory_gib": (training["peak_device_memory_bytes"] / 2**30
                                    if training.get("peak_device_memory_bytes") else None),
            "stage_seconds": float(training.get("seconds") or 0.0),
            "compiled": manifest.get("compile"),
            "channels_last": manifest.get("channels_last"),
        })
    metrics = json.loads((work / "run" / "metrics.json").read_text())
    return {"executor": executor, "data": data.description,
            "tracking": "mlflow sqlite" if "sqlite" in " ".join(arguments) else "off", "wall_seconds": wall,
            "tasks": sorted(tasks, key=lambda t: t["task"]), "AA": metrics.get("AA"),
            "entry_devices": sorted(entry_devices), "entry_seconds": entry_seconds}


# ---- 4. the bare step ----------------------------------------------------------------------------------------------
def run_bare(shape: Shape, device: torch.device, steps: int, autocast: str) -> dict:
    """The same HOC step in plain PyTorch/timm with batches already on the device; images/s after a warm-up."""
    import timm
    from torch import nn

    torch.manual_seed(0)
    options = dict(shape.backbone_config)
    options.setdefault("img_size", shape.image_size)
    backbone = timm.create_model("vit_base_patch16_dinov3", pretrained=False, num_classes=0, **options)
    width = backbone.num_features
    model = nn.Sequential(backbone, nn.Linear(width, shape.num_slots - 1, bias=False)).to(device)
    old = nn.Sequential(timm.create_model("vit_base_patch16_dinov3", pretrained=False, num_classes=0, **options),
                        nn.Linear(width, shape.num_slots - 1, bias=False)).to(device).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    images = torch.randn(shape.batch_size, 3, shape.image_size, shape.image_size, device=device)
    targets = torch.randint(0, shape.num_slots, (shape.batch_size,), device=device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(autocast)

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            projection = model(images)
            with torch.no_grad():
                old_features = torch.nn.functional.normalize(old(images), dim=1)
            features = torch.nn.functional.normalize(projection, dim=1)
            logits = dsimplex_logits(projection.float(), shape.num_slots)
            loss = 0.1 * simplex_cross_entropy(logits, targets) + 0.9 * compatibility_info_nce(
                features, old_features, targets, rho=10.0, masking="reference")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(2):
        step()
    _sync(device)
    started = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    seconds = time.perf_counter() - started
    return {"images_per_s": steps * shape.batch_size / seconds, "steps": steps, "autocast": autocast or "off",
            "peak_gpu_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- 5. one matrix entry -------------------------------------------------------------------------------------------
def run_entry(shape: Shape, device: torch.device) -> dict:
    """Recall@1 at CelebA's evaluation shape through the product's entry function on ``device`` and on the CPU."""
    from pipelines.config.load import load_config
    from pipelines.stages.entry_metrics import compute_entry

    rows, dim = shape.entry_rows, shape.num_slots - 1
    identities = max(2, rows // 10)
    generator = torch.Generator().manual_seed(1)
    centres = torch.nn.functional.normalize(torch.randn(identities, dim, generator=generator), dim=1)
    labels = torch.arange(rows) % identities

    def pool(seed: int) -> torch.Tensor:
        noise = torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed)) * 0.02
        return torch.nn.functional.normalize(centres[labels] + noise, dim=1).half()  # stored as fp16

    query, gallery = pool(2), pool(3)
    labels_np = labels.numpy()
    q64 = torch.nn.functional.normalize(query.double(), dim=1)
    g64 = torch.nn.functional.normalize(gallery.double(), dim=1)
    top = torch.cat([(q64[i:i + 1024] @ g64.T).argmax(dim=1) for i in range(0, rows, 1024)])
    expected = float((labels[top] == labels).double().mean())
    config = load_config(str(CONFIG))
    protocol = {"metric": "recall_at_1", "gallery": "instances", "label_level": "fine"}
    result = {"shape": f"{rows} x {rows} x {dim}", "fp64_recall_at_1": expected}
    # the entry stage searches on its device (a GPU where the stage has one); the CPU for comparison
    for where in dict.fromkeys([device.type, "cpu"]):
        if where == "cuda":
            compute_entry((query.numpy(), labels_np, None), (gallery.numpy(), labels_np, None), protocol, config,
                          device=where)  # warm-up: CUDA context and kernels
            _sync(device)
        started = time.perf_counter()
        value = compute_entry((query.numpy(), labels_np, None), (gallery.numpy(), labels_np, None), protocol, config,
                              device=where)
        _sync(device)
        result[f"product_entry_{where}_seconds"] = time.perf_counter() - started
        result[f"product_entry_{where}_recall_at_1"] = value
        result[f"product_entry_{where}_equal_to_fp64"] = value == expected
    return result


# ---- report --------------------------------------------------------------------------------------------------------
def markdown(report: dict) -> str:
    lines = [f"# real_job ({report['mode']}), {report['date']}", "",
             f"Machine: {report['machine']}", "", "| what | value |", "| --- | --- |"]

    def row(name: str, value) -> None:
        if isinstance(value, float):
            value = f"{value:.4g}"
        lines.append(f"| {name} | {value} |")

    tests = report.get("cuda_tests", {})
    row("CUDA-only tests", ", ".join(f"{k} {v}" for k, v in tests.items() if k not in ("tail", "seconds")))
    data = report.get("data", {})
    row("data", f"{data.get('images')} CelebA-layout JPEGs, {data.get('identities')} identities, "
                f"{data.get('mean_jpeg_bytes', 0):.0f} B each")
    bare = report.get("bare", {})
    row("bare PyTorch/timm step: images/s", bare.get("images_per_s"))
    row("bare step: peak GPU memory GiB", bare.get("peak_gpu_memory_gib"))
    for product in report.get("products", []):
        workers = product.get("input_workers")
        if "status" in product:
            row(f"product path, {product['variant']} ({workers} input workers)", product["status"])
            continue
        row(f"product path, {product['variant']} ({workers} input workers)",
            f"compat run --executor {product.get('executor')}, data {product.get('data')}, "
            f"tracking {product.get('tracking')}, {product.get('wall_seconds', 0):.1f} s wall")
        step = product["variant"]
        for task in product.get("tasks", []):
            name = (f"{workers} workers, {step}, task {task['task']} "
                    f"({'HOC, frozen old model' if task['task'] else 'SCE only'})")
            for key in ("images_per_s", "device_busy_fraction", "input_stall_fraction", "peak_gpu_memory_gib",
                        "first_step_seconds", "compiled", "channels_last"):
                row(f"{name}: {key}", task.get(key))
        row(f"{workers} workers, {step}: product / bare eager (task 1, HOC)", product.get("product_over_bare"))
        row(f"{workers} workers, {step}: matrix entries' device, seconds in all",
            f"{', '.join(product.get('entry_devices', []))}, {product.get('entry_seconds', 0):.2f} s")
    for section, label in (("workers", "input workers"), ("decode", "JPEG decode"),
                           ("channels_last", "channels_last probe")):
        for key, value in report.get(section, {}).items():
            row(f"{label}: {key}", value)
    entry = report.get("entry", {})
    for key, value in entry.items():
        row(f"matrix entry: {key}", value)
    return "\n".join(lines) + "\n"


def run_products(report: dict, shape: Shape, args, work: Path, executor: str, device: torch.device) -> None:
    """The product path once per input-worker count and variant (module doc, step 3), into ``report["products"]``;
    ``gpu decode`` is "not measured" without CUDA (the setting is refused at load there)."""
    with product_data(shape, work, work / "celeba", executor, args.timeout) as data:
        for workers in args.input_workers or [shape.input_workers]:
            for variant in args.variants or shape.variants:
                run_variant(report, shape, args, work, data, device, workers, variant)
    measured = [p for p in report.get("products", []) if "tasks" in p]
    if measured:
        report["product"] = measured[0]


def run_variant(report: dict, shape: Shape, args, work: Path, data: ProductData, device: torch.device,
                workers: int, variant: str) -> None:
    """One product run (``variant`` with ``workers`` input workers) into ``report["products"]``."""
    if VARIANTS[variant].get("training.decode") == "gpu" and device.type != "cuda":
        report.setdefault("products", []).append({"variant": variant, "input_workers": workers,
                                                  "status": "not measured: no CUDA device"})
        return
    sized = Shape(**{**shape.__dict__, "input_workers": workers})
    folder = work / f"workers-{workers}-{variant.replace(' ', '-')}"
    product = run_product(sized, folder, data, args.timeout, variant)
    product.update(input_workers=workers, variant=variant,
                   compile={**BASELINE, **VARIANTS[variant]}["training.compile"])
    report.setdefault("products", []).append(product)
    log(f"  {json.dumps(product)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU is fine): what CI runs")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "real_job"), help="report folder")
    parser.add_argument("--executor", choices=("auto", "ray", "local"), default="auto",
                        help="auto: ray with S3 where Ray, MLflow and the S3 server are installed, else local")
    parser.add_argument("--steps", type=int, default=None, help="step budget per epoch (default: the shape's)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs per task (default: the shape's, 1)")
    parser.add_argument("--skip", action="append", default=[],
                        choices=("tests", "product", "bare", "entry", "workers", "decode", "layout"))
    parser.add_argument("--input-workers", type=int, nargs="+", default=None,
                        help="run the product once per value of training.input_workers (default: the config's 3)")
    parser.add_argument("--variants", nargs="+", default=None, choices=tuple(VARIANTS),
                        help="run the product once per variant (default: the shape's; every one on the real shape)")
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds allowed to each subprocess")
    args = parser.parse_args(argv)
    shape = SMOKE if args.smoke else FULL
    if args.steps:
        shape = Shape(**{**shape.__dict__, "steps": args.steps})
    if args.epochs:
        shape = Shape(**{**shape.__dict__, "epochs": args.epochs})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not args.smoke and device.type != "cuda":
        parser.error("the real shape needs a CUDA device (K = 22,000, ViT-B/16 at 224 px, batch 320); use --smoke")
    executor = args.executor
    if executor == "auto":
        executor = "ray" if _has_cluster_stack() else "local"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    report: dict = {"mode": "smoke" if args.smoke else "full", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "machine": f"{name}, {os.cpu_count()} CPUs, torch {torch.__version__}", "shape": shape.__dict__}
    started = time.perf_counter()
    if "tests" not in args.skip:
        log("CUDA-only tests")
        report["cuda_tests"] = run_cuda_tests(args.timeout, out)
        log(f"  {report['cuda_tests']}")
    with tempfile.TemporaryDirectory(prefix="real-job-") as scratch:
        work = Path(scratch)
        if not {"product", "decode"} <= set(args.skip):
            log("writing CelebA-layout JPEGs")
            report["data"] = write_celeba(work / "celeba", shape)
            log(f"  {report['data']}")
        if "product" not in args.skip:
            run_products(report, shape, args, work, executor, device)
        if "bare" not in args.skip:
            log("bare PyTorch/timm step")
            autocast = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "off"
            report["bare"] = run_bare(shape, device, max(shape.steps, 5), autocast)
            log(f"  {report['bare']}")
            for product in report.get("products", []):
                hoc = [t for t in product.get("tasks", []) if t["task"] == 1]
                if hoc and hoc[0].get("images_per_s"):
                    product["product_over_bare"] = hoc[0]["images_per_s"] / report["bare"]["images_per_s"]
        if "decode" not in args.skip:
            log("JPEG decode: one CPU worker, the GPU decoder, workers needed per GPU")
            eager = [p for p in report.get("products", []) if p.get("variant") == "eager" and p.get("tasks")]
            hoc = [t for t in (eager[0]["tasks"] if eager else []) if t["task"] == 1]
            report["decode"] = run_decode(shape, work / "celeba", device, hoc[0].get("images_per_s") if hoc else None,
                                          report.get("bare", {}).get("images_per_s"))
            log(f"  {report['decode']}")
    if "entry" not in args.skip:
        log("one matrix entry at CelebA's shape")
        report["entry"] = run_entry(shape, device)
        log(f"  {report['entry']}")
    if "workers" not in args.skip:
        log("input workers per task against persistent workers, each with and without the first batches prefetched")
        report["workers"] = run_workers(shape, 1 if args.smoke else 3)
        log(f"  {report['workers']}")
    if "layout" not in args.skip:
        log("channels_last: the layout probe on a convolutional backbone")
        report["channels_last"] = run_layout(shape, device)
        log(f"  {report['channels_last']}")
    report["seconds"] = time.perf_counter() - started
    (out / "real_job.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "real_job.md").write_text(markdown(report))
    print(markdown(report))
    log(f"done in {report['seconds']:.0f} s; {out / 'real_job.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Input pipeline at 224 px from CelebA-format JPEGs: today's reader against ingested shards + streaming decode.

Makes ``--images`` synthetic faces-sized JPEGs (178x218, the published aligned size) in the published CelebA
layout, ingests them (``compat ingest``, row groups of ``--row-group-mb``), then measures in one run, the cases
interleaved within each of ``--repeats`` rounds (medians), in the training read pattern (one shuffled epoch order,
batches of ``--batch``):

- today: ``load_dataset("celeba")`` -> ``EncodedImageSource.read`` (PIL decode + fit, one image at a time) on one
  thread pinned to one core;
- new: what ``pipelines.training.loop.train_task`` runs: ``keep_rows`` (the task's rows read once per row group) then
  ``compat_core.data.stream.stream_batches`` with the torchvision decoder and 0 (in-thread), 1 and 2 worker
  processes, from a local folder and from SeaweedFS over S3 (``--s3``). CPU isolation: with N CPUs the whole
  process tree is confined to N cores (``os.sched_setaffinity``), decode worker i pinned to core i, one torch
  thread per process. Rates are steady state (after the first batch; the epoch's start-up, i.e. forking the
  workers + ``keep_rows``, is printed apart: it is paid once per epoch);
- the LRU-only read (no ``keep_rows``) of the same shuffled order, in-thread: what ``keep_rows`` avoids;
- overlap, as the training loop runs it: 1 decode worker pinned to core 0, the step on core 1, with (a) an
  accelerator stand-in: a GIL-free wait of the GPU step's length (``time.sleep``: a CUDA step leaves the host CPU
  free), at an H100's 1,200 images/s and at exactly the measured decode time per batch (the hardest case), and
  (b) a real CPU model step (one torch thread) of calibrated cost. Prints step / max(decode, compute) and
  step / (decode + compute);
- Ray Data (``--ray``): ``read_parquet`` + ``map_batches`` decode + ``iter_torch_batches`` over the same parts.

Prints images/s, ratios to the baseline measured in the same run, and the load average. Usage::

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.input_pipeline --images 2048 --repeats 3 --s3
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def make_celeba(root: Path, count: int, seed: int = 0, noise: float = 4.0) -> Path:
    """``count`` 178x218 JPEGs (smooth random faces-like blobs plus Gaussian pixel noise of std ``noise``, quality
    90) in the published CelebA layout. The noise sets the entropy, i.e. the file size and the decode cost: 4 gives
    ~6.8 KB per file, the published aligned CelebA's average (img_align_celeba: ~1.4 GB / 202,599 files);
    12 gives ~15 KB."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    folder = root / "img_align_celeba"
    folder.mkdir(parents=True, exist_ok=True)
    identity, partition = [], []
    yy, xx = np.mgrid[0:218, 0:178]
    for i in range(count):
        base = rng.integers(40, 220, size=3)
        cy, cx = rng.integers(60, 160), rng.integers(50, 130)
        blob = np.exp(-(((yy - cy) / 45.0) ** 2 + ((xx - cx) / 35.0) ** 2))[..., None]
        grain = rng.normal(0, noise, size=(218, 178, 3))
        pixels = np.clip(base * (0.4 + 0.6 * blob) + grain, 0, 255).astype(np.uint8)
        name = f"{i + 1:06d}.jpg"
        Image.fromarray(pixels).save(folder / name, format="JPEG", quality=90)
        identity.append(f"{name} {i // 8 + 1}")
        partition.append(f"{name} 0")
    (root / "identity_CelebA.txt").write_text("\n".join(identity) + "\n")
    (root / "list_eval_partition.txt").write_text("\n".join(partition) + "\n")
    return root


def batches_of(count: int, batch: int) -> list[np.ndarray]:
    return [np.arange(s, min(s + batch, count)) for s in range(0, count, batch)]


class PinnedReads:
    """``source`` read by DataLoader worker i pinned to core ``cores[i]`` (so that a worker is one CPU); in the
    calling process it reads on the process's own cores. Each read's wall time lands in ``seconds`` (shared
    memory, slot = worker id * stride + the worker's read count), so the decode time per batch is known from the
    same run as the step it overlaps with."""

    stride = 100_000

    def __init__(self, source, cores: list[int]) -> None:
        self.source, self.cores, self._pinned, self._count = source, list(cores), False, 0
        self.image_shape = source.image_shape
        self.seconds = torch.full((len(self.cores) * self.stride,), float("nan"), dtype=torch.float64)
        self.seconds.share_memory_()

    def __len__(self) -> int:
        return len(self.source)

    def read(self, indices: np.ndarray) -> np.ndarray:
        info = torch.utils.data.get_worker_info()
        worker = 0 if info is None else info.id % len(self.cores)
        if info is not None and not self._pinned:
            os.sched_setaffinity(0, {self.cores[worker]})
            self._pinned = True
        started = time.perf_counter()
        images = self.source.read(indices)
        self.seconds[worker * self.stride + self._count] = time.perf_counter() - started
        self._count += 1
        return images

    def decode_s(self) -> float:
        """Median seconds per batch read, the first read of each worker left out (its cold start)."""
        values = [v for w in range(len(self.cores))
                  for v in self.seconds[w * self.stride + 1 : (w + 1) * self.stride].tolist() if v == v]
        return statistics.median(values) if values else float("nan")


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and of its reaped children (the input workers of finished
    epochs). Images per CPU second does not depend on other programs' load the way images per wall second does."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


class Pinned:
    """Context: this process (and what it forks) confined to ``cores``, one torch thread; restored on exit."""

    def __init__(self, cores: list[int]) -> None:
        self.cores = set(cores)

    def __enter__(self):
        self.saved, self.threads = os.sched_getaffinity(0), torch.get_num_threads()
        os.sched_setaffinity(0, self.cores)
        torch.set_num_threads(1)
        return self

    def __exit__(self, *exc) -> None:
        os.sched_setaffinity(0, self.saved)
        torch.set_num_threads(self.threads)


def epoch_pass(source, order: np.ndarray, batch: int, workers: int, cores: list[int], step=None) -> dict:
    """One epoch as ``train_task`` reads it: ``keep_rows`` then ``stream_batches`` over ``order`` in batches,
    ``step(images)`` after each batch (None: none). Process tree on ``cores``, worker i on ``cores[i]``.
    Returns start-up seconds (to the first batch), steady images/s and seconds per step after the first batch."""
    from compat_core.data.stream import keep_rows, stream_batches

    with Pinned(cores):
        cpu = cpu_seconds()
        started = time.perf_counter()
        keep_rows(source, order)
        reads = PinnedReads(source, cores[: max(workers, 1)])
        stream = stream_batches(reads, order, batches_of(order.size, batch), workers=workers, prefetch=2)
        first, first_rows, steps, computes, waits = None, 0, 0, [], []
        mark = time.perf_counter()
        for positions, images in stream:
            arrived = time.perf_counter()
            if step is not None:
                step(images)
            if first is None:
                first, first_rows = time.perf_counter(), positions.size
            else:
                steps += 1
                waits.append(arrived - mark)
                computes.append(time.perf_counter() - arrived)
            mark = time.perf_counter()
        if hasattr(step, "drain"):
            step.drain()  # the queued accelerator steps finish before the epoch counts as done
        done = time.perf_counter()
        del stream  # the workers are shut down and reaped: their CPU time is counted
        cpu = cpu_seconds() - cpu
    if getattr(step, "durations", None):
        computes = step.durations[1:]  # the step's own lengths (an async stand-in's calls only queue it)
    return {"startup_s": first - started, "rate": (order.size - first_rows) / (done - first),
            "cpu_rate": order.size / cpu,
            "step_s": (done - first) / max(steps, 1), "decode_s": reads.decode_s(),
            "compute_s": statistics.median(computes) if computes else float("nan"),
            "wait_s": statistics.median(waits) if waits else float("nan")}


def today_pass(source, order: np.ndarray, batch: int, cores: list[int]) -> dict:
    """Today's reader (``source.read`` of each batch in the training thread) on ``cores[:1]``."""
    with Pinned(cores[:1]):
        cpu = cpu_seconds()
        started = time.perf_counter()
        for positions in batches_of(order.size, batch):
            source.read(order[positions])
        return {"rate": order.size / (time.perf_counter() - started), "cpu_rate": order.size / (cpu_seconds() - cpu)}


def lru_pass(source, order: np.ndarray, batch: int, cores: list[int]) -> dict:
    """The shuffled order read through the row-group LRU alone (no ``keep_rows``), in-thread on ``cores[:1]``."""
    source.keep_rows(np.array([], dtype=np.int64))
    source._groups.clear()
    return today_pass(source, order, batch, cores)


class AcceleratorStandIn:
    """An accelerator step of ``seconds`` that leaves the host free, as a CUDA step does: ``step(images)`` queues
    it on a device thread (a GIL-free ``time.sleep``) and returns; the host blocks only when ``depth`` steps are
    queued (a bounded launch queue; the training loop reads no loss per step, so nothing else syncs).
    ``depth=0``: the step blocks the host for its whole length (a step that ends in a host sync)."""

    def __init__(self, seconds: float, depth: int = 2) -> None:
        import queue
        import threading

        self.seconds, self.depth = seconds, depth
        if depth:
            self.queue: queue.Queue = queue.Queue(maxsize=depth)
            self.thread = threading.Thread(target=self._device, daemon=True)
            self.thread.start()

        self.durations: list[float] = []  # each step's own length as it ran (a sleep wakes late on a busy core)

    def _device(self) -> None:
        while (seconds := self.queue.get()) is not None:
            started = time.perf_counter()
            time.sleep(seconds)
            self.durations.append(time.perf_counter() - started)
            self.queue.task_done()

    def __call__(self, images: torch.Tensor) -> None:
        if self.depth:
            self.queue.put(self.seconds)
        else:
            started = time.perf_counter()
            time.sleep(self.seconds)
            self.durations.append(time.perf_counter() - started)

    def drain(self) -> None:
        """Wait for the queued steps, then end the device thread."""
        if self.depth:
            self.queue.join()
            self.queue.put(None)
            self.thread.join()


def cpu_model(batch: int, size: int = 224):
    """A small conv net's training step on uint8 ``(n, H, W, C)`` batches (one torch thread): stands for a CPU
    training step of known cost (calibrated in the run)."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 5, stride=4), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    targets = torch.zeros(batch, dtype=torch.long)

    def step(images: torch.Tensor) -> None:
        x = images.permute(0, 3, 1, 2).float().div_(255.0)
        loss = nn.functional.cross_entropy(model(x), targets[: x.shape[0]])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def load_average() -> str:
    return "load average " + " ".join(f"{v:.2f}" for v in os.getloadavg())


class _RayDecode:
    """Ray Data UDF on CPU actors: encoded rows -> uint8 (n, size, size, 3) with the torchvision decoder (the
    actors import torch/torchvision once, not per task)."""

    def __init__(self, size: int) -> None:
        import torch

        from compat_core.data.encoded import decode_batch

        torch.set_num_threads(1)
        self.size, self.decode = size, decode_batch

    def __call__(self, rows: dict) -> dict:
        return {"image": self.decode(list(rows["image"]), self.size, "ray data")}


def ray_data_rate(folder: Path, count: int, batch: int, cpus: int, repeats: int, size: int = 224
                  ) -> tuple[float, float]:
    """(images/s of a whole pass, images/s after the first batch) of Ray Data over the same ingested parts:
    ``read_parquet`` -> ``map_batches`` (torchvision decode on ``cpus`` CPU actors) -> ``iter_torch_batches`` with
    2 batches prefetched, order preserved, on a local Ray started with ``cpus`` + 1 logical CPUs (the extra one for
    the read tasks) and a 200 MB object store.
    A pass starts its actors (an epoch of a training job does too); the second figure leaves that start out."""
    import ray

    # cpus decode actors plus one logical CPU for Ray Data's file listing and Parquet read tasks (with none left
    # they starve behind the actors); the DataLoader's workers do their reads on their own CPU
    ray.init(address="local", num_cpus=cpus + 1, object_store_memory=200 * 2**20, include_dashboard=False,
             log_to_driver=False,
             configure_logging=False)
    try:
        context = ray.data.DataContext.get_current()
        context.execution_options.preserve_order = True       # deterministic order, as the DataLoader path
        context.enable_progress_bars = False
        paths = sorted(str(p) for p in folder.glob("*.parquet"))
        whole, steady = [], []
        for _ in range(repeats + 1):                           # the first pass is a warm-up (code shipped)
            # a part is one ~32 MB row group, i.e. one read block: split it into batch-sized blocks so the decode
            # actors work in parallel and hand batches on as they finish (override_num_blocks cannot split a group)
            dataset = ray.data.read_parquet(paths).select_columns(["image"]) \
                .repartition(max(2, -(-count // batch))) \
                .map_batches(_RayDecode, fn_constructor_args=(size,), batch_size=batch, batch_format="numpy",
                             num_cpus=1, compute=ray.data.ActorPoolStrategy(size=cpus))
            started = time.perf_counter()
            first, first_rows = None, 0
            for images in dataset.iter_torch_batches(batch_size=batch, prefetch_batches=2):
                if first is None:
                    first, first_rows = time.perf_counter(), len(images["image"])
            done = time.perf_counter()
            whole.append(count / (done - started))
            steady.append((count - first_rows) / max(done - first, 1e-9))
        return statistics.median(whole[1:]), statistics.median(steady[1:])
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--row-group-mb", type=float, default=1.0,
                        help="ingest row-group size (the product default is 32 MB; CelebA's split is ~50 such "
                        "groups, more than the reader's LRU of 4: 1 MB gives this benchmark's few thousand images "
                        "the same situation)")
    parser.add_argument("--noise", type=float, default=4.0, help="pixel noise std of the synthetic JPEGs (4: ~6.8 "
                        "KB per file, CelebA's average; 12: ~15 KB)")
    parser.add_argument("--accelerator-rate", type=float, default=1200.0,
                        help="images/s of the accelerator the stand-in step simulates (H100, ViT-B/16, bf16)")
    parser.add_argument("--s3", action="store_true", help="also ingest to and read from a local SeaweedFS over S3")
    parser.add_argument("--ray", action="store_true", help="also measure Ray Data (read_parquet + map_batches + "
                        "iter_torch_batches) on the local shards with 1 and 2 CPUs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(f"needs 2 cores for the 1 -> 2 CPU and overlap cases, this process may use {cores}")
    one, two = cores[:1], cores[:2]
    print(f"start: {load_average()}; cores used: {two} (of {cores})")

    from cluster.storage.ingest import ingest
    from compat_core.data.datasets import load_dataset

    with tempfile.TemporaryDirectory(prefix="bench-input-") as tmp:
        tmp = Path(tmp)
        root = make_celeba(tmp / "celeba", args.images, noise=args.noise)
        files = list((root / "img_align_celeba").glob("*.jpg"))
        print(f"{len(files)} JPEGs of 178x218, {sum(f.stat().st_size for f in files) / len(files) / 1e3:.1f} KB "
              f"each on average (noise {args.noise:g})")
        n, b, r = args.images, args.batch, args.repeats
        order = np.random.default_rng(0).permutation(n)  # one shuffled training epoch
        group_bytes = int(args.row_group_mb * 2**20)
        today = load_dataset("celeba", root=str(root), split="train", image_size=224, cache_size=0)
        ingest("celeba", str(root), "train", str(tmp / "shards"), options={"image_size": 224}, workers=0,
               row_group_bytes=group_bytes, progress=None)
        locations = {"local": str(tmp / "shards")}
        server = None
        if args.s3:
            import sys

            import boto3

            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the suite's server fixture
            from local_services import SeaweedS3Server

            server = SeaweedS3Server(tmp / "weed")
            server.start()
            os.environ.update(server.environment())
            boto3.client("s3").create_bucket(Bucket="bench")
            ingest("celeba", str(root), "train", "s3://bench/shards", options={"image_size": 224}, workers=0,
                   row_group_bytes=group_bytes, progress=None)
            locations["s3"] = "s3://bench/shards"
        try:
            sources = {where: load_dataset("shards", root=location, split="train", decoder="torchvision",
                                           verify="size") for where, location in locations.items()}
            groups = sum(p.row_groups for p in sources["local"].manifest.parts)
            print(f"{n} images, {groups} row groups of ~{args.row_group_mb:g} MB, batch {b}, {r} rounds")
            cases = {"today": lambda: today_pass(today, order, b, two),
                     "lru": lambda: lru_pass(sources["local"], order, b, two)}
            for where, source in sources.items():
                for workers, on in ((0, one), (1, one), (2, two)):
                    cases[(where, workers)] = (lambda s=source, w=workers, c=on: epoch_pass(s, order, b, w, c))
            # one decode worker on core 0 and the training process on core 1, as on a GPU node (where the training
            # process has a core of its own): the rate of one decode CPU
            cases[("local", "1+1")] = lambda: epoch_pass(sources["local"], order, b, 1, two,
                                                         step=_OnCore(cores[1], lambda images: None))
            runs: dict = {name: [] for name in cases}
            for _ in range(r):  # interleaved: every case sees the same spells of load
                for name, case in cases.items():
                    runs[name].append(case())
            baseline = median_of(runs["today"], "rate")
            baseline_cpu = median_of(runs["today"], "cpu_rate")
            print(f"today's reader (PIL, 1 thread, 1 core): {baseline:.0f} images/s, {baseline_cpu:.0f} images per "
                  f"CPU-second")
            lru = median_of(runs["lru"], "rate")
            for where in sources:
                for workers in (0, 1, 2):
                    value = median_of(runs[(where, workers)], "rate")
                    startup = median_of(runs[(where, workers)], "startup_s")
                    cpus = max(workers, 1)
                    per_cpu_s = median_of(runs[(where, workers)], "cpu_rate")
                    print(f"shards {where}, keep_rows + torchvision decode, {workers} worker(s) on {cpus} core(s): "
                          f"{value:.0f} images/s = {value / baseline:.2f}x today, {value / cpus / baseline:.2f}x "
                          f"per CPU (epoch start-up {startup:.2f} s); {per_cpu_s:.0f} images per CPU-second = "
                          f"{per_cpu_s / baseline_cpu:.2f}x today's")
            decode_cpu = median_of(runs[("local", "1+1")], "rate")
            print(f"shards local, 1 worker on core {cores[0]}, the training process on core {cores[1]}: "
                  f"{decode_cpu:.0f} images/s per decode CPU = {decode_cpu / baseline:.2f}x today")
            local0 = median_of(runs[("local", 0)], "rate")
            local1, local2 = median_of(runs[("local", 1)], "rate"), median_of(runs[("local", 2)], "rate")
            print(f"shuffled order through the row-group LRU only (no keep_rows), in-thread: {lru:.0f} images/s = "
                  f"{lru / local0:.2f}x the same with keep_rows")
            print(f"per CPU vs today (target >= 2.5x): in-thread {local0 / baseline:.2f}x, 1 worker + the training "
                  f"process on 1 core {local1 / baseline:.2f}x, 1 worker per decode CPU {decode_cpu / baseline:.2f}x")
            print(f"1 -> 2 CPUs (1 worker on 1 core -> 2 workers on 2 cores): {local2 / local1:.2f}x (target >= 1.8x); "
                  f"images per CPU-second 2 workers / 1 worker: "
                  f"{median_of(runs[('local', 2)], 'cpu_rate') / median_of(runs[('local', 1)], 'cpu_rate'):.2f} "
                  f"(1.00 = no cost of the second worker: 2x on two free cores)")
            if "s3" in sources:
                for workers in (1, 2):
                    s3 = median_of(runs[("s3", workers)], "rate")
                    local = median_of(runs[("local", workers)], "rate")
                    print(f"local / S3 with {workers} worker(s): {local / s3:.2f} (target <= 1.3)")
            print(f"CPUs per H100 stage at {args.accelerator_rate:,.0f} images/s: "
                  f"{args.accelerator_rate / decode_cpu:.2f} decode CPUs at {decode_cpu:.0f} images/s per decode CPU "
                  f"(i.e. {int(np.ceil(args.accelerator_rate / decode_cpu))} input worker(s)) + 1 core for the "
                  f"training process; {args.accelerator_rate / (local2 / 2):.2f} CPUs in all at the 2-worker rate "
                  f"per core ({local2 / 2:.0f} images/s)")

            # ---- overlap: 1 decode worker on core 0, the step on core 1 (where the training process runs)
            shards = sources["local"]
            decode_s = b / decode_cpu  # a batch per worker cycle, measured above with the worker on its own core
            model_step = cpu_model(b)
            sample = torch.from_numpy(shards.read(order[:b]))
            with Pinned(cores[1:2]):
                for _ in range(3):
                    model_step(sample)
                started = time.perf_counter()
                for _ in range(10):
                    model_step(sample)
                model_s = (time.perf_counter() - started) / 10
            gpu_s = b / args.accelerator_rate
            steps = {f"accelerator stand-in at {args.accelerator_rate:,.0f} images/s, async (queue of 2)":
                     (gpu_s, lambda: AcceleratorStandIn(gpu_s, depth=2)),
                     "accelerator stand-in = decode time, async (queue of 2)":
                     (decode_s, lambda: AcceleratorStandIn(decode_s, depth=2)),
                     f"accelerator stand-in at {args.accelerator_rate:,.0f} images/s, blocking the host":
                     (gpu_s, lambda: AcceleratorStandIn(gpu_s, depth=0)),
                     "accelerator stand-in = decode time, blocking the host":
                     (decode_s, lambda: AcceleratorStandIn(decode_s, depth=0)),
                     "CPU model step (1 thread)": (model_s, lambda: model_step)}
            overlap_runs: dict = {name: [] for name in steps}
            for _ in range(r):
                for name, (compute_s, make_step) in steps.items():
                    overlap_runs[name].append(epoch_pass(shards, order, b, 1, [cores[0], cores[1]],
                                                         step=_OnCore(cores[1], make_step())))
            print(f"CPU model step alone on core {cores[1]}: {model_s * 1e3:.1f} ms per batch of {b}")
            for name, (compute_s, _) in steps.items():
                step_s = median_of(overlap_runs[name], "step_s")
                # decode and compute as they ran in this same overlapped pass: the worker's read time per batch,
                # the step's own time (a sleep wakes late on a loaded core); the wait is the loop's time in next()
                decode_in_run = median_of(overlap_runs[name], "decode_s")
                compute_in_run = median_of(overlap_runs[name], "compute_s")
                wait = median_of(overlap_runs[name], "wait_s")
                high, total = max(decode_in_run, compute_in_run), decode_in_run + compute_in_run
                delivered = max(decode_s, compute_in_run)  # the worker's whole cycle: read + hand-over to the loop
                print(f"overlap, {name}: decode {decode_in_run * 1e3:.1f} ms/batch in the worker during the pass "
                      f"({decode_s * 1e3:.1f} per batch delivered by 1 worker on its own core), compute "
                      f"{compute_in_run * 1e3:.1f} ms (nominal {compute_s * 1e3:.1f}) -> step {step_s * 1e3:.1f} ms "
                      f"(wait for the batch {wait * 1e3:.1f}) = {step_s / high:.3f} x max(decode, compute), "
                      f"{step_s / total:.3f} x (decode + compute); {step_s / delivered:.3f} x max(delivered, "
                      f"compute)")
            if args.ray:
                for cpus in (1, 2):
                    value, steady = ray_data_rate(tmp / "shards" / "train", n, b, cpus, r)
                    print(f"Ray Data local, {cpus} CPU actor(s): {value:.0f} images/s per pass "
                          f"({steady:.0f} after the first batch) = {value / baseline:.2f}x today, "
                          f"{value / median_of(runs[('local', cpus)], 'rate'):.2f}x the DataLoader with {cpus} "
                          f"worker(s)")
        finally:
            if server is not None:
                server.stop()
    print(f"end: {load_average()}")


class _OnCore:
    """``step`` run by the calling (training) thread pinned to ``core`` from its first call on (the input workers
    were forked before, on their own cores); ``drain`` and ``durations`` pass through."""

    def __init__(self, core: int, step) -> None:
        self.core, self.step, self.pinned = core, step, False
        self.durations = getattr(step, "durations", None)
        if hasattr(step, "drain"):
            self.drain = step.drain

    def __call__(self, images: torch.Tensor) -> None:
        if not self.pinned:
            os.sched_setaffinity(0, {self.core})
            self.pinned = True
        self.step(images)


if __name__ == "__main__":
    main()

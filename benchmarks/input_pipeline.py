"""Input pipeline at 224 px from CelebA-format JPEGs: today's reader against ingested shards + streaming decode.

Makes ``--images`` synthetic faces-sized JPEGs (178x218, the published aligned size) in the published CelebA
layout, then measures in one run (medians of ``--repeats``):

- today: ``load_dataset("celeba")`` -> ``EncodedImageSource.read`` (PIL decode + fit, one image at a time), 1 thread;
- new: ``compat ingest`` shards read by ``compat_core.data.stream.stream_batches`` with the torchvision decoder,
  0 (in-thread), 1 and 2 worker processes, from a local folder and from SeaweedFS over S3 (``--s3``);
- Ray Data (``--ray``): ``read_parquet`` + ``map_batches`` decode + ``iter_torch_batches`` over the same parts;
- overlap: a training step of known cost (``time.sleep``, standing for an accelerator step) fed by 1 worker:
  measured step time against max(decode, compute) and decode + compute.

Prints images/s and ratios to the baseline measured in the same run. Usage::

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.input_pipeline --images 768 --repeats 3 --s3 --ray
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def make_celeba(root: Path, count: int, seed: int = 0) -> Path:
    """``count`` 178x218 JPEGs (smooth random faces-like blobs, quality 90) in the published CelebA layout."""
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
        noise = rng.normal(0, 12, size=(218, 178, 3))
        pixels = np.clip(base * (0.4 + 0.6 * blob) + noise, 0, 255).astype(np.uint8)
        name = f"{i + 1:06d}.jpg"
        Image.fromarray(pixels).save(folder / name, format="JPEG", quality=90)
        identity.append(f"{name} {i // 8 + 1}")
        partition.append(f"{name} 0")
    (root / "identity_CelebA.txt").write_text("\n".join(identity) + "\n")
    (root / "list_eval_partition.txt").write_text("\n".join(partition) + "\n")
    return root


def batches_of(count: int, batch: int) -> list[np.ndarray]:
    return [np.arange(s, min(s + batch, count)) for s in range(0, count, batch)]


def rate(run, count: int, repeats: int) -> float:
    """Median images/s of ``repeats`` calls of ``run()`` (each delivers ``count`` images)."""
    values = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        values.append(count / (time.perf_counter() - started))
    return statistics.median(values)


def stream_rate(source, count: int, batch: int, workers: int, repeats: int) -> float:
    from compat_core.data.stream import stream_batches

    def run():
        for _ in stream_batches(source, np.arange(count), batches_of(count, batch), workers=workers, prefetch=2):
            pass

    return rate(run, count, repeats)


def overlap(source, count: int, batch: int, compute_s: float, repeats: int) -> float:
    """Median seconds per step with 1 decode worker and a step that takes ``compute_s``."""
    from compat_core.data.stream import stream_batches

    values = []
    for _ in range(repeats):
        steps = 0
        started = time.perf_counter()
        for _ in stream_batches(source, np.arange(count), batches_of(count, batch), workers=1, prefetch=2):
            time.sleep(compute_s)
            steps += 1
        values.append((time.perf_counter() - started) / steps)
    return statistics.median(values)


class _RayDecode:
    """Ray Data UDF on CPU actors: encoded rows -> uint8 (n, size, size, 3) with the torchvision decoder (the
    actors import torch/torchvision once, not per task)."""

    def __init__(self, size: int) -> None:
        import torch

        from compat_core.data.formats.shards import decode_batch

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
    parser.add_argument("--images", type=int, default=768)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--s3", action="store_true", help="also ingest to and read from a local SeaweedFS over S3")
    parser.add_argument("--ray", action="store_true", help="also measure Ray Data (read_parquet + map_batches + "
                        "iter_torch_batches) on the local shards with 1 and 2 CPUs")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from cluster.ingest import ingest
    from compat_core.data.registry import load_dataset

    with tempfile.TemporaryDirectory(prefix="bench-input-") as tmp:
        tmp = Path(tmp)
        root = make_celeba(tmp / "celeba", args.images)
        n, b, r = args.images, args.batch, args.repeats
        today = load_dataset("celeba", root=str(root), split="train", image_size=224, cache_size=0)
        baseline = rate(lambda: [today.read(p) for p in batches_of(n, b)], n, r)
        print(f"today's reader (PIL, 1 thread): {baseline:.0f} images/s")

        ingest("celeba", str(root), "train", str(tmp / "shards"), options={"image_size": 224}, workers=0,
               progress=None)
        locations = {"local": str(tmp / "shards")}
        server = None
        if args.s3:
            import boto3

            import os
            import sys

            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the suite's server fixture
            from local_services import SeaweedS3Server

            server = SeaweedS3Server(tmp / "weed")
            server.start()
            os.environ.update(server.environment())
            boto3.client("s3").create_bucket(Bucket="bench")
            ingest("celeba", str(root), "train", "s3://bench/shards", options={"image_size": 224}, workers=0,
                   progress=None)
            locations["s3"] = "s3://bench/shards"
        try:
            results = {}
            for where, location in locations.items():
                shards = load_dataset("shards", root=location, split="train", decoder="torchvision", verify="size")
                for workers in (0, 1, 2):
                    results[(where, workers)] = stream_rate(shards, n, b, workers, r)
                    print(f"shards {where}, torchvision decode, {workers} worker(s): "
                          f"{results[(where, workers)]:.0f} images/s = {results[(where, workers)] / baseline:.2f}x today")
            local1, local2 = results[("local", 1)], results[("local", 2)]
            print(f"per CPU (1 worker) vs today: {local1 / baseline:.2f}x (target >= 2.5x)")
            print(f"1 -> 2 workers: {local2 / local1:.2f}x (target >= 1.8x)")
            if ("s3", 2) in results:
                print(f"local / S3 with 2 workers: {local2 / results[('s3', 2)]:.2f} (target <= 1.3)")
            shards = load_dataset("shards", root=locations["local"], split="train", decoder="torchvision",
                                  verify="size")
            decode_s = b / results[("local", 0)]
            compute_s = decode_s  # the hardest case: compute and decode equally long
            step = overlap(shards, n, b, compute_s, r)
            print(f"overlap: decode {decode_s * 1e3:.0f} ms/batch, compute {compute_s * 1e3:.0f} ms/step -> step "
                  f"{step * 1e3:.0f} ms (max {max(decode_s, compute_s) * 1e3:.0f}, sum {(decode_s + compute_s) * 1e3:.0f})")
            print(f"CPUs (decode workers) per H100 at 1,200 images/s: {1200 / local1:.1f} at {local1:.0f} "
                  f"images/s per worker")
            if args.ray:
                for cpus in (1, 2):
                    value, steady = ray_data_rate(tmp / "shards" / "train", n, b, cpus, r)
                    print(f"Ray Data local, {cpus} CPU actor(s): {value:.0f} images/s per pass "
                          f"({steady:.0f} after the first batch) = {value / baseline:.2f}x today, "
                          f"{value / results[('local', cpus)]:.2f}x the DataLoader with {cpus} worker(s)")
        finally:
            if server is not None:
                server.stop()


if __name__ == "__main__":
    main()

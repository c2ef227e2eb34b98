"""Published CelebA JPEGs read straight from ``s3://`` (a local SeaweedFS): one GET at a time against a bounded pool of
GETs in flight per process (``EncodedImageSource.fetch_threads``), the same batches interleaved.

    python benchmarks/s3_image_reads.py [--images 640] [--batch 320] [--rounds 3] [--threads 1 4 16]

Loopback S3 answers a GET in about a millisecond; a real bucket takes tens of milliseconds per GET, so the gain here
is a lower bound of what a cloud bucket sees (the pool hides latency, it does not add decode CPU).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
# the script's folder after the packages: benchmarks/cluster.py must not shadow the cluster package
sys.path[:] = [str(HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE] + [str(HERE)]
sys.path.append(str(HERE.parent / "tests"))  # the suite's SeaweedFS server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=640)
    parser.add_argument("--batch", type=int, default=320)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()

    import boto3
    from input_pipeline import make_celeba
    from local_services import SeaweedS3Server

    from cluster.storage.s3 import configure_object_storage
    from compat_core import io as cio
    from compat_core.data.datasets import load_dataset

    with tempfile.TemporaryDirectory(prefix="bench-s3-reads-") as tmp:
        tmp = Path(tmp)
        root = make_celeba(tmp / "celeba", args.images)
        server = SeaweedS3Server(tmp / "weed").start()
        try:
            os.environ.update(server.environment())
            configure_object_storage()
            boto3.client("s3").create_bucket(Bucket="bench")
            for path in sorted(p for p in root.rglob("*") if p.is_file()):
                cio.write_bytes(f"s3://bench/celeba/{path.relative_to(root).as_posix()}", path.read_bytes())
            sources = {}
            for n in args.threads:
                sources[n] = load_dataset("celeba", root="s3://bench/celeba", split="train", image_size=224,
                                          cache_size=0)
                sources[n].fetch_threads = n  # the pool's bound (the reader's default for s3:// is 16)
            order = np.random.default_rng(0).permutation(len(sources[args.threads[0]]))
            batches = [order[i: i + args.batch] for i in range(0, order.size, args.batch)]
            seconds: dict[int, list[float]] = {n: [] for n in args.threads}
            fetch_only: dict[int, list[float]] = {n: [] for n in args.threads}
            for _ in range(args.rounds):  # interleaved: every setting sees the same spells of load
                for n, source in sources.items():
                    started = time.perf_counter()
                    for batch in batches:
                        source.read(batch)
                    seconds[n].append(time.perf_counter() - started)
                    started = time.perf_counter()
                    for batch in batches:  # the GETs alone (what a remote bucket's latency multiplies)
                        source._fetch_all([source.locations[int(i)] for i in batch])
                    fetch_only[n].append(time.perf_counter() - started)
            print(f"{order.size} JPEGs (178x218), batch {args.batch}, decoded to 224 px; load "
                  f"{open('/proc/loadavg').read().split()[:3]}; {os.cpu_count()} CPUs")
            base = statistics.median(seconds[args.threads[0]])
            base_get = statistics.median(fetch_only[args.threads[0]])
            print("| GETs in flight | read + decode images/s (median) | vs 1 | GETs only images/s | vs 1 |")
            print("| --- | --- | --- | --- | --- |")
            for n in args.threads:
                value, get = statistics.median(seconds[n]), statistics.median(fetch_only[n])
                print(f"| {n} | {order.size / value:.0f} | {base / value:.2f}x | {order.size / get:.0f} | "
                      f"{base_get / get:.2f}x |")
        finally:
            server.stop()


if __name__ == "__main__":
    main()

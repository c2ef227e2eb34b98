"""Replay shard image encoding: bytes per exemplar and write/read seconds, raw pixels (zstd) against encoded files.

Two cases, each written and read back with ``compat_core.data.replay_parquet`` (the product's shard code):
- array sources (CIFAR pickles, glyphs: 32 px RGB, no published files): raw uint8 rows against PNG-encoding them;
- encoded sources (CelebA-format JPEG, 218x178 decoded to 224 px): the decoded pixels (what shards held before)
  against the original JPEG bytes (what they hold now), decoded on read.
Images are synthetic but image-like (smooth gradients + blobs + mild noise; random noise would flatter neither
codec). Prints the medians of ``--repeats``. Usage::

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.replay_encoding --rows 2000
"""
from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def _images(rows: int, height: int, width: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    out = np.empty((rows, height, width, 3), dtype=np.uint8)
    for r in range(rows):
        base = rng.uniform(0, 255, 3) * (0.5 + 0.5 * np.sin(x[..., None] / rng.uniform(4, 20) + rng.uniform(0, 6)))
        cy, cx, radius = rng.uniform(0, height), rng.uniform(0, width), rng.uniform(height / 8, height / 3)
        blob = ((y - cy) ** 2 + (x - cx) ** 2 < radius ** 2)[..., None] * rng.uniform(-80, 80, 3)
        out[r] = np.clip(base + blob + rng.normal(0, 6, (height, width, 3)), 0, 255).astype(np.uint8)
    return out


def _encode(images: np.ndarray, fmt: str) -> list[bytes]:
    from PIL import Image

    blobs = []
    for image in images:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        blobs.append(buffer.getvalue())
    return blobs


def _measure(folder: Path, name: str, memory, images, repeats: int, batch: int) -> dict:
    from compat_core.data.replay_parquet import read_replay_shard, write_replay_shard

    writes, reads = [], []
    for repeat in range(repeats):
        root = str(folder / f"{name}-{repeat}")
        started = time.perf_counter()
        manifest = write_replay_shard(root, 0, memory, images)
        writes.append(time.perf_counter() - started)
        started = time.perf_counter()
        shard = read_replay_shard(root, 0)
        for start in range(0, len(memory), batch):  # what training does: index a batch of rows at a time
            shard.images[np.arange(start, min(start + batch, len(memory)))]
        reads.append(time.perf_counter() - started)
    return {"bytes": manifest.size / len(memory), "write": statistics.median(writes),
            "read": statistics.median(reads)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    from compat_core.data.encoded import EncodedImages, decode_image
    from compat_core.data.replay import ReplayMemory

    rows = args.rows
    memory = ReplayMemory(indices=np.arange(rows), labels=np.arange(rows) % 100, slots=np.arange(rows) % 100,
                          source_task=np.zeros(rows, np.int64))
    cifar = _images(rows, 32, 32, 0)
    celeba_files = _encode(_images(rows, 218, 178, 1), "JPEG")
    celeba_pixels = np.stack([decode_image(blob, 224, "bench") for blob in celeba_files])
    started = time.perf_counter()
    cifar_png = _encode(cifar, "PNG")
    png_encode = time.perf_counter() - started
    with tempfile.TemporaryDirectory(prefix="replay-encoding-") as folder:
        results = {
            "cifar 32px raw": _measure(Path(folder), "cifar-raw", memory, cifar, args.repeats, args.batch),
            "cifar 32px png": _measure(Path(folder), "cifar-png", memory,
                                       EncodedImages(cifar_png, (32, 32, 3), "pil"), args.repeats,
                                       args.batch),
            "celeba 224px decoded": _measure(Path(folder), "celeba-raw", memory, celeba_pixels, args.repeats,
                                             args.batch),
            "celeba jpeg bytes": _measure(Path(folder), "celeba-jpeg", memory,
                                          EncodedImages(celeba_files, (224, 224, 3), "pil"), args.repeats,
                                          args.batch),
        }
    print(f"{rows} exemplars, medians of {args.repeats}; read = open + verify + index every row in batches of "
          f"{args.batch}")
    for name, r in results.items():
        print(f"  {name:<22} {r['bytes']:>9.0f} B/exemplar  write {r['write']:.3f} s  read {r['read']:.3f} s")
    print(f"  (PNG-encoding the {rows} CIFAR exemplars, not in its write time: {png_encode:.3f} s)")
    raw, png = results["cifar 32px raw"], results["cifar 32px png"]
    dec, jpg = results["celeba 224px decoded"], results["celeba jpeg bytes"]
    print(f"ratios: cifar png/raw size {png['bytes'] / raw['bytes']:.2f}x, read {png['read'] / raw['read']:.1f}x; "
          f"celeba decoded/jpeg size {dec['bytes'] / jpg['bytes']:.1f}x, read jpeg/decoded "
          f"{jpg['read'] / dec['read']:.1f}x")


if __name__ == "__main__":
    main()

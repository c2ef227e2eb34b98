"""Bytes a bridge matrix entry reads from a model's weights against the bytes it uses, at the CelebA/DINOv3 shape.

A bridge entry (features computed from stored backbone embeddings) needs only the junction ``A`` (d x m = 21,999 x
768 fp32 = 64.5 MiB) of each of its two models, not the whole ``model.safetensors`` (ViT-B/16 + junction). This
commits one such weights file (DINOv3 ViT-B/16 key layout, zeros) into a run store and reads the junction twice,
interleaved: whole blob verified by its sha256 (the previous reader) and by ranges verified per tensor (now).

    python benchmarks/partial_reads.py [--store DIR_OR_S3_URI] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

# benchmarks/cluster.py must not shadow the cluster package (the script's folder is first on sys.path)
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch

from compat_core import io as cio
from compat_core.models.compat_model import create_model
from compat_core.safetensors_index import tensor_from_bytes
from pipelines.store.run_store import RunStore

KEY = "finetune-t000-benchmarkpartial0"
TENSOR = "junction.weight"


def weights_bytes(num_slots: int, backbone: str) -> bytes:
    """model.safetensors of ``backbone`` + junction + head at K = num_slots, zeros (the layout is what matters)."""
    from safetensors.torch import save

    with torch.device("meta"):
        model = create_model(backbone, num_slots)
    state = {name: torch.zeros(tensor.shape, dtype=tensor.dtype) for name, tensor in model.state_dict().items()}
    return save(state, metadata={"format": "pt"})


class Counter:
    """Bytes returned by compat_core.io.read_range while active."""

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0
        self._real = cio.read_range

    def __enter__(self) -> "Counter":
        def counted(uri, offset, length):
            data = self._real(uri, offset, length)
            self.bytes += len(data)
            self.calls += 1
            return data

        cio.read_range = counted
        return self

    def __exit__(self, *exc) -> None:
        cio.read_range = self._real


def read_whole(store: RunStore) -> torch.Tensor:
    from safetensors.torch import load

    return load(store.read_blob(KEY, "model.safetensors"))[TENSOR]


def read_ranges(store: RunStore) -> torch.Tensor:
    raw, dtype, shape = store.read_tensors(KEY, "model.safetensors", [TENSOR])[TENSOR]
    return tensor_from_bytes(raw, dtype, shape, TENSOR)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default=None, help="run store root (default: a temporary folder)")
    parser.add_argument("--num-slots", type=int, default=22_000)
    parser.add_argument("--backbone", default="dinov3_vitb16")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = args.store or tempfile.mkdtemp(prefix="partial-reads-")
    if "://" in root:
        from cluster.storage.s3 import configure_object_storage

        configure_object_storage()
    data = weights_bytes(args.num_slots, args.backbone)
    store = RunStore(root)
    store.commit(KEY, {"kind": "benchmark"}, {"model.safetensors": data})
    index = store.load_manifest(KEY)["blobs"]["model.safetensors"]["index"]
    used = index["tensors"][TENSOR]["length"]
    times = {"whole": [], "ranges": []}
    read = {}
    for _ in range(args.rounds):  # interleaved: the machine is shared
        for name, function in (("whole", read_whole), ("ranges", read_ranges)):
            started = time.perf_counter()
            with Counter() as counter:
                tensor = function(store)
            times[name].append(time.perf_counter() - started)
            read[name] = counter.bytes if name == "ranges" else len(data)
            if tensor.numel() * tensor.element_size() != used:
                raise RuntimeError(f"{name}: read {tensor.numel()} values, the junction holds {used} bytes")
    print(f"store {root}; model.safetensors {len(data):,} bytes ({args.backbone}, K={args.num_slots}); "
          f"junction {used:,} bytes; load {open('/proc/loadavg').read().split()[:3]}")
    print("| reader | bytes read per model | read / used | median s |")
    print("| --- | --- | --- | --- |")
    for name in ("whole", "ranges"):
        print(f"| {name} | {read[name]:,} | {read[name] / used:.3f} | {statistics.median(times[name]):.3f} |")
    print("a bridge entry reads the junctions of its two models (the same ratio) plus the stored embeddings it uses")
    if args.store is None:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

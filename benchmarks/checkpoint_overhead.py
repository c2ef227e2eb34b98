"""Epoch-checkpoint overhead on the demo scenario: the first stages of demo-dsimplex-hoc run by the engine with a
checkpoint after every epoch (training.checkpoint_every_epochs: 1) vs none (0), interleaved A B B A, each in a
fresh run folder (local disk).

Short variant (the whole demo takes ~8 min on an idle machine per scenario, far more under load): the engine runs
only up to ``finetune[t=2]`` (``until=``): pre-training p1 (100 classes), fine-tuning tasks 1 and 2 (10 and 15
classes, replay), with ``--epochs`` epochs per stage instead of 16 / 30. Epochs keep the demo's full size, so one
checkpoint costs the same fraction of an epoch as in the full demo (fine-tuning epochs are the demo's shortest: the
worst case). Printed: wall time, CPU time of this process (torch threads included; the machine is shared, so CPU
time moves less than wall time), the seconds spent inside checkpoint saves, and the load average.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/checkpoint_overhead.py [--epochs 3] [--blocks 1]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(config_path: str, every: int, epochs: int, folder: Path) -> dict:
    import torch

    import pipelines.training.checkpoints as checkpoints
    from pipelines.config.load import load_config
    from pipelines.engine.runner import LocalExecutor
    from pipelines.graph.compile import compile_scenario
    from pipelines.store.run_store import RunStore

    overrides = [f"training.epochs={epochs}", f"pretrain.0.epochs={epochs}",
                 f"training.checkpoint_every_epochs={every}", f"output.dir={folder}"]
    graph = compile_scenario(load_config(config_path, overrides))
    original = checkpoints.StoreCheckpointSink.save
    spent = {"seconds": 0.0, "saves": 0, "bytes": 0}

    def timed_save(self, checkpoint):
        started = time.perf_counter()
        original(self, checkpoint)
        spent["seconds"] += time.perf_counter() - started
        spent["saves"] += 1
        spent["bytes"] = max(spent["bytes"], sum((folder / self.folder / name).stat().st_size
                                                 for name in self.store.list_files(self.folder)))

    checkpoints.StoreCheckpointSink.save = timed_save
    torch.set_num_threads(1)  # the demo runs one torch thread per scenario
    load = os.getloadavg()[0]
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        LocalExecutor(progress=False).run(graph, RunStore(folder), until=[graph.model_stages[1]])
    finally:
        checkpoints.StoreCheckpointSink.save = original
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    weights = (folder / "artifacts" / graph.model_stages[1] / "model.safetensors").read_bytes()
    return {"every": every, "wall_s": wall, "cpu_s": cpu, "save_s": spent["seconds"], "saves": spent["saves"],
            "checkpoint_bytes": spent["bytes"], "load": load, "weights": hash(weights)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs/demo-dsimplex-hoc.yaml"))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=1, help="A B B A blocks")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as scratch:
        for block in range(args.blocks):
            for index, every in enumerate((0, 1, 1, 0)):
                result = one_run(args.config, every, args.epochs, Path(scratch) / f"run-{block}-{index}")
                results.append(result)
                print(f"checkpoint_every_epochs={every}: wall {result['wall_s']:.1f} s, CPU {result['cpu_s']:.1f} s, "
                      f"{result['saves']} saves took {result['save_s']:.2f} s (checkpoint "
                      f"{result['checkpoint_bytes'] / 1e6:.1f} MB), load {result['load']:.1f}", flush=True)
    off = [r for r in results if r["every"] == 0]
    on = [r for r in results if r["every"] == 1]
    for name in ("wall_s", "cpu_s"):
        ratio = sum(r[name] for r in on) / sum(r[name] for r in off)
        print(f"{name}: every epoch / none = {ratio:.3f} ({(ratio - 1) * 100:+.1f} %)")
    share = sum(r["save_s"] for r in on) / sum(r["wall_s"] for r in on)
    print(f"time inside checkpoint saves: {share * 100:.2f} % of the wall time of the runs with checkpoints")
    print("same trained weights in every run:", len({r["weights"] for r in results}) == 1)
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print(json.dumps({"epochs": args.epochs, "blocks": args.blocks}))


if __name__ == "__main__":
    main()

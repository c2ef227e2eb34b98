"""Training-step throughput with ``training.autocast: auto`` against fp32 and forced bf16 (a script, not a test).

``python benchmarks/training_precision.py [--threads 1 2] [--repeats 3] [--steps 10]``

Runs the product's training loop (``pipelines.training.loop.train_task``, d-Simplex-HOC's loss, SGD) on the demo's model
(cnn4 width 32 on 1 x 32 x 32 glyph-sized images, K = 1024, batch 128) over synthetic images, once per mode and
repeat, interleaved: "auto" (resolved by this machine's calibration, measured first and reported separately),
"off" (fp32) and "bf16" (forced). A run's step time is the median over its steps after the first two (warm-up);
the table shows the median over repeats, images/s, and auto's throughput as a fraction of the better of fp32 and
bf16 (the issue's target: >= 0.95). Prints the load average before and after: on a shared machine the ratios of
one run are what counts.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from compat_core.data.source import ArraySource  # noqa: E402
from compat_core.hardware import calibration  # noqa: E402
from compat_core.models.compat_model import create_model
from pipelines.methods import get_method  # noqa: E402
from pipelines.training.autocast import example_batch, resolve_autocast  # noqa: E402
from pipelines.training.loop import train_task  # noqa: E402
from pipelines.training.settings import TrainConfig  # noqa: E402
from pipelines.training.task_data import TaskData  # noqa: E402

K = 1024
CLASSES = 20


def demo_like_source(images: int, seed: int = 0) -> ArraySource:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(images, 32, 32, 1), dtype=np.uint8)
    labels = np.arange(images) % CLASSES
    return ArraySource(name="glyph-like", images=pixels, labels=labels,
                       class_names=[str(c) for c in range(CLASSES)], hflip=False)


def demo_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return create_model("cnn4", K, classifier="simplex", backbone_config={"width": 32, "in_chans": 1})


def step_seconds(source: ArraySource, mode: str, batch_size: int, steps: int) -> float:
    """Median seconds per training step of one short task (steps after the first two)."""
    labels = source.labels
    data = TaskData(source=source, task=0, indices=np.arange(len(source)), slots=K - 1 - labels,
                    num_old_classes=0, num_new_classes=CLASSES)
    config = TrainConfig(epochs=1, batch_size=batch_size, optimizer={"lr": 0.05}, seed=0, autocast=mode,
                         steps_per_epoch=steps)
    stamps = []
    train_task(demo_model(), None, get_method("dsimplex-hoc"), data, config,
               progress=lambda epoch, step, total, rate: stamps.append(time.perf_counter()))
    return float(np.median(np.diff(stamps[1:])))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch thread counts to run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="steps per run (the first two are warm-up)")
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args(argv)
    source = demo_like_source(args.batch_size * args.steps)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    for threads in args.threads:
        torch.set_num_threads(threads)
        started = time.perf_counter()
        model = demo_model()
        example = example_batch(source, np.arange(args.batch_size), args.batch_size, torch.device("cpu"))
        resolved = resolve_autocast("auto", "cpu", model, example)     # measured now unless cached
        calibrate_s = time.perf_counter() - started
        entry = calibration.load("cpu")
        workload = (entry or {}).get("workloads", {}).get(calibration.workload_signature(model, example, True), {})
        print(f"\nthreads {threads}: auto -> {resolved} (calibration {calibrate_s:.1f} s incl. model build; "
              f"its timings: {workload.get('seconds_per_step')})")
        runs: dict[str, list[float]] = {"auto": [], "off": [], "bf16": []}
        for _ in range(args.repeats):
            for mode in runs:
                runs[mode].append(step_seconds(source, mode, args.batch_size, args.steps))
        median = {mode: float(np.median(values)) for mode, values in runs.items()}
        for mode, values in runs.items():
            print(f"  {mode:5s} median {median[mode] * 1e3:7.1f} ms/step  {args.batch_size / median[mode]:7.1f} img/s"
                  f"  runs {' '.join(f'{v * 1e3:.1f}' for v in values)} ms")
        best = min(median["off"], median["bf16"])
        print(f"  auto throughput / better of fp32 and bf16: {best / median['auto']:.3f} "
              f"(bf16 / fp32 throughput {median['off'] / median['bf16']:.2f}x)")
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

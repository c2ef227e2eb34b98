"""Training on the demo scenario: the new input pipeline against the previous implementation, same run, same task.

``PYTHONPATH=$PWD .venv/bin/python -m benchmarks.demo_training [--config configs/demo-dsimplex-hoc.yaml]
[--task 3] [--epochs 2] [--repeats 3]``

Builds one fine-tuning task of a demo config as the fine-tune stage does (the config's pool, tasks, model, method,
``training`` section with its own batch size and autocast; 0-based ``--task`` with the random replay memory of the
tasks before it; a freshly initialised model, which trains at the same speed as the pre-trained one) and trains it
with ``pipelines.training.loop.train_task`` for ``--epochs`` epochs, in one process pinned to one core with one torch
thread (the demo's budget: two scenarios at once on two cores, one torch thread per stage), the cases interleaved
in each of ``--repeats`` rounds (order rotated; one warm-up round first, not counted):

- previous: the implementation before the streaming pipeline: each batch read by ``source.read`` inside the step
  (``_Loader.batch``), the replay exemplars read from the pool by index;
- new (``input_workers: 0``, the demo configs' setting): ``keep_rows`` + ``stream_batches`` in the training thread,
  the exemplars from the replay shard written and read back as the stage does (``WithMemory``);
- new with ``input_workers: 1``: one decode process forked on the same core (what a worker costs on this budget).

Prints wall seconds and CPU seconds per epoch (medians over rounds) with their ratios to previous (CPU seconds count
this process and its reaped input workers, so they hold under other programs' load), whether every case ended with
bit-identical weights, and the load average.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.input_pipeline import cpu_seconds


def previous_reads(source, indices, batches, *, workers=0, prefetch=2, pin_memory=False):
    """The previous implementation's reads: ``source.read(indices[positions])`` in the training thread, per step."""
    for positions in batches:
        positions = np.asarray(positions, dtype=np.int64)
        yield positions, torch.from_numpy(np.ascontiguousarray(source.read(indices[positions])))


def build_task(config, task: int, folder: Path):
    """(model, old model or None, method, {case: TaskData}, TrainConfig) of 0-based ``task``."""
    from compat_core.data.replay import update_memory
    from compat_core.data.replay_parquet import read_replay_shard, write_replay_shard
    from pipelines.methods import configured_method
    from pipelines.stages.model_io import initial_model
    from pipelines.stages.inputs import ModelShape
    from pipelines.stages.pools import load_pool, scenario_task_classes, slot_of_positions
    from pipelines.stages.replay_store import WithMemory
    from pipelines.training.task_data import TaskData

    method = configured_method(config.method)
    classifier = method.classifier
    K = config.model.num_slots
    pool = load_pool(config.data, "data")
    tasks = scenario_task_classes(config)
    labels = np.asarray(pool.labels)
    position_of = {int(c): i for i, c in enumerate(np.concatenate(tasks))}
    pretrained = config.pretrain[0].num_classes if (classifier == "learnable" and config.pretrain) else 0
    memory = None
    for earlier in range(task):  # the random replay memory after tasks 0 .. task-1
        members = np.flatnonzero(np.isin(labels, tasks[earlier]))
        positions = np.asarray([position_of[int(c)] for c in labels[members]], dtype=np.int64)
        memory = update_memory(memory, members, positions, positions, earlier, config.replay.per_class,
                               strategy="random", seed=config.seed * 1000 + earlier)
    indices = np.flatnonzero(np.isin(labels, tasks[task]))
    positions = np.asarray([position_of[int(c)] for c in labels[indices]], dtype=np.int64)
    slots = slot_of_positions(positions, classifier, K, pretrained)
    common = dict(task=task, indices=indices, slots=slots,
                  num_old_classes=sum(len(t) for t in tasks[:task]) + pretrained, num_new_classes=len(tasks[task]))
    cases = {"previous": TaskData(source=pool, memory_indices=np.asarray(memory.indices),
                                  memory_slots=slot_of_positions(np.asarray(memory.labels), classifier, K, pretrained),
                                  **common)}
    write_replay_shard(str(folder), task - 1, memory, pool)
    shard = read_replay_shard(str(folder), task - 1)
    source = WithMemory(pool, shard.images, np.concatenate(tasks)[np.asarray(shard.memory.labels)])
    new = TaskData(source=source, memory_indices=source.memory_indices(),
                   memory_slots=slot_of_positions(np.asarray(shard.memory.labels), classifier, K, pretrained),
                   **common)
    cases["new, input_workers 0"] = new
    cases["new, input_workers 1"] = new
    model = initial_model(ModelShape.of(config, classifier), classifier, config.seed, num_active=pretrained)
    old = copy.deepcopy(model).eval() if method.needs_old_model else None
    return model, old, method, cases, config.train_config(config.seed * 1000 + task, "cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/demo-dsimplex-hoc.yaml")
    parser.add_argument("--task", type=int, default=3, help="0-based fine-tuning task (>= 1: it has a memory)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.task < 1:
        raise SystemExit("--task must be >= 1 (task 0 has no replay memory)")

    import pipelines.training.loop as training
    import pipelines.training.trainer as trainer
    from pipelines.config.load import load_config
    from pipelines.training.task_data import epoch_batches

    core = sorted(os.sched_getaffinity(0))[0]
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    print(f"start: load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}; pinned to core {core}, 1 thread")
    config = load_config(args.config)
    with tempfile.TemporaryDirectory(prefix="bench-demo-") as tmp:
        model, old, method, cases, train_config = build_task(config, args.task, Path(tmp))
    data = cases["previous"]
    print(f"{args.config}: task {args.task} (0-based), {data.indices.size} task images + {data.memory_indices.size} "
          f"replay exemplars, batch {train_config.batch_size}, autocast {train_config.autocast}, "
          f"{args.epochs} epoch(s) per case")
    initial = copy.deepcopy(model)  # a learnable classifier grows during a task: each run starts from a copy
    streamed = trainer.stream_batches
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}  # (wall s, CPU s) per run
    weights: dict[str, dict] = {}
    names = list(cases)
    for round_ in range(args.repeats + 1):  # round 0 warms up (first-call costs, page cache) and is not counted
        for name in names[round_ % len(names):] + names[: round_ % len(names)]:  # rotated: no case always first
            task_data = cases[name]
            model = copy.deepcopy(initial)
            workers = 1 if name.endswith("input_workers 1") else 0
            settings = train_config.model_copy(update={"epochs": args.epochs, "input_workers": workers})
            trainer.stream_batches = previous_reads if name == "previous" else streamed
            try:
                cpu = cpu_seconds()
                started = time.perf_counter()
                result = training.train_task(model, old, method, task_data, settings)
                wall = time.perf_counter() - started
                cpu = cpu_seconds() - cpu
            finally:
                trainer.stream_batches = streamed
            if round_:
                runs[name].append((wall, cpu))
            weights[name] = {k: v.detach().clone() for k, v in result.model.state_dict().items()}
    base = statistics.median(w for w, _ in runs["previous"]) / args.epochs
    base_cpu = statistics.median(c for _, c in runs["previous"]) / args.epochs
    for name, measured in runs.items():
        per_epoch = statistics.median(w for w, _ in measured) / args.epochs
        cpu_epoch = statistics.median(c for _, c in measured) / args.epochs
        print(f"{name}: {per_epoch:.2f} s per epoch = {per_epoch / base:.3f}x previous (wall: train_task / epochs); "
              f"{cpu_epoch:.2f} CPU-s per epoch = {cpu_epoch / base_cpu:.3f}x previous (this process and its input "
              f"workers: does not depend on other programs' load)")
    # the input path alone, same batches, no model: what the loaders themselves cost per batch
    batches = list(epoch_batches(data, method, train_config, 0))
    for name, reader in (("previous", previous_reads), ("new, input_workers 0", streamed)):
        task_data = cases[name]
        rows = np.concatenate([task_data.indices, task_data.memory_indices])
        cpu = cpu_seconds()
        for _ in range(20):
            trainer.keep_rows(task_data.source, rows)
            for _ in reader(task_data.source, rows, batches, workers=0):
                pass
        print(f"input path alone, {name}: {(cpu_seconds() - cpu) / 20 / len(batches) * 1e3:.3f} ms CPU per batch "
              f"(of {base_cpu / len(batches) * 1e3:.1f} ms per training step)")
    same = all(all(torch.equal(weights["previous"][k], w[k]) for k in w) for w in weights.values())
    print(f"bit-identical final weights in every case: {same}")
    print(f"end: load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()

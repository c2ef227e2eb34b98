"""The run's cost for ``compat plan``: images every stage processes, GPU-hours at a stated per-image cost, and the
critical path through the stage graph.

Image counts come from the samplers the stages train with: each training stage's ``TaskData`` (task samples, the
replay memory the previous tasks leave, the held-out selection split) is built from the same helpers the stage uses,
and its epoch is counted by walking :func:`pipelines.training.task_data.epoch_batches`, the batch order the training loop
steps through (``replay.epoch_length: reference`` gives (task + memory) // batch batches, ``task`` one pass over the
task data, ...). Batch sizes do not depend on the epoch's seed, so epochs x epoch 0 is the stage's count.

Cost model (every assumption is printed with the numbers):
- a training image costs ``seconds_per_image`` GPU-seconds (forward + backward + optimiser step of the trained model);
- a forward-only image (a frozen old model's forward in a training step, an extracted query/gallery image) costs a
  third of that (a backward pass costs about two forwards);
- matrix entries and rows run on CPUs and are not counted; data-parallel stages (``num_workers`` N) take 1/N of the
  wall time at the same GPU-seconds (ideal scaling).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from compat_core.data import replay
from compat_core.slots import pretrain_slot
from pipelines.graph.compile import StageGraph
from pipelines.graph.stage_kind import StageKind
from pipelines.methods import METHODS
from pipelines.stages.pools import load_pool, own_task_classes, scenario_task_classes, slot_of_positions
from pipelines.training.task_data import TaskData, epoch_batches, selection_split

FORWARD_FRACTION = 1.0 / 3.0  # cost of a forward-only image relative to a training image


@dataclass(frozen=True)
class _Sampling:
    """What the batch order reads of a method: supervised pre-training mixes no replay memory into its batches."""

    uses_replay: bool = False


@dataclass(frozen=True)
class StageImages:
    """Images one stage processes. epoch_images: images per epoch of its sampler (training stages; the pool size for
    extraction). epochs: passes. train_images: images through forward + backward. forward_images: forward-only
    images (old-model forwards of a training stage, extraction). memory: replay samples the stage's sampler draws
    from (0 without memory)."""

    key: str
    label: str
    kind: StageKind
    epoch_images: int
    epochs: int
    train_images: int
    forward_images: int
    memory: int = 0

    def gpu_seconds(self, seconds_per_image: float) -> float:
        """GPU-seconds at ``seconds_per_image`` per training image (forward-only images at FORWARD_FRACTION)."""
        return seconds_per_image * (self.train_images + FORWARD_FRACTION * self.forward_images)


def _epoch_images(data, method, train_config) -> int:
    """Images of one epoch of the training loop's batch order for ``data`` (batches of one sample are dropped)."""
    return int(sum(positions.size for positions in epoch_batches(data, method, train_config, 0)))


@dataclass(frozen=True)
class _PoolWithMemory:
    """What the sampler reads of a task's source followed by ``memory`` replay rows (its length and name): a task of
    its own data trains with earlier exemplars of other pools, as rows after its own (the stage's WithMemory)."""

    name: str
    size: int

    def __len__(self) -> int:
        return self.size


def _task_pool(graph: StageGraph, task: int, pool, tasks: list[np.ndarray], position_of: dict[int, int]):
    """(pool, class ids of the task, class id -> position) of ``task``: a split task or one of its own data."""
    own = graph[graph.model_stages[task]].inputs.own_data
    if own is None:
        return pool, tasks[task], position_of
    own_pool, class_ids = own_task_classes(own)
    return own_pool, class_ids, {int(c): own.first_position + i for i, c in enumerate(class_ids)}


def _task_stage_images(graph: StageGraph) -> dict[str, StageImages]:
    """StageImages of every finetune / replace stage, the replay memory simulated task by task as the stages do."""
    config = graph.config
    method = METHODS.get(config.method.name)  # the card: the traits the stages read, no torch
    pool = load_pool(config.data, "data")
    tasks = scenario_task_classes(config)
    position_of = {int(c): i for i, c in enumerate(np.concatenate(tasks))}
    K = config.model.num_slots
    use_memory = method.uses_replay and config.replay.per_class > 0 and not method.retrain_from_scratch
    wants_old = method.needs_old_model or config.training.model_selection == "compatibility"
    memory = replay.ReplayMemory.empty()
    result = {}
    for task, key in enumerate(graph.model_stages):
        stage = graph[key]
        seed = config.seed * 1000 + task
        task_pool, task_class_ids, task_position_of = _task_pool(graph, task, pool, tasks, position_of)
        task_labels = np.asarray(task_pool.labels)
        classes = np.concatenate(tasks[: task + 1]) if method.retrain_from_scratch else task_class_ids
        indices = np.flatnonzero(np.isin(task_labels, classes))
        if config.training.model_selection == "compatibility":
            indices, _ = selection_split(config.training.selection_holdout, task_pool, indices, seed)
        positions = np.asarray([task_position_of[int(c)] for c in task_labels[indices]], dtype=np.int64)
        memory_indices = memory_slots = None
        source = task_pool
        if use_memory and memory.indices.size:
            memory_indices = np.asarray(memory.indices, dtype=np.int64)
            memory_slots = slot_of_positions(np.asarray(memory.labels), "simplex", K, 0)
            if task_pool is not pool:  # earlier exemplars are rows after the task's own (see _PoolWithMemory)
                source = _PoolWithMemory(task_pool.name, len(task_pool) + memory_indices.size)
                memory_indices = np.arange(len(task_pool), len(source), dtype=np.int64)
        data = TaskData(source=source, task=task, indices=indices, slots=slot_of_positions(positions, "simplex", K, 0),
                        num_old_classes=0, num_new_classes=len(task_class_ids), memory_indices=memory_indices,
                        memory_slots=memory_slots)
        train_config = config.train_config(seed, "cpu")
        per_epoch = _epoch_images(data, method, train_config)
        trained = per_epoch * train_config.epochs
        # a frozen old model runs a forward per trained image: from task 1 on, at a replacement, and at task 0 when the
        # line starts from loaded weights (train_task_stage anchors to them)
        has_old = wants_old and (task > 0 or stage.kind == StageKind.REPLACE or bool(config.initial_model))
        result[key] = StageImages(key, stage.label, stage.kind, per_epoch, train_config.epochs, trained,
                                  trained if has_old else 0, 0 if memory_indices is None else memory_indices.size)
        if use_memory:  # the memory the next task trains with (the quota per class does not depend on the strategy)
            task_indices = np.flatnonzero(np.isin(task_labels, task_class_ids))
            task_positions = np.asarray([task_position_of[int(c)] for c in task_labels[task_indices]], dtype=np.int64)
            memory = replay.update_memory(memory, task_indices, task_positions, task_positions, task,
                                          config.replay.per_class, strategy="random", seed=seed)
    return result


def stage_images(graph: StageGraph) -> dict[str, StageImages]:
    """Images processed by every stage of ``graph`` that runs a model (pretrain, finetune, replace, extract); opens
    the data pools (labels only). Raises FileNotFoundError / ValueError naming the pool when one cannot be read."""
    config = graph.config
    result: dict[str, StageImages] = {}
    for name, key in graph.pretrain_stages.items():
        spec = config.pretrain_spec(name)
        pool = load_pool(spec.pool, f"pretrain[{name}].pool")
        labels = np.asarray(pool.labels)
        indices = np.arange(len(pool))
        data = TaskData(source=pool, task=0, indices=indices, slots=pretrain_slot(labels),
                        num_old_classes=0, num_new_classes=int(np.unique(labels).size))
        train_config = config.train_config(spec.seed if spec.seed is not None else config.seed, "cpu", spec)
        per_epoch = _epoch_images(data, _Sampling(uses_replay=False), train_config)
        result[key] = StageImages(key, graph[key].label, StageKind.PRETRAIN, per_epoch, train_config.epochs,
                                  per_epoch * train_config.epochs, 0)
    result.update(_task_stage_images(graph))
    sizes = {split: len(load_pool(getattr(config.evaluation, f"{split}_set"), f"evaluation.{split}_set"))
             for split in ("query", "gallery")}
    for (task, split), key in graph.extract_stages.items():
        result[key] = StageImages(key, graph[key].label, StageKind.EXTRACT, sizes[split], 1, 0, sizes[split])
    return result


@dataclass(frozen=True)
class Schedule:
    """Earliest-start schedule of the graph with one GPU (or N for data-parallel stages) per stage at once.

    sequential_hours: every stage one after the other on one GPU (GPU-hours). critical_hours: the longest chain of
    dependent stages (wall time with enough GPUs). path: its stage keys, first to last. peak_stages: the most GPU
    workers (a stage's num_workers) busy at once in the earliest-start schedule (GPUs needed to reach critical_hours)."""

    sequential_hours: float
    critical_hours: float
    path: list[str]
    peak_stages: int


def schedule(graph: StageGraph, images: dict[str, StageImages], seconds_per_image: float) -> Schedule:
    """Longest path through ``graph`` with each stage's wall time (GPU-seconds / num_workers); CPU stages take 0."""
    finish: dict[str, float] = {}
    start: dict[str, float] = {}
    before: dict[str, str | None] = {}
    total = 0.0
    for stage in graph:  # topological order
        cost = images.get(stage.key)
        gpu_seconds = cost.gpu_seconds(seconds_per_image) if cost is not None else 0.0
        total += gpu_seconds
        wall = gpu_seconds / max(1, stage.resources.num_workers)
        parent = max(stage.parents, key=lambda p: finish[p], default=None)
        start[stage.key] = finish[parent] if parent is not None else 0.0
        finish[stage.key] = start[stage.key] + wall
        before[stage.key] = parent
    last = max(finish, key=finish.get)
    path, current = [], last
    while current is not None:
        path.append(current)
        current = before[current]
    path.reverse()
    workers = {k: max(1, graph[k].resources.num_workers) for k in images if finish[k] > start[k]}
    events = sorted([(start[k], n) for k, n in workers.items()] + [(finish[k], -n) for k, n in workers.items()])
    running = peak = 0
    for _, change in events:  # a stage ending at t frees its GPU before one starting at t takes it (negative changes sort first)
        running += change
        peak = max(peak, running)
    return Schedule(total / 3600.0, finish[last] / 3600.0, [k for k in path if k in images], peak)


def cost_lines(graph: StageGraph, seconds_per_image: float | None, cost_source: str) -> list[str]:
    """``compat plan``'s cost section: images per stage kind and stage, GPU-hours and the critical path."""
    try:
        images = stage_images(graph)
    except (FileNotFoundError, ValueError, OSError) as error:
        return [f"cost: unknown, the data cannot be opened to count the sampler's epochs ({error})"]
    config = graph.config
    lines = ["cost: images per stage from the training loop's batch order (replay.epoch_length: "
             f"{config.replay.epoch_length}, batch {config.training.batch_size}; epochs x images per epoch)"]
    by_kind: dict[StageKind, list[StageImages]] = {}
    for stage in graph:
        if stage.key in images:
            by_kind.setdefault(stage.kind, []).append(images[stage.key])
    for kind, items in by_kind.items():
        trained = sum(item.train_images for item in items)
        forward = sum(item.forward_images for item in items)
        lines.append(f"  {kind:<9} {len(items):>4} stage(s): {trained:>14,} training images, "
                     f"{forward:>14,} forward-only images")
    for stage in graph:
        item = images.get(stage.key)
        if item is None or item.kind == StageKind.EXTRACT:
            continue
        memory = f" (task + memory {item.memory:,})" if item.memory else ""
        lines.append(f"    {item.label:<22} {item.epoch_images:>9,} images/epoch{memory} x {item.epochs} = "
                     f"{item.train_images:,}" + (f" (+{item.forward_images:,} old-model forwards)"
                                                  if item.forward_images else ""))
    if seconds_per_image is None:
        lines.append("  GPU-hours: give a per-image cost (--seconds-per-image S, GPU-seconds per training image, or "
                     "--calibrated DEVICE after `compat calibrate CONFIG --device DEVICE`)")
        return lines
    plan = schedule(graph, images, seconds_per_image)
    lines.append(f"  assumptions: {seconds_per_image * 1e3:.4g} ms per training image ({cost_source}); a "
                 f"forward-only image (frozen old model, extraction) costs {FORWARD_FRACTION:.3g} of that; entries "
                 f"and rows run on CPUs (not counted); a stage with num_workers N takes 1/N of its GPU time (ideal)")
    lines.append(f"  GPU-hours: {plan.sequential_hours:.2f} (every stage in sequence on one GPU)")
    labels = " -> ".join(graph[key].label for key in plan.path)
    lines.append(f"  critical path: {plan.critical_hours:.2f} h with {plan.peak_stages} GPU(s) (workers of the "
                 f"earliest-start schedule busy at once): {labels}")
    off_path = [graph[key].label for key in images if key not in plan.path and graph[key].kind.trains]
    if off_path:
        lines.append(f"  off the critical path (done before the path needs them): {', '.join(off_path)}")
    return lines

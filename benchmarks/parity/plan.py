"""The class order, replay memory and batch order that both codes replay (generated once, seeded, JSON-able).

Rules, those of the public IAM-CL2R script: classes in id order, task 1 of ``initial`` classes then ``increment``
per task; after each task ``rehearsal`` random images per class of the task join the memory (continuum's
``herd_random`` with a fixed quota), which is kept in class order; task 1 trains on shuffled batches with the last
partial batch dropped (``DataLoader(shuffle=True, drop_last=True)``, src/iamcl2r/main.py:181-183); later tasks on
``(task + memory) // batch`` batches of half memory, half task, each side drawn at random, with replacement when a side
holds <= batch // 2 samples (``BalancedBatchSampler``, src/iamcl2r/dataset/dataset_utils.py:35-71).

A position numbers the task's rows (its classes' images in file order) then the memory's rows (memory order), as
the public code's ``train_task_set._x`` and our ``TaskData`` (indices, then memory_indices) both do.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PlanShape:
    initial: int = 2
    increment: int = 2
    tasks: int = 3
    per_class: int = 24  # training images per class in the pool file (grouped by class)
    rehearsal: int = 20
    batch_size: int = 16
    epochs: int = 4


def task_classes(shape: PlanShape) -> list[list[int]]:
    """Class ids of each task in id order (continuum's ``ClassIncremental`` without a class order)."""
    out, start = [], 0
    for task in range(shape.tasks):
        width = shape.initial if task == 0 else shape.increment
        out.append(list(range(start, start + width)))
        start += width
    return out


def _balanced_epoch(rng: np.random.Generator, num_task: int, num_memory: int, batch_size: int) -> list[list[int]]:
    total = num_task + num_memory
    batches = total // batch_size
    size = batch_size // 2 if batches else total // 2
    memory = np.arange(num_task, total)
    task = np.arange(num_task)
    out = []
    for _ in range(max(batches, 1)):
        chosen = rng.choice(memory, size=size, replace=memory.size <= size)
        chosen = np.concatenate([chosen, rng.choice(task, size=size, replace=task.size <= size)])
        out.append(chosen.tolist())
    return out


def make_plan(shape: PlanShape, seed: int) -> dict:
    """The plan: per task its classes, file rows, memory rows (file rows, memory order) and batches per epoch."""
    rng = np.random.default_rng(seed)
    memory: dict[int, list[int]] = {}  # class -> file rows, in the order the herding picked them
    tasks = []
    for number, classes in enumerate(task_classes(shape)):
        rows = [c * shape.per_class + o for c in classes for o in range(shape.per_class)]
        memory_rows = [row for c in sorted(memory) for row in memory[c]]
        if number == 0:
            usable = (len(rows) // shape.batch_size) * shape.batch_size
            epochs = [rng.permutation(len(rows))[:usable].reshape(-1, shape.batch_size).tolist()
                      for _ in range(shape.epochs)]
        else:
            epochs = [_balanced_epoch(rng, len(rows), len(memory_rows), shape.batch_size)
                      for _ in range(shape.epochs)]
        tasks.append({"task": number, "classes": classes, "rows": rows, "memory_rows": memory_rows,
                      "memory_labels": [row // shape.per_class for row in memory_rows], "batches": epochs})
        for c in classes:
            picked = rng.choice(shape.per_class, size=min(shape.rehearsal, shape.per_class), replace=False)
            memory[c] = [c * shape.per_class + int(o) for o in picked]
    return {"shape": shape.__dict__, "seed": seed, "tasks": tasks, "memory_after": {str(c): memory[c] for c in memory}}


def steps(plan: dict) -> int:
    """Optimiser steps of the whole plan."""
    return sum(len(epoch) for task in plan["tasks"] for epoch in task["batches"])

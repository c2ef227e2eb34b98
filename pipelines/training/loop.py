"""The training loop shared by every method: one call trains one task (``train_task``), or pre-trains a
third-party model (``pretrain_model``); both run the task's :class:`pipelines.training.trainer.Trainer`.

The trainer owns the model, the optimiser, the schedule, the batches and model selection; the method
(:mod:`pipelines.methods`) only turns a batch into a loss. Nothing here talks to a tracker: progress goes to a
callable and per-epoch summaries to ``on_record`` as plain :class:`TrainRecord` dataclasses.

Determinism: with the same ``TrainConfig.seed``, model weights, data and thread count, two runs on the CPU produce
bit-identical weights (batch order comes from numpy generators seeded by (seed, task, epoch); augmentation and
module initialisation use the torch generator seeded at the start of the task).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import nn

from compat_core.data.source import ImageSource
from compat_core.losses import simplex_cross_entropy
from compat_core.simplex import pretrain_slot
from pipelines.methods.objective import Batch, Method, TaskContext, classification_cross_entropy
from pipelines.training.checkpoints import CheckpointSink
from pipelines.training.records import ProgressHook, TrainRecord, TrainResult
from pipelines.training.selection import compute_features, snapshot_state
from pipelines.training.settings import TrainConfig
from pipelines.training.task_data import TaskData
from pipelines.training.trainer import Trainer


def train_task(
    model: nn.Module,
    old_model: nn.Module | None,
    method: Method,
    data: TaskData,
    config: TrainConfig,
    on_record: Callable[[TrainRecord], None] | None = None,
    progress: ProgressHook | None = None,
    checkpoints: "CheckpointSink | None" = None,
    parallel_key: str = "resources.finetune.num_workers",
) -> TrainResult:
    """Train ``model`` on one task with ``method``; returns the trained model and the training records.

    model: a CompatModel whose classifier kind matches ``method.classifier`` (learnable classifiers are grown to the
    largest slot + 1 here). old_model: the frozen previous model (or the newly loaded one at a replacement) or
    None; it is put in eval mode and never receives gradients. ``on_record`` receives a :class:`TrainRecord` per
    epoch (and every ``log_every_steps`` steps); ``progress(epoch, step, total_steps, images_per_s)`` is called after
    every step. Methods with ``retrain_from_scratch`` and an ``initial_state`` restart from those weights.

    checkpoints: where epoch checkpoints go (:mod:`pipelines.training.checkpoints`). The latest one is restored before the
    first epoch (after ``method.setup``, which sees the starting model as in an uninterrupted run), its records are
    re-emitted to ``on_record``, and training continues bit-identically on the CPU in fp32. A checkpoint is saved
    at the epoch ends ``checkpoints.policy`` picks (not after the last: the stage commits then) and, when SIGTERM
    arrives, at the next step boundary; the process then ends as SIGTERM ends it, so Ray retries the task.
    Inside an initialised torch.distributed group of N ranks every rank trains its rows of each global batch under
    DDP and the loss sees the global batch (:mod:`pipelines.training.distributed`); ``parallel_key`` names the setting that
    chose N in errors.
    """
    return Trainer(model, old_model, method, data, config, on_record=on_record, progress=progress,
                   checkpoints=checkpoints, parallel_key=parallel_key).fit()


class SupervisedPretraining(Method):
    """Plain supervised training of a third-party model: SCE over all K (simplex) or CE (learnable).

    Not registered as a compared method; used by :func:`pretrain_model`.
    """

    name = "pretrain"
    uses_replay = False

    def __init__(self, classifier: str) -> None:
        super().__init__()
        self.classifier = classifier  # type: ignore[misc]

    def loss(self, batch: Batch, ctx: TaskContext) -> tuple[torch.Tensor, dict[str, float]]:
        output = ctx.model(batch.images)
        if self.classifier == "simplex":
            value = simplex_cross_entropy(output.logits, batch.targets)
        else:
            value = classification_cross_entropy(output.logits, batch.targets)
        return value, {"ce": value.detach()}


def pretrain_model(
    model: nn.Module,
    source: ImageSource,
    indices: np.ndarray,
    config: TrainConfig,
    on_record: Callable[[TrainRecord], None] | None = None,
    progress: ProgressHook | None = None,
    checkpoints: "CheckpointSink | None" = None,
) -> TrainResult:
    """Pre-train a third-party model on its own class pool, class slots left to right (slot = dataset label).

    indices: sample indices into ``source``; labels must be 0-based within the pre-training pool (nested pools
    share their leading labels, so bigger pools keep the smaller pools' slots).
    """
    indices = np.asarray(indices, dtype=np.int64).reshape(-1)
    labels = np.asarray(source.labels)[indices]
    slots = pretrain_slot(labels)
    data = TaskData(source=source, task=0, indices=indices, slots=slots, num_old_classes=0,
                    num_new_classes=int(np.unique(labels).size))
    method = SupervisedPretraining(getattr(model, "classifier_kind", "simplex"))
    return train_task(model, None, method, data, config, on_record=on_record, progress=progress,
                      checkpoints=checkpoints, parallel_key="resources.pretrain.num_workers")


__all__ = [
    "SupervisedPretraining",
    "compute_features",
    "pretrain_model",
    "snapshot_state",
    "train_task",
]

"""The training stages: ``pretrain`` (a third-party model on its own pool) and ``finetune`` / ``replace`` (one task
of the scenario, then the replay memory update), with their epoch checkpoints, progress and training summary."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from compat_core.upgrades.adapters import save_adapter
from pipelines.engine.events import ProgressUpdate
from pipelines.methods import configured_method
from pipelines.records.payloads import TrainingSummary
from pipelines.records.stage_records import MemoryRecord, ModelRecord
from pipelines.stages.context import StageContext, StageResult
from pipelines.stages.inputs import PretrainInputs, TrainInputs
from pipelines.stages.model_io import (
    artifact_location,
    frozen,
    initial_model,
    load_model_artifact,
    load_source,
    load_weights_strictly,
    model_blobs,
)
from pipelines.stages.pools import load_pool, own_task_classes, slot_of_positions, task_classes
from pipelines.stages.replay_memory import (
    memory_from_record,
    memory_images_from_record,
    updated_memory,
    write_task_memory_shard,
)
from pipelines.stages.replay_store import WithMemory
from pipelines.store.run_store import encode_array
from pipelines.training.checkpoints import StoreCheckpointSink, policy_from_settings
from pipelines.training.distributed import is_leader, launcher_checkpoint_sink
from pipelines.training.loop import compute_features, pretrain_model, train_task
from pipelines.training.task_data import TaskData, selection_split


def _progress_hook(ctx: StageContext):
    """train_task's per-step progress -> ProgressUpdate records (steps of the stage, the epoch in progress of the
    recipe's epochs, images/s)."""
    epochs = int(ctx.inputs.training.epochs)

    def hook(epoch: int, step: int, total_steps: int, images_per_s: float) -> None:
        ctx.emit(ProgressUpdate(ctx.stage.key, step, total_steps, "step", images_per_s, epoch=epoch + 1, epochs=epochs))
    return hook


def _summary(result: Any) -> TrainingSummary:
    """JSON summary of a TrainResult: selected epoch (0-based), images/s, seconds, last epoch's mean loss (nats)."""
    records = getattr(result, "records", []) or []
    return TrainingSummary(
        selected_epoch=int(result.selected_epoch),
        images_per_s=float(result.images_per_s),
        seconds=float(result.seconds),
        final_loss=float(records[-1].loss) if records else None,
        epochs_recorded=len(records),
        resumed_from_epoch=getattr(result, "resumed_from_epoch", None),  # epoch checkpoint restored, if any
        # where the time went: device idle waiting for input (fraction of the training seconds), start-up, memory
        input_stall_fraction=float(getattr(result, "input_stall_seconds", 0.0)) / max(float(result.seconds), 1e-9),
        first_step_seconds=getattr(result, "first_step_seconds", None),
        peak_device_memory_bytes=getattr(result, "peak_device_memory_bytes", None),
        loop_unix_seconds=list(getattr(result, "loop_unix_seconds", None) or []),  # to align device samples
        checkpoints_written=getattr(result, "checkpoints_written", None),
        checkpoint_seconds=getattr(result, "checkpoint_seconds", None),
    )


def _checkpoints(ctx: StageContext):
    """The stage's epoch checkpoints in the run store (None with ``training.checkpoint_every_epochs: 0``)."""
    policy = policy_from_settings(ctx.settings.checkpoint_every_epochs, ctx.settings.checkpoint_every_minutes)
    if policy is None:
        return None
    # data-parallel ranks keep theirs through their launcher (Ray Train), written once, by rank 0
    return launcher_checkpoint_sink(policy) or StoreCheckpointSink(ctx.store, ctx.stage.key, policy)


def pretrain_stage(ctx: StageContext) -> StageResult:
    """Train a third-party model on its pool: class y takes slot y (0.., left to right) / output y (learnable).

    The model has the entry's classifier family: by default the method under test's (shared d-Simplex with the
    same K, or a learnable classifier), as the reference pre-trains third-party models; ``classifier: simplex``
    trains one d-Simplex model that runs of every method share.
    """
    inputs: PretrainInputs = ctx.inputs
    pool = load_pool(inputs.pool, f"pretrain[{inputs.name}].pool")
    labels = np.asarray(pool.labels)
    occupied = int(labels.max()) + 1 if labels.size else 0
    if occupied != inputs.num_classes or np.unique(labels).size != inputs.num_classes:
        raise ValueError(f"pretrain[{inputs.name}].num_classes: config says {inputs.num_classes}; the pool has "
                         f"{np.unique(labels).size} classes with labels up to {occupied - 1} (pre-training labels "
                         f"are the slots, so they must be exactly 0..num_classes-1)")
    learnable = inputs.classifier == "learnable"
    model = initial_model(inputs.model, inputs.classifier, inputs.seed,
                          num_active=inputs.num_classes if learnable else 0)
    weights = None
    if inputs.init is not None:
        # fine-tune published weights (e.g. DINOv3) on the pool; the junction and classifier start fresh
        init = inputs.init
        weights = load_weights_strictly(model, init.location, init.sha256, init.ignore_keys, init.config_key)
        if not init.pinned:
            logging.getLogger(__name__).warning(
                "pretrain[%s].init: no init_sha256 set; %s has sha256 %s: pin it with init_sha256: %s so that a "
                "changed file is refused", inputs.name, init.location, weights.sha256, weights.sha256)
    model = model.to(ctx.device)
    model.config["pretrained_classes"] = inputs.num_classes
    result = pretrain_model(model, pool, np.arange(len(pool)), inputs.training.train_config(ctx.device, ctx.settings),
                            on_record=ctx.emit, progress=_progress_hook(ctx), checkpoints=_checkpoints(ctx))
    record = ModelRecord(ctx.stage.key, artifact_location(ctx.stage.key), task=None, line=0,
                         pretrained_classes=inputs.num_classes, positions_seen=0, classifier=inputs.classifier,
                         num_active_classes=inputs.num_classes if learnable else 0,
                         training=_summary(result), pretrain_name=inputs.name, weights=weights)
    return StageResult(record, model_blobs(result.model))


def _state_copy(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@dataclass
class _Task:
    """What one task stage works with: its inputs, method, its pool and class order (``tasks``: the class ids of the
    split's tasks 0..t; for a task given by its own data, ``[its class ids]`` with ``own_first`` the positions of
    the tasks before it), and the line's previous model record with the replay memory it left."""

    ctx: StageContext
    inputs: TrainInputs
    method: Any
    pool: Any
    tasks: list[np.ndarray]
    previous: ModelRecord | None
    memory: tuple
    memory_images: Any
    own_first: int | None = None

    @property
    def classes(self) -> np.ndarray:
        """Class ids (in the task's pool) of this task's classes."""
        return self.tasks[-1] if self.own_first is not None else self.tasks[self.task]

    @property
    def task(self) -> int:
        return self.inputs.task

    @property
    def seed(self) -> int:
        """The task's training seed."""
        return self.inputs.seed * 1000 + self.inputs.task

    @property
    def first_position(self) -> int:
        """Class positions of the tasks before this one."""
        if self.own_first is not None:
            return self.own_first
        return sum(len(t) for t in self.tasks[: self.task])

    @property
    def position_of(self) -> dict[int, int]:
        """Class id (in the task's pool) -> class position, for the classes of the pool's tasks."""
        first = self.own_first or 0
        return {int(c): first + i for i, c in enumerate(np.concatenate(self.tasks))}

    def memory_labels(self) -> np.ndarray:
        """Class ids, in the task's pool, of the replay rows (-1: a class of another pool's task)."""
        if self.own_first is None:
            return np.concatenate(self.tasks)[self.memory[1]]
        return np.full(self.memory[1].shape[0], -1, dtype=np.int64)

    @property
    def use_memory(self) -> bool:
        method = self.method
        return method.uses_replay and self.inputs.replay.per_class > 0 and not method.retrain_from_scratch


@dataclass
class _Start:
    """The model a task trains, the frozen old model (or None), P (classes of the line's pre-training), the line,
    the external weights' load report and the initial state (methods that retrain from scratch)."""

    model: Any
    old_model: Any = None
    pretrained: int = 0
    line: int = 0
    weights: Any = None
    initial_state: dict | None = None


def _open_task(ctx: StageContext) -> _Task:
    inputs: TrainInputs = ctx.inputs
    method = configured_method(inputs.method)
    own_first = None
    if inputs.own_data is not None:
        pool, class_ids = own_task_classes(inputs.own_data)
        tasks, own_first = [class_ids], inputs.own_data.first_position
    else:
        pool = load_pool(inputs.data, "data")
        tasks = task_classes(inputs.data, inputs.classes, ctx.settings.guards)
    previous = ctx.parents[ctx.stage.parents[0]] if inputs.task > 0 else None
    memory = memory_from_record(ctx.store, previous)
    # the previous task's exemplars come from its replay shard (verified now, before any training), never from
    # the old tasks' source data
    memory_images = memory_images_from_record(ctx.store, previous, memory)
    if own_first is not None and memory[0].size and memory_images is None:
        raise ValueError(f"{inputs.own_data.config_key}: the replay memory of task {inputs.task} (1-based) has no "
                         f"replay shard (a run written before shards), and a task of its own data cannot read the "
                         f"earlier exemplars from their pools; start a new run")
    return _Task(ctx, inputs, method, pool, tasks, previous, memory, memory_images, own_first)


def _start(work: _Task) -> _Start:
    """The model the task starts from (see the method docstring: fresh, loaded or the previous task's) and the old
    model it stays compatible with."""
    ctx, inputs, method, previous = work.ctx, work.inputs, work.method, work.previous
    classifier = method.classifier
    wants_old = method.needs_old_model or inputs.training.model_selection == "compatibility"
    if method.retrain_from_scratch:
        # CoReS: the same initial weights (seeded once) at every step; PSP/LSP: independently trained models, each
        # step with its own initial weights (the paper; CoReS Sec. 8.3 shows a shared start raises AC). All data so far.
        init_seed = work.seed if getattr(method, "independent_init", False) else inputs.seed
        model = initial_model(inputs.model, classifier, init_seed).to(ctx.device)
        start = _Start(model, initial_state=_state_copy(model))
        if previous is not None and wants_old:
            start.old_model = frozen(load_model_artifact(ctx.store, previous, ctx.device))
        return start
    if inputs.start is not None:
        model, pretrained, weights = load_source(ctx, inputs.start, classifier, inputs.model.head, inputs.seed)
        start = _Start(model, pretrained=pretrained, weights=weights)
        if inputs.replaces:
            start.line = previous.line + 1
            if inputs.anchor == "replaced":
                # trained to be compatible with the model it replaces (its features are what the index holds)
                start.old_model = frozen(load_model_artifact(ctx.store, previous, ctx.device))
            else:
                start.old_model = frozen(model)  # the reference HOC anchors to the newly loaded model
        elif wants_old:
            # a line that starts from loaded weights anchors to them, at the first task as at a replacement
            start.old_model = frozen(model)
    elif work.task == 0:
        start = _Start(initial_model(inputs.model, classifier, inputs.seed).to(ctx.device))
    else:
        model = load_model_artifact(ctx.store, previous, ctx.device)
        start = _Start(model, pretrained=previous.pretrained_classes, line=previous.line)
        if wants_old:
            start.old_model = frozen(model)
    K = inputs.model.num_slots
    if classifier == "simplex" and start.model.num_slots != K:
        raise ValueError(f"model.num_slots: the starting model of task {work.task + 1} (1-based) has "
                         f"K={start.model.num_slots}, the scenario uses K={K}; a d-Simplex line needs one K throughout")
    return start


def _task_data(work: _Task, start: _Start) -> TaskData:
    """The task's samples (all tasks so far for methods that retrain from scratch), their slots, the replay memory
    and the held-out selection split."""
    inputs, method, pool, tasks = work.inputs, work.method, work.pool, work.tasks
    classifier, K = method.classifier, inputs.model.num_slots
    pool_labels = np.asarray(pool.labels)
    if method.retrain_from_scratch:
        indices = np.flatnonzero(np.isin(pool_labels, np.concatenate(tasks[: work.task + 1])))
    else:
        indices = np.flatnonzero(np.isin(pool_labels, work.classes))
    selection = None
    if inputs.training.model_selection == "compatibility":
        indices, selection = selection_split(inputs.training.selection_holdout, pool, indices, work.seed)
    position_of = work.position_of
    positions = np.asarray([position_of[int(c)] for c in pool_labels[indices]], dtype=np.int64)
    memory_indices = memory_slots = None
    train_source = pool
    if work.use_memory and work.memory[0].size:
        memory_indices = work.memory[0]
        memory_slots = slot_of_positions(work.memory[1], classifier, K, start.pretrained)
        if work.memory_images is not None:
            train_source = WithMemory(pool, work.memory_images, work.memory_labels())
            memory_indices = train_source.memory_indices()
    first_position = work.first_position
    num_old = first_position if not method.retrain_from_scratch else 0
    return TaskData(
        source=train_source, task=work.task, indices=indices,
        slots=slot_of_positions(positions, classifier, K, start.pretrained),
        num_old_classes=num_old + (start.pretrained if classifier == "learnable" else 0),
        num_new_classes=len(work.classes) + (first_position if method.retrain_from_scratch else 0),
        memory_indices=memory_indices, memory_slots=memory_slots, initial_state=start.initial_state,
        selection=selection,
    )


def _memory_update(work: _Task, trained, blobs: dict[str, bytes]) -> MemoryRecord:
    """The replay memory after this task (its exemplars added), written to ``blobs`` and to the stage's replay
    shard."""
    ctx, inputs, pool, task = work.ctx, work.inputs, work.pool, work.task
    pool_labels = np.asarray(pool.labels)
    position_of = work.position_of
    task_indices = np.flatnonzero(np.isin(pool_labels, work.classes))
    task_positions = np.asarray([position_of[int(c)] for c in pool_labels[task_indices]], dtype=np.int64)
    herding_features = None
    if inputs.replay.strategy == "herding":
        # iCaRL herding ranks the task's samples by the features of the model just trained (eval transforms)
        herding_features = compute_features(trained, pool, task_indices,
                                            inputs.training.train_config(ctx.device, ctx.settings)).numpy()
    new_indices, new_positions, new_tasks = updated_memory(inputs.replay, inputs.seed, work.memory, task_indices,
                                                           task_positions, task, herding_features)
    blobs["memory-indices.npy"] = encode_array(new_indices)
    blobs["memory-positions.npy"] = encode_array(new_positions)
    blobs["memory-tasks.npy"] = encode_array(new_tasks)
    previous = work.previous
    previous_shard = previous.memory.shard if previous is not None and previous.memory is not None else None
    shard = write_task_memory_shard(ctx, task, work.memory, work.memory_images, pool, new_indices, new_positions,
                                    new_tasks, previous_shard)
    return MemoryRecord("memory-indices.npy", "memory-positions.npy", "memory-tasks.npy", int(new_indices.shape[0]),
                        inputs.replay.per_class, shard=shard)


def train_task_stage(ctx: StageContext) -> StageResult:
    """finetune(t) / replace(t): one task of the scenario, then the replay memory update."""
    work = _open_task(ctx)
    start = _start(work)
    data = _task_data(work, start)
    result = train_task(start.model, start.old_model, work.method, data,
                        work.inputs.training.train_config(ctx.device, ctx.settings), on_record=ctx.emit,
                        progress=_progress_hook(ctx), checkpoints=_checkpoints(ctx))
    if not is_leader():  # data-parallel training: rank 0 builds and commits the artifacts, the other ranks nothing
        return StageResult(None)
    trained = result.model
    blobs = model_blobs(trained)
    extra = []
    if result.extra_state:
        for module_name, adapter in result.extra_state.items():  # FAN's psi_t: stored like every adapter
            name = f"extra-{module_name}.safetensors"
            blobs[name] = save_adapter(adapter)
            extra.append(name)
    memory_record = _memory_update(work, trained, blobs) if work.use_memory else None
    classifier = work.method.classifier
    num_active = int(trained.num_active_classes) if classifier == "learnable" else 0
    start_text = work.inputs.start.text if work.inputs.start is not None else None
    record = ModelRecord(ctx.stage.key, artifact_location(ctx.stage.key), task=work.task, line=start.line,
                         pretrained_classes=start.pretrained,
                         positions_seen=work.first_position + len(work.classes), classifier=classifier,
                         num_active_classes=num_active, source=start_text, memory=memory_record, extra_blobs=extra,
                         training=_summary(result), weights=start.weights)
    return StageResult(record, blobs)

"""The training stages: ``pretrain`` (a third-party model on its own pool) and ``finetune`` / ``replace`` (one task
of the scenario, then the replay memory update), with their epoch checkpoints, progress and training summary."""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from compat_core.upgrades.adapters import save_adapter
from pipelines.config.schema import ScenarioConfig
from pipelines.engine.events import ProgressUpdate
from pipelines.graph.source_digests import source_digest
from pipelines.graph.stage_kind import StageKind
from pipelines.methods import configured_method
from pipelines.records.payloads import TrainingSummary
from pipelines.records.stage_records import MemoryRecord, ModelRecord
from pipelines.stages.context import StageContext, StageResult
from pipelines.stages.model_io import (
    artifact_location,
    frozen,
    initial_model,
    load_model_artifact,
    load_source,
    load_weights_strictly,
    model_blobs,
)
from pipelines.stages.pools import load_pool, slot_of_positions, task_classes
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
    """train_task's per-step progress -> ProgressUpdate records (epoch bar with images/s and ETA)."""
    def hook(epoch: int, step: int, total_steps: int, images_per_s: float) -> None:
        ctx.emit(ProgressUpdate(ctx.stage.key, step, total_steps, "step", images_per_s))
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
    training = ctx.config.training
    policy = policy_from_settings(training.checkpoint_every_epochs, training.checkpoint_every_minutes)
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
    config = ctx.config
    spec = config.pretrain_spec(ctx.stage.name)
    classifier = ctx.stage.params["classifier"]  # the entry's family, resolved by the graph
    pool = load_pool(spec.pool, f"pretrain[{spec.name}].pool")
    labels = np.asarray(pool.labels)
    occupied = int(labels.max()) + 1 if labels.size else 0
    if occupied != spec.num_classes or np.unique(labels).size != spec.num_classes:
        raise ValueError(f"pretrain[{spec.name}].num_classes: config says {spec.num_classes}; the pool has "
                         f"{np.unique(labels).size} classes with labels up to {occupied - 1} (pre-training labels "
                         f"are the slots, so they must be exactly 0..num_classes-1)")
    seed = spec.seed if spec.seed is not None else config.seed
    model = initial_model(config, classifier, seed, spec.backbone, spec.backbone_config,
                           num_active=spec.num_classes if classifier == "learnable" else 0)
    weights = None
    if spec.init is not None:
        # fine-tune published weights (e.g. DINOv3) on the pool; the junction and classifier start fresh
        weights = load_weights_strictly(model, spec.init, spec.init_sha256 or source_digest(ctx.stage.params),
                                        spec.init_ignore_keys, f"pretrain[{spec.name}].init")
        if spec.init_sha256 is None:
            logging.getLogger(__name__).warning(
                "pretrain[%s].init: no init_sha256 set; %s has sha256 %s: pin it with init_sha256: %s so that a "
                "changed file is refused", spec.name, spec.init, weights.sha256, weights.sha256)
    model = model.to(ctx.device)
    model.config["pretrained_classes"] = spec.num_classes
    result = pretrain_model(model, pool, np.arange(len(pool)), config.train_config(seed, ctx.device, spec),
                            on_record=ctx.emit, progress=_progress_hook(ctx), checkpoints=_checkpoints(ctx))
    record = ModelRecord(ctx.stage.key, artifact_location(ctx.stage.key), task=None, line=0,
                         pretrained_classes=spec.num_classes, positions_seen=0, classifier=classifier,
                         num_active_classes=spec.num_classes if classifier == "learnable" else 0,
                         training=_summary(result), pretrain_name=spec.name, weights=weights)
    return StageResult(record, model_blobs(result.model))


def _state_copy(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_task_stage(ctx: StageContext) -> StageResult:
    """finetune(t) / replace(t): one task of the scenario, then the replay memory update."""
    config = ctx.config
    stage = ctx.stage
    task = int(stage.task)
    method = configured_method(config)
    classifier = method.classifier
    K = config.model.num_slots
    pool = load_pool(config.data, "data")
    tasks = task_classes(config)
    position_of = {int(c): i for i, c in enumerate(np.concatenate(tasks))}
    pool_labels = np.asarray(pool.labels)
    first_position = sum(len(t) for t in tasks[:task])
    seed = config.seed * 1000 + task
    previous = ctx.parents[stage.parents[0]] if task > 0 else None
    memory = memory_from_record(ctx.store, previous)
    # the previous task's exemplars come from its replay shard (verified now, before any training), never from
    # the old tasks' source data
    memory_images = memory_images_from_record(ctx.store, previous, memory)
    replacement = config.replacement_at(task) if stage.kind == StageKind.REPLACE else None
    wants_old = method.needs_old_model or config.training.model_selection == "compatibility"

    initial_state = None
    old_model = None
    weights = None
    if method.retrain_from_scratch:
        # CoReS: the same initial weights (seeded once) at every step; PSP/LSP: independently trained models, each
        # step with its own initial weights (the paper; CoReS Sec. 8.3 shows a shared start raises AC). All data so far.
        init_seed = seed if getattr(method, "independent_init", False) else config.seed
        model = initial_model(config, classifier, init_seed).to(ctx.device)
        initial_state = _state_copy(model)
        pretrained, line = 0, 0
        if previous is not None and wants_old:
            old_model = frozen(load_model_artifact(ctx.store, previous, ctx.device))
        indices = np.flatnonzero(np.isin(pool_labels, np.concatenate(tasks[: task + 1])))
    else:
        if replacement is not None:
            index = config.replacements.index(replacement)
            model, pretrained, weights = load_source(ctx, replacement.source, classifier, replacement.backbone,
                                                      replacement.backbone_config, replacement.sha256, config.seed,
                                                      replacement.num_pretrain_classes, replacement.ignore_keys,
                                                      f"replacements[{index}].source")
            line = previous.line + 1
            if replacement.anchor == "replaced":
                # trained to be compatible with the model it replaces (its features are what the index holds)
                old_model = frozen(load_model_artifact(ctx.store, previous, ctx.device))
            else:
                old_model = frozen(model)  # the reference HOC anchors to the newly loaded model
        elif task == 0 and config.initial_model:
            model, pretrained, weights = load_source(ctx, config.initial_model, classifier, None, None, None,
                                                      config.seed, ignore=config.initial_model_ignore_keys,
                                                      key="initial_model")
            line = 0
            if wants_old:
                # a line that starts from loaded weights anchors to them, at the first task as at a replacement
                old_model = frozen(model)
        elif task == 0:
            model, pretrained, line = initial_model(config, classifier, config.seed).to(ctx.device), 0, 0
        else:
            model = load_model_artifact(ctx.store, previous, ctx.device)
            pretrained, line = previous.pretrained_classes, previous.line
            if wants_old:
                old_model = frozen(model)
        if classifier == "simplex" and model.num_slots != K:
            raise ValueError(f"model.num_slots: the starting model of task {task + 1} (1-based) has "
                             f"K={model.num_slots}, the scenario uses K={K}; a d-Simplex line needs one K throughout")
        indices = np.flatnonzero(np.isin(pool_labels, tasks[task]))

    selection = None
    if config.training.model_selection == "compatibility":
        indices, selection = selection_split(config, pool, indices, seed)
    positions = np.asarray([position_of[int(c)] for c in pool_labels[indices]], dtype=np.int64)
    use_memory = method.uses_replay and config.replay.per_class > 0 and not method.retrain_from_scratch
    memory_indices = memory_slots = None
    train_source = pool
    if use_memory and memory[0].size:
        memory_indices = memory[0]
        memory_slots = slot_of_positions(memory[1], classifier, K, pretrained)
        if memory_images is not None:
            train_source = WithMemory(pool, memory_images, np.concatenate(tasks)[memory[1]])
            memory_indices = train_source.memory_indices()
    num_old = first_position if not method.retrain_from_scratch else 0
    data = TaskData(
        source=train_source, task=task, indices=indices, slots=slot_of_positions(positions, classifier, K, pretrained),
        num_old_classes=num_old + (pretrained if classifier == "learnable" else 0),
        num_new_classes=len(tasks[task]) + (first_position if method.retrain_from_scratch else 0),
        memory_indices=memory_indices, memory_slots=memory_slots, initial_state=initial_state, selection=selection,
    )
    result = train_task(model, old_model, method, data, config.train_config(seed, ctx.device), on_record=ctx.emit,
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

    memory_record = None
    if use_memory:
        task_indices = np.flatnonzero(np.isin(pool_labels, tasks[task]))
        task_positions = np.asarray([position_of[int(c)] for c in pool_labels[task_indices]], dtype=np.int64)
        herding_features = None
        if config.replay.strategy == "herding":
            # iCaRL herding ranks the task's samples by the features of the model just trained (eval transforms)
            herding_features = compute_features(trained, pool, task_indices,
                                                config.train_config(seed, ctx.device)).numpy()
        new_indices, new_positions, new_tasks = updated_memory(config, memory, task_indices, task_positions, task,
                                                               herding_features)
        blobs["memory-indices.npy"] = encode_array(new_indices)
        blobs["memory-positions.npy"] = encode_array(new_positions)
        blobs["memory-tasks.npy"] = encode_array(new_tasks)
        memory_record = MemoryRecord("memory-indices.npy", "memory-positions.npy", "memory-tasks.npy",
                                     int(new_indices.shape[0]), config.replay.per_class,
                                     shard=write_task_memory_shard(ctx, task, memory, memory_images, pool, new_indices,
                                                               new_positions, new_tasks,
                                                               previous.memory.shard if previous is not None
                                                               and previous.memory is not None else None))
    num_active = int(trained.num_active_classes) if classifier == "learnable" else 0
    source = replacement.source if replacement is not None else (config.initial_model if task == 0 else None)
    record = ModelRecord(stage.key, artifact_location(stage.key), task=task, line=line, pretrained_classes=pretrained,
                         positions_seen=first_position + len(tasks[task]), classifier=classifier,
                         num_active_classes=num_active, source=source, memory=memory_record, extra_blobs=extra,
                         training=_summary(result), weights=weights)
    return StageResult(record, blobs)

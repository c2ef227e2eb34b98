"""The training loop shared by every method: one call trains one task (``train_task``).

The loop owns the model, the optimiser, the schedule, the batches and model selection; the method
(:mod:`pipelines.methods`) only turns a batch into a loss. Nothing here talks to a tracker: progress goes to a
callable and per-epoch summaries to ``on_record`` as plain :class:`TrainRecord` dataclasses.

Determinism: with the same ``TrainConfig.seed``, model weights, data and thread count, two runs on the CPU produce
bit-identical weights (batch order comes from numpy generators seeded by (seed, task, epoch); augmentation and
module initialisation use the torch generator seeded at the start of the task).
"""
from __future__ import annotations

import contextlib
import itertools
import math
import time
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from compat_core.data.base import ImageSource
from compat_core.data.stream import keep_rows, stream_batches
from compat_core.data.transforms import make_transforms
from compat_core.losses import simplex_cross_entropy
from compat_core.models.precision import prepare_batch
from compat_core.retrieval.search import recall_at_1
from compat_core.simplex import pretrain_slot
from compat_core.upgrades.adapters import apply_chain
from pipelines.methods.base import Batch, Method, TaskContext, classification_cross_entropy
from pipelines.training import distributed
from pipelines.training.autocast import autocast_mode, example_batch, precision_context, prepare_model, resolve_autocast
from pipelines.training.checkpoints import CheckpointSink, EpochCheckpoint, preemption_guard
from pipelines.training.records import ProgressHook, TrainRecord, TrainResult, _Window
from pipelines.training.settings import TrainConfig
from pipelines.training.state import restore_training_state, training_state
from pipelines.training.batches import _Loader
from pipelines.training.task_data import (
    SelectionSplit,
    TaskData,
    _augment_seed,
    _steps_per_epoch,
    epoch_batches,
)


def _lr_factor(config: TrainConfig, steps_per_epoch: int) -> Callable[[int], float]:
    total = config.epochs * steps_per_epoch
    warmup = config.warmup_epochs * steps_per_epoch

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if config.schedule.name == "cosine":
            progress = (step - warmup) / max(1, total - warmup)
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        if config.schedule.name == "step":
            epoch = step // steps_per_epoch
            return config.schedule.gamma ** sum(1 for milestone in config.schedule.milestones if epoch >= milestone)
        return 1.0

    return factor


def _make_optimizer(parameters: list[nn.Parameter], config: TrainConfig) -> torch.optim.Optimizer:
    settings = config.optimizer
    if settings.name == "sgd":
        return torch.optim.SGD(parameters, lr=settings.lr, momentum=settings.momentum, weight_decay=settings.weight_decay)
    return torch.optim.AdamW(parameters, lr=settings.lr, weight_decay=settings.weight_decay)


def _check_model_for_method(model: nn.Module, method: Method, data: TaskData) -> None:
    kind = getattr(model, "classifier_kind", None)
    if kind != method.classifier:
        raise ValueError(
            f"method {method.name!r} needs a model with classifier={method.classifier!r}, got {kind!r}; "
            f"build it with create_model(..., classifier={method.classifier!r})"
        )
    top_slot = int(data.slots.max())
    if data.has_memory:
        top_slot = max(top_slot, int(data.memory_slots.max()))
    if kind == "simplex" and top_slot >= model.num_slots:
        raise ValueError(f"TaskData slots reach {top_slot} but the model has only K={model.num_slots} d-Simplex slots")
    if method.requires_initial_state and data.initial_state is None:
        raise ValueError(f"method {method.name!r} retrains from the same initial weights: TaskData.initial_state is required")


def snapshot_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of ``model.state_dict()`` (for initial weights and model selection)."""
    return {key: value.detach().to("cpu", copy=True) for key, value in model.state_dict().items()}


@torch.no_grad()
def _extract(model: nn.Module, source: ImageSource, indices: np.ndarray, device: torch.device, config: TrainConfig,
             feature_fn: Callable[[Any], torch.Tensor]) -> torch.Tensor:
    transform = make_transforms(source, train=False)
    chunks = []
    batches = [np.arange(start, min(start + config.eval_batch_size, indices.size))
               for start in range(0, indices.size, config.eval_batch_size)]
    for _, images in stream_batches(source, indices, batches, workers=config.input_workers,
                                    prefetch=config.prefetch_batches, pin_memory=device.type == "cuda"):
        with precision_context(device, config.autocast):
            output = model(prepare_batch(transform(images.to(device, non_blocking=True)), model))
        chunks.append(feature_fn(output).float().cpu())
    return torch.cat(chunks)


def compute_features(model: nn.Module, source: ImageSource, indices: np.ndarray, config: TrainConfig) -> torch.Tensor:
    """L2-normalised features (n, K-1), float32 on the CPU, of ``source[indices]`` with evaluation transforms.

    Batches of ``config.eval_batch_size`` on ``config.device`` under ``config.autocast``; the model is put in
    eval mode for the call and its previous mode restored (used for herding replay selection).
    """
    indices = np.asarray(indices, dtype=np.int64).reshape(-1)
    was_training = model.training
    model.eval()
    try:
        return _extract(model, source, indices, torch.device(config.device), config, lambda output: output.features)
    finally:
        model.train(was_training)


class _CompatibilitySelector:
    """CoReS Sec. 8.2: among epochs whose cross-test beats the previous model's self-test, keep the best self-test.

    All tests are 1:N Recall@1 (fractions) on the held-out split; the previous model's features and self-test are
    computed once. Only the best snapshot so far is kept in memory. With no previous model every epoch qualifies;
    when no epoch qualifies, the last epoch is kept (the paper does not say; "last" is the default anyway).
    """

    def __init__(self, split: SelectionSplit, old_model: nn.Module | None, method: Method, device: torch.device,
                 config: TrainConfig) -> None:
        self.split, self.method, self.device, self.config = split, method, device, config
        self.query_labels = torch.from_numpy(np.asarray(split.source.labels)[split.query_indices])
        self.gallery_labels = torch.from_numpy(np.asarray(split.source.labels)[split.gallery_indices])
        self.old_model = old_model
        self.old_classes = None if old_model is None else int(old_model.num_active_classes)
        self.old_gallery = self.old_self = None
        if old_model is not None:
            old_query = self._features(old_model, split.query_indices, None)
            self.old_gallery = self._features(old_model, split.gallery_indices, None)
            self.old_self = self._recall(old_query, self.old_gallery)
        self.best_state: dict[str, torch.Tensor] | None = None
        self.best_epoch: int | None = None
        self.best_self = -math.inf
        self.history: list[dict[str, float]] = []

    def _features(self, model: nn.Module, indices: np.ndarray, num_classes_old: int | None) -> torch.Tensor:
        if self.method.training_free:
            feature_fn = lambda output: self.method.extract_features(output, num_classes_old)  # noqa: E731
        else:
            feature_fn = lambda output: output.features  # noqa: E731
        return _extract(model, self.split.source, indices, self.device, self.config, feature_fn)

    def _recall(self, query: torch.Tensor, gallery: torch.Tensor) -> float:
        return float(recall_at_1(query, self.query_labels, gallery, self.gallery_labels))

    def observe(self, epoch: int, model: nn.Module) -> dict[str, float]:
        was_training = model.training
        model.eval()
        query = self._features(model, self.split.query_indices, None)
        gallery = self._features(model, self.split.gallery_indices, None)
        metrics = {"selection_self": self._recall(query, gallery)}
        qualifies = True
        if self.old_model is not None:
            old_gallery = self.old_gallery
            adapter = getattr(self.method, "adapter", None)
            if adapter is not None:  # FAN compares a new query with the adapted old gallery
                old_gallery = apply_chain(old_gallery.to(self.device), [adapter]).cpu()
            cross_query = query
            if self.method.training_free:
                cross_query = self._features(model, self.split.query_indices, self.old_classes)
            metrics["selection_cross"] = self._recall(cross_query, old_gallery)
            metrics["selection_old_self"] = self.old_self
            if self.config.selection_strict:
                qualifies = metrics["selection_cross"] > self.old_self
            else:
                qualifies = metrics["selection_cross"] >= self.old_self
        metrics["selection_compatible"] = float(qualifies)
        if qualifies and metrics["selection_self"] > self.best_self:
            self.best_self = metrics["selection_self"]
            self.best_epoch = epoch
            self.best_state = snapshot_state(model)
        self.history.append({"epoch": float(epoch), **metrics})
        model.train(was_training)
        return metrics


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
    if not isinstance(method, Method):
        raise ValueError(f"method must be a pipelines.methods Method, got {type(method).__name__}")
    if not isinstance(config, TrainConfig):
        raise ValueError(f"config must be a TrainConfig, got {type(config).__name__}")
    _check_model_for_method(model, method, data)
    if config.model_selection == "compatibility" and data.selection is None:
        raise ValueError("TrainConfig.model_selection 'compatibility' needs TaskData.selection (a held-out split)")
    device = torch.device(config.device)
    stage_start = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(config.seed)
    if data.initial_state is not None and method.retrain_from_scratch:
        model.load_state_dict(dict(data.initial_state))
    if method.classifier == "learnable":
        needed = int(data.slots.max()) + 1
        if data.has_memory:
            needed = max(needed, int(data.memory_slots.max()) + 1)
        if needed > model.num_active_classes:
            model.expand_classes(needed)
    if autocast_mode(config.autocast) == "auto":
        example = example_batch(data.source, data.indices, config.batch_size, device)
        config = config.model_copy(update={"autocast": resolve_autocast("auto", device, model, example)})
    parallel = distributed.current()
    if parallel is not None:  # every rank computes in rank 0's precision (its measured "auto" choice)
        config = config.model_copy(update={"autocast": parallel.agree(config.autocast)})
    prepare_model(model, device, config.autocast)
    if old_model is not None:
        prepare_model(old_model, device, config.autocast)
        old_model.eval()
        old_model.requires_grad_(False)

    loader = _Loader(data, model, device, train=True, augment=config.augment, seed=_augment_seed(config.seed, data.task))
    # every epoch reads these rows in a new random order: sources over row-group storage keep them in memory (read
    # once, in storage order) before the input workers fork
    keep_rows(data.source, loader.all_indices)
    memory_iterator = None
    if data.has_memory:
        # summaries of the memory taken in setup (old-class centres) see un-augmented images
        eval_loader = _Loader(data, model, device, train=False, augment=False, seed=0)
        memory_iterator = lambda: eval_loader.memory_batches(config.eval_batch_size)  # noqa: E731
    ctx = TaskContext(
        model=model,
        old_model=old_model,
        task=data.task,
        num_old_classes=data.num_old_classes,
        num_new_classes=data.num_new_classes,
        hparams=method.hparams,
        device=device,
        iterate_memory=memory_iterator,
    )
    model.eval()  # setup statistics (e.g. old-class centres) must not update batch-norm buffers
    with precision_context(device, config.autocast):
        extra_modules = method.setup(ctx)
    for module in extra_modules:
        module.to(device).train()
    parameters = [p for p in model.parameters() if p.requires_grad]
    for module in extra_modules:
        parameters.extend(p for p in module.parameters() if p.requires_grad)
    optimizer = _make_optimizer(parameters, config)
    steps_per_epoch = _steps_per_epoch(data, method, config)
    if steps_per_epoch == 0:
        raise ValueError(f"task {data.task} yields no batch of >= 2 samples with batch_size {config.batch_size}")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_factor(config, steps_per_epoch))
    total_steps = config.epochs * steps_per_epoch
    if parallel is not None:
        parallel.check_batches([positions.size for positions in epoch_batches(data, method, config, 0)], parallel_key)
        ctx.model = distributed.GlobalBatchModel(distributed.wrap_model(model, device), model, parallel)
        if old_model is not None:
            ctx.old_model = distributed.GlobalBatchModel(old_model, old_model, parallel)

    selector = None
    if config.model_selection == "compatibility":
        selector = _CompatibilitySelector(data.selection, old_model, method, device, config)

    records: list[TrainRecord] = []
    step = 0
    train_seconds = 0.0
    train_images = 0
    task_start = time.perf_counter()
    loop_started_unix = time.time()
    stall = _InputStall(device)
    first_step_seconds: float | None = None

    def emit(record: TrainRecord) -> None:
        records.append(record)
        if on_record is not None:
            on_record(record)

    start_epoch, skip_steps, window = 0, 0, _Window()
    latest = checkpoints.load_latest() if checkpoints is not None else None
    if latest is not None:
        position = restore_training_state(latest.state, model, optimizer, scheduler, extra_modules=extra_modules,
                                          augment_generator=loader.transform.generator, selector=selector)
        start_epoch, skip_steps, step = position["epochs_done"], position["step_in_epoch"], position["step"]
        train_seconds, train_images = position["extras"]["train_seconds"], position["extras"]["train_images"]
        window = _Window.from_state(position["extras"]["window"], device)
        for record in position["records"]:
            emit(record)

    written = [0, 0.0]  # checkpoints saved by this task and their write seconds

    def save(epochs_done: int, step_in_epoch: int, current: _Window) -> None:
        write_started = time.perf_counter()
        state = training_state(model, optimizer, scheduler, epochs_done=epochs_done, step_in_epoch=step_in_epoch,
                               step=step, extra_modules=extra_modules, augment_generator=loader.transform.generator,
                               selector=selector, records=records,
                               extras={"train_seconds": train_seconds, "train_images": train_images,
                                       "window": current.state()})
        checkpoints.save(EpochCheckpoint(epochs_done, state))
        checkpoints.policy.wrote(time.perf_counter() - write_started)
        written[0] += 1
        written[1] += time.perf_counter() - write_started

    plan = []  # (epoch, its batches, steps done before a SIGTERM checkpoint, this rank's batches still to run)
    for epoch in range(start_epoch, config.epochs):
        batches = list(epoch_batches(data, method, config, epoch))
        skip = skip_steps if epoch == start_epoch else 0
        plan.append((epoch, batches, skip,
                     batches[skip:] if parallel is None else distributed.shard_batches(parallel, batches[skip:])))
    # the next batches are read and decoded on CPU workers while this step runs (same order for a seed): one
    # stream over every epoch, so the workers start once and read the next epoch's first batches while this one ends
    stream = stream_batches(data.source, loader.all_indices, [b for *_, local in plan for b in local],
                            workers=config.input_workers, prefetch=config.prefetch_batches,
                            pin_memory=device.type == "cuda")
    with preemption_guard(enabled=checkpoints is not None) as preempted, contextlib.closing(stream):
        for epoch, batches, skip, local in plan:
            model.train()
            started = time.perf_counter()  # a step's time includes any wait for its batch
            for in_epoch, (positions, images) in enumerate(itertools.islice(stream, len(local)), start=skip + 1):
                stall.batch_arrived(time.perf_counter() - started)
                if parallel is None:
                    batch = loader.batch(positions, images)
                else:  # this rank's images, the global batch's targets; the models return global outputs
                    positions = batches[in_epoch - 1]
                    batch = loader.batch(positions, images, parallel.rows(positions.size))
                    for wrapper in (ctx.model, ctx.old_model):
                        if wrapper is not None:
                            wrapper.total = positions.size
                with precision_context(device, config.autocast):
                    loss, parts = method.loss(batch, ctx)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scheduler.step()
                stall.step_queued()
                step += 1
                if first_step_seconds is None:
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)  # once: the first step really done, not only queued
                    first_step_seconds = time.perf_counter() - stage_start
                seconds = time.perf_counter() - started
                started = time.perf_counter()
                train_seconds += seconds
                train_images += int(positions.size)
                # running sums stay on the device: the host reads them only when a record is emitted (no step sync)
                window.add(loss.detach(), parts, int(positions.size), seconds)
                if progress is not None:
                    progress(epoch, step, total_steps, train_images / max(train_seconds, 1e-9))
                if config.log_every_steps and step % config.log_every_steps == 0:
                    emit(window.record(data.task, epoch, step, optimizer, method_name=method.name))
                    window = _Window()
                if preempted and in_epoch < len(batches):  # preemption: save now, the grace period is short
                    save(epoch, in_epoch, window)
                    preempted.exit(f"task {data.task}: SIGTERM received; checkpoint at epoch {epoch} step "
                                   f"{in_epoch} saved, exiting so that the stage is retried from it")
            metrics = selector.observe(epoch, model) if selector is not None else {}  # every rank: same weights
            if window.count or metrics:
                emit(window.record(data.task, epoch, step, optimizer, metrics, method_name=method.name))
            window = _Window()
            done = epoch + 1
            periodic = checkpoints is not None and done < config.epochs and checkpoints.policy.due(done)
            if parallel is not None and checkpoints is not None:
                periodic = parallel.agree(periodic)  # every rank saves at the same epoch ends (a barrier in Ray Train)
            # no periodic save after the last epoch (the stage commits next), but one on SIGTERM
            if checkpoints is not None and ((periodic and done < config.epochs) or preempted):
                save(done, 0, window)
            if preempted:
                preempted.exit(f"task {data.task}: SIGTERM received; checkpoint after {done} epoch(s) saved, "
                               f"exiting so that the stage is retried from it")

    selected_epoch = config.epochs - 1
    if selector is not None and selector.best_state is not None:
        selected_epoch = int(selector.best_epoch)
        if selected_epoch != config.epochs - 1:
            model.load_state_dict(selector.best_state)
    model.eval()
    return TrainResult(
        model=model,
        records=records,
        selected_epoch=selected_epoch,
        images_per_s=train_images / max(train_seconds, 1e-9),
        seconds=time.perf_counter() - task_start,
        extra_state=method.export_state(),
        selection=[] if selector is None else selector.history,
        resumed_from_epoch=None if latest is None else latest.epochs_done,
        input_stall_seconds=stall.seconds,
        loop_unix_seconds=(loop_started_unix, time.time()),
        first_step_seconds=first_step_seconds,
        peak_device_memory_bytes=int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None,
        checkpoints_written=written[0],
        checkpoint_seconds=written[1],
    )


class _InputStall:
    """Seconds the device sat idle waiting for input batches (an upper bound).

    After each step a CUDA event marks the end of the work queued so far. When the next batch arrives, the host's wait
    counts as a stall only if that event has already completed, i.e. the accelerator ran out of work before the
    batch came; a wait while queued work still runs costs nothing. On the CPU every wait is a stall.
    """

    def __init__(self, device: torch.device) -> None:
        self.seconds = 0.0
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self._queued = False

    def step_queued(self) -> None:
        if self._event is not None:
            self._event.record()
            self._queued = True

    def batch_arrived(self, waited_seconds: float) -> None:
        if self._event is None or not self._queued or self._event.query():
            self.seconds += max(0.0, waited_seconds)


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

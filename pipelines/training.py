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
import random
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from compat_core.calibration import autocast_choice
from compat_core.data.base import ImageSource
from compat_core.data.replay import half_and_half_batches
from compat_core.data.stream import keep_rows, stream_batches, to_device
from compat_core.data.transforms import make_transforms
from compat_core.models.precision import autocast_context, has_convolutions, prepare_batch, prepare_for_speed
from compat_core.retrieval import recall_at_1
from compat_core.simplex import pretrain_slot
from pipelines import distributed
from pipelines.methods.base import Batch, Method, TaskContext, classification_cross_entropy
from pipelines.train_config import TrainConfig

if TYPE_CHECKING:
    from pipelines.checkpoints import CheckpointSink

# "auto": bf16/fp16 autocast only where a measured step of this model is faster than fp32 (compat_core.calibration,
# cached per machine); "bf16"/"fp16": forced; "off": fp32.
AUTOCAST_MODES = ("auto", "bf16", "fp16", "off")
_FORCED_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_mode(value: Any) -> str:
    """Normalise an autocast setting: True -> "auto", False -> "off", or one of AUTOCAST_MODES (ValueError else)."""
    if value is True:
        return "auto"
    if value is False:
        return "off"
    if value not in AUTOCAST_MODES:
        raise ValueError(f"autocast must be true, false or one of {AUTOCAST_MODES}, got {value!r}")
    return value


def precision_context(device: torch.device | str, mode: Any):
    """The autocast context of ``mode`` (see AUTOCAST_MODES) on ``device``; a null context for fp32."""
    mode = autocast_mode(mode)
    device = torch.device(device)
    if mode == "off":
        return contextlib.nullcontext()
    if mode == "auto":
        return autocast_context(device, enabled=True)
    return torch.autocast(device_type=device.type, dtype=_FORCED_DTYPES[mode])


def resolve_autocast(mode: Any, device: torch.device | str, model: nn.Module, example: torch.Tensor,
                     train: bool = True) -> str:
    """Turn "auto" into "bf16"/"fp16"/"off": the measured faster step of ``model`` on batches shaped like
    ``example`` (``compat_core.calibration.autocast_choice``, cached per machine); other modes are returned as is."""
    mode = autocast_mode(mode)
    if mode != "auto":
        return mode
    dtype = autocast_choice(device, model, example, train=train)
    return {None: "off", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def example_batch(source: ImageSource, indices: np.ndarray, batch_size: int, device: torch.device) -> torch.Tensor:
    """A full batch of ``source`` images (the first ``indices``, cycled when fewer), transformed as for
    evaluation: what calibration times a step on."""
    picked = np.resize(np.asarray(indices, dtype=np.int64), batch_size)
    images = torch.from_numpy(np.ascontiguousarray(source.read(picked)))
    return make_transforms(source, train=False)(images.to(device))


def prepare_model(model: nn.Module, device: torch.device | str, mode: Any) -> nn.Module:
    """Move ``model`` to ``device``; conv nets go channels_last where the half path makes NHWC kernels pay."""
    model = prepare_for_speed(model, device)
    if autocast_mode(mode) in _FORCED_DTYPES and has_convolutions(model):
        model = model.to(memory_format=torch.channels_last)
    return model


@dataclass
class SelectionSplit:
    """Held-out split for compatibility-based model selection: an i.i.d. sample of the gallery data (CoReS Sec. 8.2).

    query_indices / gallery_indices: sample indices into ``source`` (classes are ``source.labels``).
    """

    source: ImageSource
    query_indices: np.ndarray
    gallery_indices: np.ndarray

    def __post_init__(self) -> None:
        for name in ("query_indices", "gallery_indices"):
            values = np.asarray(getattr(self, name), dtype=np.int64).reshape(-1)
            if values.size == 0:
                raise ValueError(f"SelectionSplit.{name} must not be empty")
            if values.min() < 0 or values.max() >= len(self.source):
                raise ValueError(f"SelectionSplit.{name} must index {self.source.name} (size {len(self.source)})")
            setattr(self, name, values)


@dataclass
class TaskData:
    """The data of one task.

    source: where images come from. task: 0-based task index. indices: (n,) sample indices of the task's training
    data (for CoReS / PSP / LSP: every sample seen so far). slots: (n,) class slot of each sample (d-Simplex slot or
    learnable-classifier output). memory_indices / memory_slots: the replay memory (same source) or None.
    num_old_classes / num_new_classes: counts of classes before / introduced by this task. initial_state: the
    weights CoReS restarts from (required by methods with ``requires_initial_state``). selection: held-out split
    for ``model_selection: compatibility``.
    """

    source: ImageSource
    task: int
    indices: np.ndarray
    slots: np.ndarray
    num_old_classes: int
    num_new_classes: int
    memory_indices: np.ndarray | None = None
    memory_slots: np.ndarray | None = None
    initial_state: Mapping[str, torch.Tensor] | None = None
    selection: SelectionSplit | None = None

    def __post_init__(self) -> None:
        for name in ("task", "num_old_classes", "num_new_classes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"TaskData.{name} must be an int >= 0, got {value!r}")
        self.indices, self.slots = self._pair("indices", self.indices, "slots", self.slots)
        if self.indices.size == 0:
            raise ValueError("TaskData.indices must hold at least one training sample")
        if (self.memory_indices is None) != (self.memory_slots is None):
            raise ValueError("TaskData.memory_indices and memory_slots must be given together (or both None)")
        if self.memory_indices is not None:
            self.memory_indices, self.memory_slots = self._pair(
                "memory_indices", self.memory_indices, "memory_slots", self.memory_slots
            )

    def _pair(self, index_name: str, indices, slot_name: str, slots) -> tuple[np.ndarray, np.ndarray]:
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        if indices.shape != slots.shape:
            raise ValueError(f"TaskData.{index_name} and {slot_name} must have the same length, got {indices.size} and {slots.size}")
        if indices.size and (indices.min() < 0 or indices.max() >= len(self.source)):
            raise ValueError(f"TaskData.{index_name} must index {self.source.name} (size {len(self.source)})")
        if slots.size and slots.min() < 0:
            raise ValueError(f"TaskData.{slot_name} must be non-negative class slots, got minimum {slots.min()}")
        return indices, slots

    @property
    def has_memory(self) -> bool:
        return self.memory_indices is not None and self.memory_indices.size > 0


@dataclass
class TrainRecord:
    """One training summary (per epoch, or every ``log_every_steps`` steps).

    task/epoch: 0-based; step: optimiser steps done in this task so far; loss / loss_parts: means since the
    previous record (nats); lr at the last step; images_per_s: training throughput since the previous record;
    seconds: wall time since the previous record; metrics: model-selection Recall@1 values (fractions), if any.
    """

    task: int
    epoch: int
    step: int
    loss: float
    loss_parts: dict[str, float]
    lr: float
    images_per_s: float
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class TrainResult:
    """What ``train_task`` returns.

    model: trained model (the selected epoch's weights, on ``config.device``, eval mode). selected_epoch: 0-based.
    images_per_s: mean training throughput over the task. extra_state: adapters the method exports by name
    (compat_core.adapters.Adapter; FAN's psi_t). selection: per-epoch model-selection metrics (self / cross Recall@1 fractions), empty for "last".
    """

    model: nn.Module
    records: list[TrainRecord]
    selected_epoch: int
    images_per_s: float
    seconds: float
    extra_state: dict[str, Any] = field(default_factory=dict)
    selection: list[dict[str, float]] = field(default_factory=list)
    resumed_from_epoch: int | None = None  # completed epochs restored from an epoch checkpoint (None: fresh start)


ProgressHook = Callable[[int, int, int, float], None]


def _epoch_seed(seed: int, task: int, epoch: int) -> int:
    return int(np.random.SeedSequence([seed, task, epoch]).generate_state(1)[0])


def _augment_seed(seed: int, task: int) -> int:
    # a stream of its own (tag 1 in the 4th word), so batch order and augmentation never share draws
    return int(np.random.SeedSequence([seed, task, 0, 1]).generate_state(1)[0])


def epoch_batches(data: TaskData, method: Method, config: TrainConfig, epoch: int) -> Iterator[np.ndarray]:
    """Batches of positions for one epoch: ``< len(indices)`` are task samples, the rest memory samples.

    Replay methods with a memory use ``half_and_half_batches`` (or a joint shuffle with ``replay_sampling:
    mixed``); others shuffle the task data. A final batch of one sample is dropped (batch norm needs two).
    """
    seed = _epoch_seed(config.seed, data.task, epoch)
    num_task = data.indices.size
    task_positions = np.arange(num_task, dtype=np.int64)
    if method.uses_replay and data.has_memory:
        memory_positions = np.arange(num_task, num_task + data.memory_indices.size, dtype=np.int64)
        if config.replay_sampling == "half_and_half":
            batches: Iterator[np.ndarray] = half_and_half_batches(task_positions, memory_positions, config.batch_size,
                                                                  seed, epoch_length=config.epoch_length)
        else:
            order = np.random.default_rng(seed).permutation(np.concatenate([task_positions, memory_positions]))
            batches = iter(np.array_split(order, range(config.batch_size, order.size, config.batch_size)))
    else:
        order = np.random.default_rng(seed).permutation(task_positions)
        batches = iter(np.array_split(order, range(config.batch_size, order.size, config.batch_size)))
    for count, positions in enumerate(batches):
        if config.steps_per_epoch is not None and count >= config.steps_per_epoch:
            return
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size >= 2:
            yield positions


def _steps_per_epoch(data: TaskData, method: Method, config: TrainConfig) -> int:
    # counted from epoch 0 of the same sampler (sizes do not depend on the epoch's seed)
    return sum(1 for _ in epoch_batches(data, method, config, 0))


class _Loader:
    """Turns position batches into device ``Batch`` objects (read uint8 -> device -> transforms)."""

    def __init__(self, data: TaskData, model: nn.Module, device: torch.device, train: bool, augment: bool,
                 seed: int) -> None:
        self.data = data
        self.model = model
        self.device = device
        # augmentation draws from its own generator so that it repeats exactly for a given (seed, task)
        self.transform = make_transforms(data.source, train=train and augment, seed=seed)
        if data.has_memory:
            self.all_indices = np.concatenate([data.indices, data.memory_indices])
            self.all_slots = np.concatenate([data.slots, data.memory_slots])
        else:
            self.all_indices, self.all_slots = data.indices, data.slots
        self.num_task = data.indices.size

    def batch(self, positions: np.ndarray, images: torch.Tensor | None = None,
              rows: tuple[int, int] | None = None) -> Batch:
        """The device batch of ``positions``; ``images`` (uint8, already read, e.g. by the stream) or read here.

        rows: data-parallel training: ``images`` are rows [start, stop) of the global batch ``positions``."""
        if images is None:
            local = positions if rows is None else positions[rows[0] : rows[1]]
            images = torch.from_numpy(np.ascontiguousarray(self.data.source.read(self.all_indices[local])))
        draws = None if rows is None else (*rows, positions.size)
        images = prepare_batch(self.transform(images.to(self.device, non_blocking=True), draws), self.model)
        # pinned + non_blocking on CUDA: the host prepares the next step while this one runs (no sync per step)
        targets = to_device(torch.from_numpy(self.all_slots[positions]), self.device)
        is_memory = to_device(torch.from_numpy(positions >= self.num_task), self.device)
        return Batch(images=images, targets=targets, is_memory=is_memory, rows=rows)

    def memory_batches(self, batch_size: int) -> Iterator[Batch]:
        positions = np.arange(self.num_task, self.all_indices.size, dtype=np.int64)
        for start in range(0, positions.size, batch_size):
            yield self.batch(positions[start : start + batch_size])


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
                from compat_core.adapters import apply_chain

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

    checkpoints: where epoch checkpoints go (:mod:`pipelines.checkpoints`). The latest one is restored before the
    first epoch (after ``method.setup``, which sees the starting model as in an uninterrupted run), its records are
    re-emitted to ``on_record``, and training continues bit-identically on the CPU in fp32. A checkpoint is saved
    after every ``checkpoints.every_epochs`` epochs (not after the last: the stage commits then) and, when SIGTERM
    arrives, at the next step boundary; the process then ends as SIGTERM ends it, so Ray retries the task.
    Inside an initialised torch.distributed group of N ranks every rank trains its rows of each global batch under
    DDP and the loss sees the global batch (:mod:`pipelines.distributed`); ``parallel_key`` names the setting that
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

    def save(epochs_done: int, step_in_epoch: int, current: _Window) -> None:
        state = training_state(model, optimizer, scheduler, epochs_done=epochs_done, step_in_epoch=step_in_epoch,
                               step=step, extra_modules=extra_modules, augment_generator=loader.transform.generator,
                               selector=selector, records=records,
                               extras={"train_seconds": train_seconds, "train_images": train_images,
                                       "window": current.state()})
        from pipelines.checkpoints import EpochCheckpoint

        checkpoints.save(EpochCheckpoint(epochs_done, state))

    from pipelines.checkpoints import preemption_guard

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
                step += 1
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
            periodic = checkpoints is not None and checkpoints.every_epochs and done % checkpoints.every_epochs == 0
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
    )


def _rng_states(augment_generator: torch.Generator | None) -> dict[str, Any]:
    numpy_state = np.random.get_state()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"name": numpy_state[0], "keys": torch.from_numpy(numpy_state[1].astype(np.int64)),
                  "pos": int(numpy_state[2]), "has_gauss": int(numpy_state[3]), "cached": float(numpy_state[4])},
        "python": random.getstate(),
        "augment": augment_generator.get_state() if augment_generator is not None else None,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: Mapping[str, Any], augment_generator: torch.Generator | None) -> None:
    torch.set_rng_state(states["torch"])
    numpy_state = states["numpy"]
    np.random.set_state((numpy_state["name"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                         numpy_state["has_gauss"], numpy_state["cached"]))
    python = states["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    if augment_generator is not None and states.get("augment") is not None:
        augment_generator.set_state(states["augment"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, *, epochs_done: int,
                   step_in_epoch: int = 0, step: int = 0, extra_modules: Sequence[nn.Module] = (),
                   augment_generator: torch.Generator | None = None, selector: Any = None,
                   records: Sequence[TrainRecord] = (), extras: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The whole state of a training loop as a dict of tensors and plain data (``torch.load(weights_only=True)``
    reads it back): model, optimiser, scheduler, the method's extra modules, RNG states (torch, numpy, python, the
    augmentation generator, CUDA), sampler position (``epochs_done`` completed epochs + ``step_in_epoch`` steps of
    the next; batch order is seeded per epoch, so the position is the sampler's whole state), optimiser steps so
    far, model-selection state, the records emitted so far and loop ``extras`` (plain data or tensors)."""
    selection = None
    if selector is not None:
        selection = {"best_state": selector.best_state, "best_epoch": selector.best_epoch,
                     "best_self": float(selector.best_self), "history": list(selector.history)}
    return {
        "format": 1,
        "epochs_done": int(epochs_done),
        "step_in_epoch": int(step_in_epoch),
        "step": int(step),
        "model": model.state_dict(),
        "extra_modules": [module.state_dict() for module in extra_modules],
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": _rng_states(augment_generator),
        "selection": selection,
        "records": [asdict(record) for record in records],
        "extras": dict(extras or {}),
    }


def restore_training_state(state: Mapping[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer,
                           scheduler: Any, *, extra_modules: Sequence[nn.Module] = (),
                           augment_generator: torch.Generator | None = None, selector: Any = None) -> dict[str, Any]:
    """Load a :func:`training_state` dict into the given objects (built as for a fresh start, ``method.setup``
    done) and set the RNG states. Returns the position: ``epochs_done``, ``step_in_epoch``, ``step``, ``records``
    (TrainRecord list) and ``extras``."""
    if state.get("format") != 1:
        raise ValueError(f"epoch checkpoint format {state.get('format')!r}: expected 1")
    if len(state["extra_modules"]) != len(extra_modules):
        raise ValueError(f"epoch checkpoint holds {len(state['extra_modules'])} extra module(s) of the method, "
                         f"the method set up {len(extra_modules)}")
    model.load_state_dict(state["model"])
    for module, module_state in zip(extra_modules, state["extra_modules"]):
        module.load_state_dict(module_state)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if selector is not None and state.get("selection") is not None:
        selection = state["selection"]
        selector.best_state, selector.best_epoch = selection["best_state"], selection["best_epoch"]
        selector.best_self, selector.history = selection["best_self"], list(selection["history"])
    _set_rng_states(state["rng"], augment_generator)
    return {"epochs_done": int(state["epochs_done"]), "step_in_epoch": int(state["step_in_epoch"]),
            "step": int(state["step"]), "records": [TrainRecord(**record) for record in state["records"]],
            "extras": dict(state["extras"])}


class _Window:
    """Running sums of the loss and its parts between two records, kept as device tensors.

    ``add`` never reads a value back to the host; ``record`` does once (one device sync per record), and raises
    FloatingPointError when any step of the window had a non-finite loss (checked there, not per step, so that the
    training step does not wait for the accelerator).
    """

    def __init__(self) -> None:
        self.count = 0
        self.loss_sum: torch.Tensor | float = 0.0
        self.nonfinite: torch.Tensor | int = 0
        self.part_sums: dict[str, torch.Tensor | float] = {}
        self.images = 0
        self.seconds = 0.0

    def state(self) -> dict[str, Any]:
        """The sums as plain data / CPU tensors (a checkpoint taken mid-epoch keeps the epoch's record exact)."""
        cpu = lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v  # noqa: E731
        return {"count": self.count, "loss_sum": cpu(self.loss_sum), "nonfinite": cpu(self.nonfinite),
                "part_sums": {k: cpu(v) for k, v in self.part_sums.items()}, "images": self.images,
                "seconds": self.seconds}

    @classmethod
    def from_state(cls, state: Mapping[str, Any], device: torch.device) -> "_Window":
        window = cls()
        on = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
        window.count, window.images, window.seconds = int(state["count"]), int(state["images"]), state["seconds"]
        window.loss_sum, window.nonfinite = on(state["loss_sum"]), on(state["nonfinite"])
        window.part_sums = {k: on(v) for k, v in state["part_sums"].items()}
        return window

    def add(self, loss: torch.Tensor, parts: Mapping[str, Any], images: int, seconds: float) -> None:
        self.count += 1
        loss = loss.detach().float()
        self.loss_sum = self.loss_sum + loss
        self.nonfinite = self.nonfinite + (~torch.isfinite(loss)).int()
        for key, value in parts.items():
            value = value.detach().float() if isinstance(value, torch.Tensor) else float(value)
            self.part_sums[key] = self.part_sums.get(key, 0.0) + value
        self.images += images
        self.seconds += seconds

    def record(self, task: int, epoch: int, step: int, optimizer: torch.optim.Optimizer,
               metrics: Mapping[str, float] | None = None, method_name: str = "") -> TrainRecord:
        count = max(self.count, 1)
        names = list(self.part_sums)
        # one transfer for the loss, the non-finite count and every part
        device = self.loss_sum.device if isinstance(self.loss_sum, torch.Tensor) else None
        # float parts (e.g. a schedule weight) join the device tensors, so one copy reads everything
        values = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=device).reshape(())
                              for v in [self.loss_sum, self.nonfinite, *(self.part_sums[n] for n in names)]])
        host = values.cpu().tolist() if self.count else [math.nan, 0.0] + [0.0] * len(names)
        loss_sum, nonfinite, part_values = host[0], int(host[1]), host[2:]
        parts = {name: value / count for name, value in zip(names, part_values)}
        if nonfinite:
            raise FloatingPointError(
                f"method {method_name!r}: non-finite loss in {nonfinite} of the {self.count} steps ending at step "
                f"{step} (task {task}, epoch {epoch}; mean {loss_sum / count}, parts {parts}); lower training.optimizer.lr"
            )
        return TrainRecord(
            task=task,
            epoch=epoch,
            step=step,
            loss=loss_sum / count if self.count else math.nan,
            loss_parts=parts,
            lr=float(optimizer.param_groups[0]["lr"]),
            images_per_s=self.images / max(self.seconds, 1e-9),
            seconds=self.seconds,
            metrics=dict(metrics or {}),
        )


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
        from compat_core.losses import simplex_cross_entropy

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
    "AUTOCAST_MODES",
    "SelectionSplit",
    "SupervisedPretraining",
    "TaskData",
    "TrainConfig",
    "TrainRecord",
    "TrainResult",
    "autocast_mode",
    "compute_features",
    "epoch_batches",
    "precision_context",
    "example_batch",
    "prepare_model",
    "pretrain_model",
    "restore_training_state",
    "snapshot_state",
    "train_task",
    "training_state",
]

"""The trainer of one task: :class:`Trainer` prepares, resumes, runs epochs, checkpoints, selects a model, finishes.

``Trainer(...).fit()`` is the whole life of a task, in this order::

    prepare()   model weights and classes, the task's data (its input stream opened here with
                training.prefetch_first_batches), precision and layout, method setup, optimiser, schedule, compile,
                data-parallel wrap,
                model selection (in the order that fixes the random draws: a task seeded alike trains alike)
    resume()    the latest epoch checkpoint, if any: weights, optimiser, schedule, RNG states, records, statistics
    run()       the planned epochs over one input stream: run_epoch() steps, end_epoch() records and checkpoints
    finish()    the selected epoch's weights and the TrainResult

The method (:mod:`pipelines.methods`) only turns a batch into a loss. Nothing here talks to a tracker: progress goes
to a callable and summaries to ``on_record`` as plain :class:`TrainRecord` dataclasses.
"""
from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch
from torch import nn

from compat_core.data.replay_parquet import encoded_images
from compat_core.data.stream import keep_rows, stream_batches, stream_encoded
from compat_core.hardware.calibration import calibration_enabled
from compat_core.models.precision import has_convolutions
from pipelines.methods.objective import Method, TaskContext
from pipelines.training import distributed
from pipelines.training.autocast import (autocast_mode, example_batch, precision_context, prepare_model,
                                         resolve_autocast, resolve_channels_last, resolve_compile)
from pipelines.training.checkpoints import CheckpointSink, EpochCheckpoint, PreemptionFlag, preemption_guard
from pipelines.training.records import ProgressHook, TrainRecord, TrainResult, _Window
from pipelines.training.selection import CompatibilitySelector
from pipelines.training.settings import TrainConfig
from pipelines.training.loop_state import restore_training_state, training_state
from pipelines.training.loop_stats import InputStall, LoopStatistics
from pipelines.training.optimisation import lr_factor, make_optimizer, parameter_groups
from pipelines.training.batches import _Loader
from pipelines.training.task_data import TaskData, _augment_seed, _steps_per_epoch, epoch_batches


def check_model_for_method(model: nn.Module, method: Method, data: TaskData) -> None:
    """ValueError when ``model``'s classifier, slots or initial weights do not fit ``method`` and ``data``."""
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


@dataclass(frozen=True)
class ResumePoint:
    """Where the loop starts: 0-based ``epoch``, of which ``step_in_epoch`` steps are already done.

    from_checkpoint: completed epochs of the restored checkpoint (None: a fresh start)."""

    epoch: int = 0
    step_in_epoch: int = 0
    from_checkpoint: int | None = None


@dataclass(frozen=True)
class EpochPlan:
    """One epoch still to run: its global ``batches`` in order, ``skip`` of them already done (a checkpoint saved
    mid-epoch), and this rank's ``local`` batches still to run (all remaining batches on one worker)."""

    epoch: int
    batches: list[np.ndarray]
    skip: int
    local: list[np.ndarray]


def plan_epochs(data: TaskData, method: Method, config: TrainConfig, start: ResumePoint,
                parallel: distributed.DataParallel | None = None) -> list[EpochPlan]:
    """The epochs from ``start`` to ``config.epochs``: the batch order of each (seeded per epoch, so the position
    is the sampler's whole state), the first one without its ``start.step_in_epoch`` steps already done."""
    plans = []
    for epoch in range(start.epoch, config.epochs):
        batches = list(epoch_batches(data, method, config, epoch))
        skip = start.step_in_epoch if epoch == start.epoch else 0
        remaining = batches[skip:]
        plans.append(EpochPlan(epoch, batches, skip,
                               remaining if parallel is None else distributed.shard_batches(parallel, remaining)))
    return plans


class Trainer:
    """Trains ``model`` on one task with ``method`` (see :func:`pipelines.training.loop.train_task` for the
    arguments); :meth:`fit` runs the steps below in order and returns the :class:`TrainResult`."""

    def __init__(self, model: nn.Module, old_model: nn.Module | None, method: Method, data: TaskData,
                 config: TrainConfig, on_record: Callable[[TrainRecord], None] | None = None,
                 progress: ProgressHook | None = None, checkpoints: CheckpointSink | None = None,
                 parallel_key: str = "resources.finetune.num_workers") -> None:
        if not isinstance(method, Method):
            raise ValueError(f"method must be a pipelines.methods Method, got {type(method).__name__}")
        if not isinstance(config, TrainConfig):
            raise ValueError(f"config must be a TrainConfig, got {type(config).__name__}")
        check_model_for_method(model, method, data)
        if config.model_selection == "compatibility" and data.selection is None:
            raise ValueError("TrainConfig.model_selection 'compatibility' needs TaskData.selection (a held-out split)")
        self.model, self.old_model, self.method, self.data, self.config = model, old_model, method, data, config
        self.on_record, self.progress, self.checkpoints = on_record, progress, checkpoints
        self.parallel_key = parallel_key
        self.device = torch.device(config.device)
        self.parallel = distributed.current()
        self.records: list[TrainRecord] = []
        self.stats = LoopStatistics()
        self.window = _Window()
        self.selector: CompatibilitySelector | None = None
        self.early_stream: tuple[tuple[int, int], list[EpochPlan], Iterator] | None = None  # see prepare()

    def fit(self) -> TrainResult:
        """prepare, resume, run, finish."""
        try:
            self.prepare()
            start = self.resume()
            self.run(start)
        finally:
            self._close_early_stream()  # a failure before the epochs: stop the reads opened in prepare
        return self.finish(start)

    # ---- prepare -------------------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Everything the epochs need, built in a fixed order (module initialisation draws from the torch generator
        seeded here; the restored RNG states of a resumed task are set after all of it, in :meth:`resume`)."""
        self.prepare_started = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        torch.manual_seed(self.config.seed)
        self._prepare_weights()
        self._prepare_data()  # the batch order needs neither the precision nor the layout
        if self.config.prefetch_first_batches:  # the workers decode the first batches while the rest is prepared
            self.early_stream = self._open_stream(ResumePoint())
        self._resolve_precision()
        self._setup_method()
        self._prepare_optimisation()
        self._compile_step()
        if self.parallel is not None:
            self._wrap_data_parallel()
        if self.config.model_selection == "compatibility":
            self.selector = CompatibilitySelector(self.data.selection, self.old_model, self.method, self.device,
                                                  self.config)
        self.task_started = time.perf_counter()
        self.loop_started_unix = time.time()
        self.stall = InputStall(self.device)

    def _prepare_weights(self) -> None:
        """CoReS-like methods restart from the initial weights; learnable classifiers grow to the largest slot."""
        model, data = self.model, self.data
        if data.initial_state is not None and self.method.retrain_from_scratch:
            model.load_state_dict(dict(data.initial_state))
        if self.method.classifier == "learnable":
            needed = int(data.slots.max()) + 1
            if data.has_memory:
                needed = max(needed, int(data.memory_slots.max()) + 1)
            if needed > model.num_active_classes:
                model.expand_classes(needed)

    def _resolve_precision(self) -> None:
        """``autocast: auto`` and ``channels_last: auto`` measured on an example batch (every rank takes rank 0's
        choices); both models moved to the device in that precision and layout, the old one frozen in eval mode."""
        config, device = self.config, self.device
        if autocast_mode(config.autocast) == "auto":
            example = example_batch(self.data.source, self.data.indices, config.batch_size, device)
            config = config.model_copy(update={"autocast": resolve_autocast("auto", device, self.model, example)})
        if self.parallel is not None:  # every rank computes in rank 0's precision (its measured "auto" choice)
            config = config.model_copy(update={"autocast": self.parallel.agree(config.autocast)})
        example = None  # read only where the probe may run (calibration off: auto is off, nothing is read)
        if config.channels_last == "auto" and has_convolutions(self.model) and calibration_enabled():
            example = example_batch(self.data.source, self.data.indices, config.batch_size, device)
        config = config.model_copy(update={"channels_last": resolve_channels_last(
            config.channels_last, device, self.model, example, config.autocast)})
        if self.parallel is not None:
            config = config.model_copy(update={"channels_last": self.parallel.agree(config.channels_last)})
        self.config = config
        prepare_model(self.model, device, config.autocast, config.channels_last)
        if self.old_model is not None:
            prepare_model(self.old_model, device, config.autocast, config.channels_last)
            self.old_model.eval()
            self.old_model.requires_grad_(False)

    def _prepare_data(self) -> None:
        data, config = self.data, self.config
        self.loader = _Loader(data, self.model, self.device, train=True, augment=config.augment,
                              seed=_augment_seed(config.seed, data.task))
        # every epoch reads these rows in a new random order: sources over row-group storage keep them in memory (read
        # once, in storage order) before the input workers fork
        keep_rows(data.source, self.loader.all_indices)
        if config.decode == "gpu" and encoded_images(data.source, self.loader.all_indices[:1]) is None:
            raise ValueError(f"training.decode: gpu decodes encoded images on the device, and the pool "
                             f"{getattr(data.source, 'name', 'source')!r} holds decoded pixels; use a pool of JPEG "
                             f"files (e.g. ingested shards) or decode: cpu")
        self.steps_per_epoch = _steps_per_epoch(data, self.method, config)
        if self.steps_per_epoch == 0:
            raise ValueError(f"task {data.task} yields no batch of >= 2 samples with batch_size {config.batch_size}")

    def _setup_method(self) -> None:
        """The method's task context and setup (in eval mode: setup statistics such as old-class centres must not
        update batch-norm buffers); the extra modules it returns train with the model."""
        data, config = self.data, self.config
        # summaries taken in setup (old-class centres, synthesised classifier rows) see un-augmented images
        eval_loader = _Loader(data, self.model, self.device, train=False, augment=False, seed=0)
        memory_iterator = None
        if data.has_memory:
            memory_iterator = lambda: eval_loader.memory_batches(config.eval_batch_size)  # noqa: E731
        self.ctx = TaskContext(model=self.model, old_model=self.old_model, task=data.task,
                               num_old_classes=data.num_old_classes, num_new_classes=data.num_new_classes,
                               hparams=self.method.hparams, device=self.device, iterate_memory=memory_iterator,
                               iterate_task=lambda: eval_loader.task_batches(config.eval_batch_size),
                               steps_per_epoch=self.steps_per_epoch, epochs=config.epochs)
        self.model.eval()
        with precision_context(self.device, config.autocast):
            self.extra_modules = self.method.setup(self.ctx)
        for module in self.extra_modules:
            module.to(self.device).train()

    def _prepare_optimisation(self) -> None:
        named = list(self.model.named_parameters())
        for number, module in enumerate(self.extra_modules):
            named.extend((f"extra{number}.{name}", p) for name, p in module.named_parameters())
        self.optimizer = make_optimizer(parameter_groups(named, self.config), self.config)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(self.config, self.steps_per_epoch))
        self.total_steps = self.config.epochs * self.steps_per_epoch

    def _compile_step(self) -> None:
        """``training.compile``: "auto" measured here when the run did not resolve it (a direct call of the loop;
        every rank takes rank 0's choice); "on" makes the method see compiled forwards of the model and the old
        model (sharing their parameters: checkpoints, selection and the result keep the plain modules)."""
        config = self.config
        if config.compile == "auto":
            example = example_batch(self.data.source, self.data.indices, config.batch_size, self.device)
            config = config.model_copy(update={"compile": resolve_compile(
                "auto", self.device, self.model, example, self.total_steps, config.batch_size, config.autocast)})
        if self.parallel is not None:
            config = config.model_copy(update={"compile": self.parallel.agree(config.compile)})
        self.config = config
        self.step_model: nn.Module = self.model
        if config.compile == "on":
            self.step_model = torch.compile(self.model)
            self.ctx.model = self.step_model
            if self.old_model is not None:
                self.ctx.old_model = torch.compile(self.old_model)

    def _wrap_data_parallel(self) -> None:
        """DDP over this rank's rows; the method sees global outputs of both models."""
        parallel, model, old_model = self.parallel, self.model, self.old_model
        parallel.check_batches([positions.size for positions in epoch_batches(self.data, self.method, self.config, 0)],
                               self.parallel_key)
        self.ctx.model = distributed.GlobalBatchModel(distributed.wrap_model(self.step_model, self.device), model,
                                                      parallel)
        if old_model is not None:
            self.ctx.old_model = distributed.GlobalBatchModel(self.ctx.old_model, old_model, parallel)

    # ---- resume --------------------------------------------------------------------------------------------------
    def resume(self) -> ResumePoint:
        """Restore the latest epoch checkpoint (after the method's setup, which sees the starting model as in an
        uninterrupted run) and re-emit its records; returns where the loop starts."""
        latest = self.checkpoints.load_latest() if self.checkpoints is not None else None
        if latest is None:
            return ResumePoint()
        position = restore_training_state(latest.state, self.model, self.optimizer, self.scheduler,
                                          extra_modules=self.extra_modules,
                                          augment_generator=self.loader.transform.generator, selector=self.selector)
        self.stats.restore(position["step"], position["extras"])
        self.window = _Window.from_state(position["extras"]["window"], self.device)
        for record in position["records"]:
            self._emit(record)
        return ResumePoint(position["epochs_done"], position["step_in_epoch"], latest.epochs_done)

    # ---- run -----------------------------------------------------------------------------------------------------
    def run(self, start: ResumePoint) -> None:
        """Every planned epoch over one input stream: the next batches are read and decoded on CPU workers while a
        step runs (same order for a seed), and the workers start once and read the next epoch's first batches while
        an epoch ends. SIGTERM is answered at the next step boundary (see :meth:`end_epoch`)."""
        if self.early_stream is not None and self.early_stream[0] == (start.epoch, start.step_in_epoch):
            (_, plans, stream), self.early_stream = self.early_stream, None
        else:  # opened late (training.prefetch_first_batches off), or a checkpoint moved the start
            self._close_early_stream()
            _, plans, stream = self._open_stream(start)
        with preemption_guard(enabled=self.checkpoints is not None) as preempted, contextlib.closing(stream):
            for plan in plans:
                self.run_epoch(plan, stream, preempted)
                self.end_epoch(plan.epoch, preempted)

    def _open_stream(self, start: ResumePoint) -> tuple[tuple[int, int], list[EpochPlan], Iterator]:
        """The epochs from ``start`` and their input stream, opened: its workers start reading the first batches
        now (``compat_core.data.stream.stream_batches``)."""
        plans = plan_epochs(self.data, self.method, self.config, start, self.parallel)
        batches = [b for plan in plans for b in plan.local]
        if self.config.decode == "gpu":  # bytes here, decoded on the device by the loader
            return (start.epoch, start.step_in_epoch), plans, stream_encoded(self.data.source, self.loader.all_indices,
                                                                             batches)
        stream = stream_batches(self.data.source, self.loader.all_indices, batches,
                                workers=self.config.input_workers, prefetch=self.config.prefetch_batches,
                                pin_memory=self.device.type == "cuda", persistent=self.config.persistent_workers)
        return (start.epoch, start.step_in_epoch), plans, stream

    def _close_early_stream(self) -> None:
        if self.early_stream is not None:
            self.early_stream[2].close()
            self.early_stream = None

    def run_epoch(self, plan: EpochPlan, stream: Iterator[tuple[np.ndarray, torch.Tensor]],
                  preempted: PreemptionFlag) -> None:
        """This rank's batches of ``plan`` from ``stream``: one optimiser step each, with progress and records."""
        self.model.train()
        started = time.perf_counter()  # a step's time includes any wait for its batch
        for in_epoch, (positions, images) in enumerate(itertools.islice(stream, len(plan.local)), start=plan.skip + 1):
            self.stall.batch_arrived(time.perf_counter() - started)
            if self.parallel is not None:  # the step's targets are the global batch's
                positions = plan.batches[in_epoch - 1]
            loss, parts = self.train_step(positions, images)
            seconds = time.perf_counter() - started
            started = time.perf_counter()
            self._after_step(plan.epoch, positions, loss, parts, seconds)
            if preempted and in_epoch < len(plan.batches):  # preemption: save now, the grace period is short
                self.save_checkpoint(plan.epoch, in_epoch)
                preempted.exit(f"task {self.data.task}: SIGTERM received; checkpoint at epoch {plan.epoch} step "
                               f"{in_epoch} saved, exiting so that the stage is retried from it")

    def train_step(self, positions: np.ndarray, images: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """One optimiser step on the batch ``positions`` (``images``: this rank's rows); returns the loss and its
        parts, still on the device (nothing is read back to the host)."""
        if self.parallel is None:
            batch = self.loader.batch(positions, images)
        else:  # this rank's images, the global batch's targets; the models return global outputs
            batch = self.loader.batch(positions, images, self.parallel.rows(positions.size))
            for wrapper in (self.ctx.model, self.ctx.old_model):
                if wrapper is not None:
                    wrapper.total = positions.size
        self.ctx.step = self.stats.step
        with precision_context(self.device, self.config.autocast):
            loss, parts = self.method.loss(batch, self.ctx)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.stall.step_queued()
        self.stats.step += 1
        if self.stats.first_step_seconds is None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # once: the first step really done, not only queued
            self.stats.first_step_seconds = time.perf_counter() - self.prepare_started
        return loss, parts

    def _after_step(self, epoch: int, positions: np.ndarray, loss: torch.Tensor, parts: dict[str, Any],
                    seconds: float) -> None:
        self.stats.add_step(int(positions.size), seconds)
        # running sums stay on the device: the host reads them only when a record is emitted (no step sync)
        self.window.add(loss.detach(), parts, int(positions.size), seconds)
        if self.progress is not None:
            self.progress(epoch, self.stats.step, self.total_steps, self.stats.images_per_s)
        if self.config.log_every_steps and self.stats.step % self.config.log_every_steps == 0:
            self._emit(self._window_record(epoch))
            self.window = _Window()

    def end_epoch(self, epoch: int, preempted: PreemptionFlag) -> None:
        """Model selection (every rank: same weights), the epoch's record, and a checkpoint when the policy wants
        one (not after the last epoch: the stage commits next) or SIGTERM arrived (then the process ends as
        SIGTERM ends it, so that the stage is retried from the checkpoint)."""
        metrics = self.selector.observe(epoch, self.model) if self.selector is not None else {}
        if self.window.count or metrics:
            self._emit(self._window_record(epoch, metrics))
        self.window = _Window()
        done = epoch + 1
        if self._checkpoint_due(done, preempted):
            self.save_checkpoint(done, 0)
        if preempted:
            preempted.exit(f"task {self.data.task}: SIGTERM received; checkpoint after {done} epoch(s) saved, "
                           f"exiting so that the stage is retried from it")

    def _checkpoint_due(self, epochs_done: int, preempted: PreemptionFlag) -> bool:
        if self.checkpoints is None:
            return False
        periodic = epochs_done < self.config.epochs and self.checkpoints.policy.due(epochs_done)
        if self.parallel is not None:
            periodic = self.parallel.agree(periodic)  # every rank saves at the same epoch ends (a barrier in Ray Train)
        return bool(periodic or preempted)

    def save_checkpoint(self, epochs_done: int, step_in_epoch: int) -> None:
        """The whole loop state (:func:`pipelines.training.loop_state.training_state`) to the checkpoint sink."""
        write_started = time.perf_counter()
        state = training_state(self.model, self.optimizer, self.scheduler, epochs_done=epochs_done,
                               step_in_epoch=step_in_epoch, step=self.stats.step, extra_modules=self.extra_modules,
                               augment_generator=self.loader.transform.generator, selector=self.selector,
                               records=self.records, extras=self.stats.checkpoint_extras(self.window))
        self.checkpoints.save(EpochCheckpoint(epochs_done, state))
        self.checkpoints.policy.wrote(time.perf_counter() - write_started)
        self.stats.add_checkpoint(time.perf_counter() - write_started)

    def _window_record(self, epoch: int, metrics: Mapping[str, float] | None = None) -> TrainRecord:
        return self.window.record(self.data.task, epoch, self.stats.step, self.optimizer, metrics,
                                  method_name=self.method.name)

    def _emit(self, record: TrainRecord) -> None:
        self.records.append(record)
        if self.on_record is not None:
            self.on_record(record)

    # ---- finish --------------------------------------------------------------------------------------------------
    def selected_epoch(self) -> int:
        """The epoch whose weights the task keeps: the selector's best, else the last (0-based)."""
        if self.selector is not None and self.selector.best_state is not None:
            return int(self.selector.best_epoch)
        return self.config.epochs - 1

    def finish(self, start: ResumePoint) -> TrainResult:
        """Load the selected epoch's weights (unless it is the last) and describe the task."""
        selected = self.selected_epoch()
        if selected != self.config.epochs - 1:
            self.model.load_state_dict(self.selector.best_state)
        self.model.eval()
        cuda = self.device.type == "cuda"
        return TrainResult(
            model=self.model,
            records=self.records,
            selected_epoch=selected,
            images_per_s=self.stats.images_per_s,
            seconds=time.perf_counter() - self.task_started,
            extra_state=self.method.export_state(),
            selection=[] if self.selector is None else self.selector.history,
            resumed_from_epoch=start.from_checkpoint,
            input_stall_seconds=self.stall.seconds,
            loop_unix_seconds=(self.loop_started_unix, time.time()),
            first_step_seconds=self.stats.first_step_seconds,
            peak_device_memory_bytes=int(torch.cuda.max_memory_allocated(self.device)) if cuda else None,
            checkpoints_written=self.stats.checkpoints_written,
            checkpoint_seconds=self.stats.checkpoint_seconds,
        )


__all__ = ["EpochPlan", "InputStall", "LoopStatistics", "ResumePoint", "Trainer", "check_model_for_method",
           "lr_factor", "make_optimizer", "parameter_groups", "plan_epochs"]

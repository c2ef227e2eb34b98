"""The training settings: one pydantic schema for the config's ``training`` section and for the training loop.

``ScenarioConfig.training`` is a :class:`TrainConfig` as written in the YAML; a stage trains with
``ScenarioConfig.train_config(seed, device)``, the same model with the values other sections own bound in (see
BOUND_FIELDS). ``pipelines.training.loop.train_task`` takes it as is, so no field is copied from one schema to another.
Kept free of torch so configs validate without it.
"""
from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_LR = 10.0  # a learning rate above this diverges at once with every optimiser the project has
MAX_INPUT_WORKERS = 64  # each worker holds a process and its pipes: thousands exhaust the open-file limit
SEED_LIMIT = 2 ** 63  # seeds are in [0, 2^63)


_PLAIN_DEVICE = re.compile(r"(cpu|meta|mps|cuda)(:\d+)?")
AUTOCAST_MODES = ("auto", "bf16", "fp16", "off")
COMPILE_MODES = ("auto", "on", "off")
CHANNELS_LAST_MODES = ("auto", "on", "off")
# the arithmetic each resolved autocast setting trains and extracts in ("auto": not resolved yet)
PRECISION_NAMES = {"off": "fp32", "bf16": "bf16", "fp16": "fp16", "auto": "auto"}


def cuda_available() -> bool:
    """Whether torch sees a CUDA device here (imports torch: called only for a setting that needs CUDA)."""
    import torch

    return bool(torch.cuda.is_available())


def autocast_mode(value: object) -> str:
    """Normalise an autocast setting: True -> "auto", False -> "off", or one of AUTOCAST_MODES (ValueError else)."""
    if value is True:
        return "auto"
    if value is False:
        return "off"
    if value not in AUTOCAST_MODES:
        raise ValueError(f"autocast must be true, false or one of {AUTOCAST_MODES}, got {value!r}")
    return str(value)


def precision_name(value: object) -> str:
    """fp32 | bf16 | fp16 (or auto, unresolved) of an autocast setting."""
    return PRECISION_NAMES[autocast_mode(value)]


class StrictModel(BaseModel):
    """Base for every config section: unknown keys are errors, so a typo never silently keeps a default."""

    model_config = ConfigDict(extra="forbid", validate_assignment=False, allow_inf_nan=False)


class OptimizerSpec(StrictModel):
    name: Literal["sgd", "adamw"] = "sgd"
    lr: float = Field(0.1, gt=0.0, le=MAX_LR, description="peak learning rate (finite, at most 10)")
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="SGD momentum (ignored by adamw)")
    weight_decay: float = Field(5e-4, ge=0.0)
    weight_decay_exclude: Literal["none", "norm_and_bias"] = Field(
        "none", description="none: weight decay on every trained parameter; norm_and_bias: none on parameters of "
        "fewer than 2 dimensions (normalisation gains and shifts, biases), as the public IAM-CL2R script "
        "(src/iamcl2r/main.py:147-156)")


class ScheduleSpec(StrictModel):
    """cosine: from the lr to ``min_lr`` after warm-up, annealed per optimiser step (``interval: step``) or once per
    epoch (``interval: epoch``: epoch e trains at min_lr + (lr - min_lr)(1 + cos(pi e / E)) / 2, as PyTorch's
    CosineAnnealingLR(T_max=epochs, eta_min=min_lr) stepped after every epoch, the public IAM-CL2R script's
    schedule, src/iamcl2r/main.py:162,207); constant; step: multiply by ``gamma`` at each milestone epoch."""

    name: Literal["cosine", "constant", "step"] = "constant"
    milestones: list[int] = Field(default_factory=list, description="epochs (0-based) where step divides the lr")
    gamma: float = Field(0.1, gt=0.0, description="lr multiplier at each milestone (step schedule)")
    min_lr: float = Field(0.0, ge=0.0, description="cosine: the lr it anneals to (absolute; below optimizer.lr)")
    interval: Literal["step", "epoch"] = Field("step", description="cosine: anneal per optimiser step or per epoch")

    @model_validator(mode="after")
    def _milestones_for_step(self) -> "ScheduleSpec":
        if self.name == "step" and not self.milestones:
            raise ValueError("schedule.milestones: the step schedule needs at least one epoch, e.g. [50, 64]")
        if self.milestones != sorted(self.milestones) or any(m < 1 for m in self.milestones):
            raise ValueError(f"schedule.milestones must be increasing epochs >= 1, got {self.milestones}")
        if self.name != "cosine" and (self.min_lr or self.interval != "step"):
            raise ValueError(f"schedule.min_lr and schedule.interval apply to the cosine schedule only, got name "
                             f"{self.name!r} with min_lr {self.min_lr} and interval {self.interval!r}")
        return self


# Fields the training loop needs whose value another config section owns: a stage binds them
# (ScenarioConfig.train_config); the YAML's training section may not set them, and they are never dumped.
BOUND_FIELDS = {
    "seed": "'seed' (per task: seed * 1000 + task; pretrain[i].seed for a pre-training stage)",
    "device": "'device'",
    "epoch_length": "'replay.epoch_length'",
    "selection_strict": "'evaluation.strict'",
    "eval_batch_size": "'evaluation.batch_size'",
}
# What a pretrain entry may override (None there: the training section's value).
PRETRAIN_OVERRIDES = ("epochs", "batch_size", "optimizer", "schedule")


class TrainConfig(StrictModel):
    """How one task is trained: every fine-tuning / replacement task, and pre-training with its entry's overrides.

    epochs: passes over the task data (or ``steps_per_epoch`` steps each). warmup_epochs: linear warm-up from
    lr / warmup steps. replay_sampling: "half_and_half" (every batch half memory, half task: the public reference)
    or "mixed" (memory and task samples shuffled together). epoch_length (half_and_half): "task" (one pass over the
    task data, batch_size // 2 task samples per batch) or "reference" ((task + memory) // batch_size batches, as the
    public CL2R / IAM-CL2R BalancedBatchSampler). model_selection: "last" or "compatibility" (CoReS Sec. 8.2; needs
    ``TaskData.selection``). log_every_steps: also emit a record every N steps (0: per-epoch records only).
    """

    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    epochs: int = Field(1, ge=1)
    warmup_epochs: int = Field(0, ge=0, description="epochs of linear lr warm-up (< epochs)")
    batch_size: int = Field(128, ge=2, description="at least 2: batch norm needs two samples per batch")
    steps_per_epoch: int | None = Field(None, ge=1, description="cap on optimiser steps per epoch (None: one pass)")
    model_selection: Literal["last", "compatibility"] = Field(
        "last", description="last epoch, or CoReS Sec. 8.2 compatibility-based selection on a held-out split"
    )
    selection_holdout: float = Field(0.1, gt=0.0, lt=1.0, description="fraction of task data held out for selection")
    autocast: bool | Literal["auto", "bf16", "fp16", "off"] = Field(
        True, description="true/auto: bf16/fp16 autocast only where a measured step of the model is faster than fp32 "
        "(compat_core.hardware.calibration, cached per machine); bf16/fp16: force that dtype; false/off: fp32")
    compile: Literal["auto", "on", "off"] = Field(
        "off", description="on: the model's forward (and so its backward) compiled with torch.compile; auto: "
        "compiled only where a timed probe (compile time counted, cached per machine, batch shape and torch version) "
        "says it pays over the stage's steps; off (default): eager. Changes numerics at rounding level, so the "
        "resolved value is in every training stage's key")
    channels_last: Literal["auto", "on", "off"] = Field(
        "auto", description="the memory layout of a convolutional backbone's weights and batches in training. on: "
        "channels_last (NHWC); off: contiguous (NCHW); auto (default): channels_last only where a timed training "
        "step of the model in both layouts (under the resolved autocast, cached per machine, batch shape and torch "
        "version) says it is faster; off without measuring for a backbone without convolutions or with "
        "calibration off. on is refused for a backbone without convolutions. Changes numerics at rounding level, "
        "so the resolved value is in every training stage's key")
    decode: Literal["cpu", "gpu"] = Field(
        "cpu", description="where the training batches' JPEGs are decoded. cpu (default): by the pool's reader, in "
        "the input workers; gpu: on the CUDA training device (torchvision.io.decode_jpeg with nvJPEG, the crop and "
        "resize there too; compat_core.data.device_decode), the CPU only gathering bytes, for pools of encoded "
        "images (ingested shards). Refused at load on a machine without CUDA. Pixels differ from the CPU decoders "
        "by rounding-level amounts, so the value is in every training stage's key")
    augment: bool = Field(True, description="training augmentation of the dataset's transforms")
    drop_last: bool = Field(False, description="drop an epoch's last partial batch (the public IAM-CL2R script's "
                            "first task: DataLoader(drop_last=True), src/iamcl2r/main.py:181-183; its replay batches "
                            "are always full); false keeps it when it holds >= 2 samples")
    replay_sampling: Literal["half_and_half", "mixed"] = "half_and_half"
    input_workers: int = Field(0, ge=0, le=MAX_INPUT_WORKERS, description="CPU processes that read and decode the next batches while a "
                               "step runs (0: in the training thread). One worker delivers ~3,000-3,800 images/s "
                               "of 224 px CelebA-sized JPEG from ingested shards with decoder torchvision, ~1,200 "
                               "with PIL, on one AMD EPYC core (benchmarks/input_pipeline.py)")
    prefetch_batches: int = Field(2, ge=1, description="batches read ahead per input worker")
    persistent_workers: bool = Field(
        False, description="keep the input workers alive after a task for the next task of the same pool in the same "
        "process (no worker start-up from the second task on; compat_core.data.stream). Off by default: rows the "
        "next task keeps in memory (ingested shards) are then read from storage by the workers. A task with replay "
        "memory keeps the pool's workers too: its memory reaches them as files in shared memory, written once per "
        "task. Another pool stops the process's earlier one (one pool per process). Not part of any stage key")
    prefetch_first_batches: bool = Field(
        True, description="with input workers: open the task's input stream as soon as its batch order is known, so "
        "the workers decode its first batches while the precision and layout probes, the method's setup, the "
        "optimiser, compile and a checkpoint's restore run and the first step does not wait for them (false: opened when the epochs start). The same "
        "batches in the same order either way. Not part of any stage key")
    log_every_steps: int = Field(0, ge=0)
    checkpoint_every_epochs: int | None = Field(
        None, ge=0, description="pretrain / fine-tune stages save their training state to the run store at epoch "
        "ends (and on SIGTERM) and a restarted stage resumes from the latest one. null (default): by time, see "
        "checkpoint_every_minutes; N: after every N epochs; 0: off. Not part of any stage key")
    checkpoint_every_minutes: float = Field(
        10.0, ge=0.0, le=1e6, allow_inf_nan=False, description="with checkpoint_every_epochs null: save at the first "
        "epoch end at least this long after the previous save, and at least 50x the previous write's time after it "
        "(writes <= 2 % of training time). Not part of any stage key")

    # bound by the stage from other sections (BOUND_FIELDS); defaults serve direct calls of the loop
    seed: int = Field(0, ge=0, lt=2 ** 64, exclude=True)  # torch's seed range (per-task seeds are derived)
    device: str = Field("cpu", exclude=True, description="torch device string, e.g. cpu or cuda:0")
    epoch_length: Literal["task", "reference"] = Field("task", exclude=True)
    selection_strict: bool = Field(True, exclude=True)
    eval_batch_size: int = Field(256, ge=1, exclude=True)

    @field_validator("device")
    @classmethod
    def _torch_device(cls, value: str) -> str:
        if _PLAIN_DEVICE.fullmatch(value):  # torch.device accepts these as they are: no torch needed (compat plan)
            return value
        import torch  # only for other device strings, so configs validate and plans count without torch

        try:
            torch.device(value)
        except (RuntimeError, TypeError):
            raise ValueError(f"must be a torch device string such as 'cpu' or 'cuda:0', got {value!r}") from None
        return value

    @field_validator("channels_last", "compile", mode="before")
    @classmethod
    def _yaml_switch(cls, value: object) -> object:
        """YAML 1.1 reads a bare on / off as true / false: the same switch."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @field_validator("decode")
    @classmethod
    def _decode_device(cls, value: str) -> str:
        if value == "gpu" and not cuda_available():
            raise ValueError("gpu decodes JPEGs on a CUDA device (torchvision.io.decode_jpeg with device='cuda'), "
                             "and this machine has none (torch.cuda.is_available() is False); use cpu")
        return value

    @model_validator(mode="after")
    def _warmup_within_epochs(self) -> "TrainConfig":
        if self.warmup_epochs >= self.epochs:
            raise ValueError(f"warmup_epochs must be < epochs ({self.epochs}), got {self.warmup_epochs}")
        if self.schedule.min_lr >= self.optimizer.lr:
            raise ValueError(f"schedule.min_lr ({self.schedule.min_lr}) must be below optimizer.lr ({self.optimizer.lr})")
        return self

    def bound(self, **values) -> "TrainConfig":
        """A validated copy with ``values`` replacing fields (the bound ones, or a pretrain entry's overrides)."""
        return type(self).model_validate({**dict(self), **values})


__all__ = ["AUTOCAST_MODES", "BOUND_FIELDS", "CHANNELS_LAST_MODES", "COMPILE_MODES", "OptimizerSpec", "PRECISION_NAMES", "autocast_mode", "precision_name",
           "PRETRAIN_OVERRIDES", "ScheduleSpec", "StrictModel", "TrainConfig"]

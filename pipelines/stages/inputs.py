"""What each kind of stage reads: frozen, typed inputs built once by the graph compiler and hashed as they are.

A stage function reads its inputs (``ctx.stage.inputs``), its parents' records, the run store, the device and the
run settings; never the scenario config. The stage key hashes the inputs' JSON form (``model_dump(mode="json")``),
so what a stage reads is exactly what its key covers. Two kinds of value stay out of the key, each declared here:

- how, not what: :class:`RunSettings` (device, checkpoint cadence, input workers and the run's data guards) travel
  beside the inputs in the stage context and change no output;
- where, not what: a weights file's location (:attr:`WeightsFile.location`): its sha256 is in the key, so the same
  bytes at another path give the same key and other bytes at the same path another key. Config key paths that only
  name a value in error messages are left out too.

A task's inputs hold only what it consumes (its data slice, the class order up to its own task, its own starting
weights), never later tasks or their number, so appending a task leaves every existing key unchanged.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from compat_core.kinds import AdapterKind, ClassifierFamily
from pipelines.config.load import HOW_NOT_WHAT
from pipelines.config.schema import (
    PRETRAIN_PREFIX,
    EvaluationSpec,
    MethodSpec,
    PoolSpec,
    ReplaySpec,
    ScenarioConfig,
    resolved_head,
)
from pipelines.training.settings import OptimizerSpec, ScheduleSpec, TrainConfig, autocast_mode, precision_name

Autocast = bool | Literal["auto", "bf16", "fp16", "off"]
Split = Literal["query", "gallery"]


class FrozenInputs(BaseModel):
    """Base of every input model: immutable, unknown fields refused (its JSON form is what a key hashes)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    @property
    def precision(self) -> str | None:
        """fp32 | bf16 | fp16 the stage computes in (``training.autocast`` as resolved for the run; "auto" when it
        was not), None for a stage whose output no precision setting changes."""
        return None


# ---- how a stage runs (never in a key) ------------------------------------------------------------------------------
class OpenSetPools(FrozenInputs):
    """The data-level open-set guard: every training pool and test pool of a scenario, by config key."""

    training: tuple[tuple[str, PoolSpec], ...]
    tests: tuple[tuple[str, PoolSpec], ...]
    closed_set: bool = False  # evaluation.closed_set: the guard is overridden by name

    @classmethod
    def of(cls, config: ScenarioConfig) -> "OpenSetPools":
        return cls(training=(("data", config.data),) + tuple((f"pretrain[{p.name}].pool", p.pool)
                                                              for p in config.pretrain)
                   + tuple((f"tasks.sources[{i}].data", s.data) for i, s in enumerate(config.tasks.sources)),
                   tests=(("evaluation.query_set", config.evaluation.query_set),
                          ("evaluation.gallery_set", config.evaluation.gallery_set)),
                   closed_set=config.evaluation.closed_set)


class DataGuards(FrozenInputs):
    """Checks of the whole run against the data, made where a stage reads it; they refuse a run, never change what
    a stage computes: no training class in a test pool (checked by extract stages), and a fine-tuning pool with the
    classes every task of the run needs (checked by each task, so the first task refuses a run that a later one
    could not finish)."""

    open_set: OpenSetPools
    tasks_spec: str
    task_classes: int

    @classmethod
    def of(cls, config: ScenarioConfig) -> "DataGuards":
        return cls(open_set=OpenSetPools.of(config), tasks_spec=config.tasks.spec,
                   task_classes=sum(config.increments))


class RunSettings(FrozenInputs):
    """How a run's stages compute, not what: the same results for any of these values (HOW_NOT_WHAT of
    ``pipelines.config.load``, the device a stage runs on, and the run's data guards)."""

    device: str = Field(description="auto | cpu | cuda | cuda:N")
    checkpoint_every_epochs: int | None = None
    checkpoint_every_minutes: float = 10.0
    input_workers: int = 0
    prefetch_batches: int = 2
    persistent_workers: bool = False
    prefetch_first_batches: bool = True
    guards: DataGuards | None = None

    @classmethod
    def of(cls, config: ScenarioConfig) -> "RunSettings":
        return cls(device=config.device, guards=DataGuards.of(config),
                   **{name: getattr(config.training, name) for name in HOW_NOT_WHAT})

    def training_values(self) -> dict[str, Any]:
        """The training loop's how-not-what settings (``TrainConfig`` fields)."""
        return {name: getattr(self, name) for name in HOW_NOT_WHAT}


# ---- shared parts ----------------------------------------------------------------------------------------------------
class TrainRecipe(FrozenInputs):
    """What a training stage trains with: the ``TrainConfig`` fields that change its model (the ``training`` section
    and the values other sections own, bound in), without the device and the settings of :class:`RunSettings`."""

    optimizer: OptimizerSpec
    schedule: ScheduleSpec
    epochs: int
    warmup_epochs: int
    batch_size: int
    steps_per_epoch: int | None
    model_selection: Literal["last", "compatibility"]
    selection_holdout: float
    autocast: Autocast
    compile: Literal["auto", "on", "off"]
    channels_last: Literal["auto", "on", "off"]
    decode: Literal["cpu", "gpu"]
    augment: bool
    drop_last: bool
    replay_sampling: Literal["half_and_half", "mixed"]
    log_every_steps: int
    seed: int
    epoch_length: Literal["task", "reference"]
    selection_strict: bool
    eval_batch_size: int

    @classmethod
    def of(cls, config: TrainConfig, **fixed: Any) -> "TrainRecipe":
        """The recipe of a bound ``config``; ``fixed``: fields set to a value of their own (a field the stage never
        reads, so that it never changes the key)."""
        values = {name: getattr(config, name) for name in cls.model_fields}
        values["autocast"] = autocast_mode(values["autocast"])  # true/false and auto/off: one spelling per key
        return cls.model_validate({**values, **fixed})

    def train_config(self, device: Any, settings: RunSettings) -> TrainConfig:
        """The loop's TrainConfig on ``device`` with the run's how-not-what settings."""
        return TrainConfig.model_validate({**dict(self), **settings.training_values(), "device": str(device)})


class ModelShape(FrozenInputs):
    """The model a line starts from when it is not loaded: backbone (and its options), K slots and the head the
    retrieval feature comes from (junction | backbone, resolved for the classifier family)."""

    backbone: str
    backbone_config: dict[str, Any]
    num_slots: int
    head: Literal["junction", "backbone"]
    simplex_norm: Literal["row", "row_eps"] = Field(
        "row", description="model.simplex_norm: how the d-Simplex prototype rows are normalised")

    @model_serializer(mode="wrap")
    def _default_norm_left_out(self, handler: Any) -> dict[str, Any]:
        # the default is what every config without the key built: leaving it out keeps their stage inputs as they were
        data = handler(self)
        if data.get("simplex_norm") == "row":
            data.pop("simplex_norm")
        return data

    @classmethod
    def of(cls, config: ScenarioConfig, classifier: ClassifierFamily, backbone: str | None = None,
           backbone_config: dict | None = None) -> "ModelShape":
        """A fresh model of ``config`` (another backbone for a replacement or a pretrain entry): a d-Simplex model
        always has the junction (a third-party d-Simplex model adopted by a learnable method is converted exactly)."""
        head = "junction" if classifier == "simplex" else resolved_head(config, classifier)
        return cls(backbone=backbone or config.model.backbone,
                   backbone_config=config.model.backbone_config if backbone_config is None else backbone_config,
                   num_slots=config.model.num_slots, head=head, simplex_norm=config.model.simplex_norm)


class WeightsFile(FrozenInputs):
    """External weights (path, URI or MLflow model URI): the key holds their sha256, never their location."""

    location: str = Field(exclude=True, description="where the bytes are read from (the config's value)")
    sha256: str | None = Field(description="pinned in the config, else read when the graph was compiled; the stage "
                               "refuses other bytes. None: the file could not be read then (the preflight refuses)")
    unreadable: str | None = Field(None, description="the location, only when no digest is known")
    pinned: bool = Field(False, exclude=True, description="sha256 comes from the config (else a warning shows it)")
    ignore_keys: tuple[str, ...] | None = None
    config_key: str = Field(exclude=True, description="e.g. replacements[0].source, for error messages")


class ModelSource(FrozenInputs):
    """The weights a line starts from at task 0 (``initial_model``) or at a replacement: a pretrain stage's output
    (``pretrain``: its name; the stage is a parent) or a weights file loaded into a fresh ``model``."""

    pretrain: str | None = None
    file: WeightsFile | None = None
    model: ModelShape | None = Field(None, description="the model a weights file loads into")
    num_pretrain_classes: int | None = Field(None, description="slots 0.. a weights file's own classes use")
    config_key: str = Field(exclude=True)

    @property
    def text(self) -> str:
        """The source as the config writes it (``pretrain:<name>`` or the file's location)."""
        return f"{PRETRAIN_PREFIX}{self.pretrain}" if self.pretrain is not None else self.file.location


class ClassOrder(FrozenInputs):
    """The fine-tuning classes of tasks 0..t: ``order`` of the pool's classes (seeded permutation or as given) cut
    into ``increments`` (classes per task, up to and including task t). Later tasks never change it."""

    order: Literal["seeded", "given"]
    seed: int
    increments: tuple[int, ...]

    @classmethod
    def of(cls, config: ScenarioConfig, upto_task: int | None = None) -> "ClassOrder":
        increments = config.increments if upto_task is None else config.increments[: upto_task + 1]
        return cls(order=config.tasks.order, seed=config.task_seed, increments=tuple(increments))


class TaskSource(FrozenInputs):
    """A task given by its own data (``tasks.sources[i]``): its pool, the data's content digest, its classes and the
    first class position they take (the classes of every earlier task come before). Its classes are the pool's in
    class-id order, positions ``first_position ..``; nothing of a later task is here. Where, not what: with a
    digest, the pool's ``root`` is left out of the key (``location``), as a weights file's path is: the same data in
    a local folder or a bucket gives the same key, other data at the same place another key."""

    name: str
    pool: PoolSpec = Field(description="the pool, its root cleared when the digest stands for the data")
    sha256: str | None = Field(description="content digest of the pool's data (pipelines.graph.source_digests."
                               "data_digest); None for a pool without a root or one unreadable when compiled")
    num_classes: int
    first_position: int = Field(description="classes of the tasks before this one")
    location: str | None = Field(None, exclude=True, description="the pool's root as the config writes it")
    config_key: str = Field(exclude=True, description="e.g. tasks.sources[0], for error messages")

    def pool_spec(self) -> PoolSpec:
        """The pool as the config names it (root included): what the stage opens."""
        return self.pool if self.location is None else self.pool.model_copy(update={"root": self.location})


class MatrixProtocol(FrozenInputs):
    """The evaluation settings that change a matrix entry (ECC strictness does not: it only changes metrics)."""

    metric: Literal["recall_at_1", "map", "verification", "tar_at_far"]
    gallery: Literal["instances", "class_means"]
    label_level: Literal["fine", "coarse"]
    far: float
    verification_pairs: int

    @classmethod
    def of(cls, evaluation: EvaluationSpec) -> "MatrixProtocol":
        return cls.model_validate({name: getattr(evaluation, name) for name in cls.model_fields})


class EntryRules(FrozenInputs):
    """Everything that decides a matrix entry besides its two feature sets: the protocol, the method (training-free
    methods project logits into the gallery model's classes), the seed of the verification pairs and whether the
    query and gallery sets are the same images (verification then never pairs an image with itself)."""

    protocol: MatrixProtocol
    method: MethodSpec
    seed: int
    same_pool: bool

    @classmethod
    def of(cls, config: ScenarioConfig, evaluation: EvaluationSpec | None = None) -> "EntryRules":
        evaluation = config.evaluation if evaluation is None else evaluation
        return cls(protocol=MatrixProtocol.of(evaluation), method=config.method, seed=config.seed,
                   same_pool=evaluation.query_set == evaluation.gallery_set)

    def with_metric(self, metric: str) -> "EntryRules":
        return self.model_copy(update={"protocol": self.protocol.model_copy(update={"metric": metric})})


class Extraction(FrozenInputs):
    """How a model's features are computed: the method (training-free methods store logits), the batch size and the
    inference precision (``training.autocast``)."""

    method: MethodSpec
    batch_size: int
    autocast: Autocast

    @classmethod
    def of(cls, config: ScenarioConfig) -> "Extraction":
        return cls(method=config.method, batch_size=config.evaluation.batch_size,
                   autocast=autocast_mode(config.training.autocast))


# ---- per kind --------------------------------------------------------------------------------------------------------
class TrainingStageInputs(FrozenInputs):
    """Base of the inputs of a stage that trains (its subclasses declare ``training: TrainRecipe``): its precision
    compile mode and memory layout as resolved for the run."""

    @property
    def precision(self) -> str:
        return precision_name(self.training.autocast)

    @property
    def compiled(self) -> str:
        """on | off: whether the stage's training step runs compiled (``training.compile`` as resolved)."""
        return self.training.compile

    @property
    def channels_last(self) -> str:
        """on | off: whether the stage trains in the channels_last layout (``training.channels_last`` as
        resolved)."""
        return self.training.channels_last


class PretrainInputs(TrainingStageInputs):
    """A third-party model trained on its own pool (slots 0.., left to right): its entry with the fallbacks resolved
    (seed, backbone, classifier family, the training settings it uses)."""

    name: str
    pool: PoolSpec
    num_classes: int
    classifier: ClassifierFamily
    seed: int
    model: ModelShape
    init: WeightsFile | None
    training: TrainRecipe
    threads: int
    workers: int


class TrainInputs(TrainingStageInputs):
    """One task of the model line (finetune or replace): its data slice (pool and classes up to its task), the
    model, the method, the training recipe and replay, and the weights it starts from at task 0 or a replacement."""

    task: int
    seed: int = Field(description="the scenario seed: fresh models, loaded sources; the task trains with seed*1000+t")
    data: PoolSpec | None = Field(description="the pool the task is cut from (None: a task given by its own data)")
    classes: ClassOrder | None = Field(description="the split's class order up to the task (None: own data)")
    own_data: TaskSource | None = Field(None, description="the task's own data (tasks.sources), else None")
    model: ModelShape
    method: MethodSpec
    training: TrainRecipe
    replay: ReplaySpec
    start: ModelSource | None = Field(None, description="initial_model (task 0) or the replacement's source")
    anchor: Literal["loaded", "replaced"] | None = Field(None, description="a replacement's frozen old model")
    threads: int
    workers: int

    @property
    def replaces(self) -> bool:
        return self.anchor is not None


class ExtractInputs(FrozenInputs):
    """Features of model t on the query or gallery set."""

    task: int
    split: Split
    pool: PoolSpec
    extraction: Extraction
    features: Literal["auto", "direct", "bridge"]
    feature_dtype: Literal["float16", "float32"]
    threads: int

    @property
    def precision(self) -> str:
        return precision_name(self.extraction.autocast)


class EntryInputs(FrozenInputs):
    """Matrix entry C[row, column] from the row's query extract and the gallery extracts of columns 0..row."""

    row: int
    column: int
    rules: EntryRules
    threads: int


class EvaluateInputs(FrozenInputs):
    """Row t of the matrix from its entries."""

    row: int
    protocol: MatrixProtocol


class AdaptInputs(FrozenInputs):
    """Adapters fitted at the replacement of task ``task`` between models t-1 and t, judged by the criterion."""

    task: int
    adapters: tuple[AdapterKind, ...]
    adapter_params: dict[str, dict[str, Any]]
    seed: int
    rules: EntryRules
    strict: bool
    threads: int


StageInputs = PretrainInputs | TrainInputs | ExtractInputs | EntryInputs | EvaluateInputs | AdaptInputs

__all__ = [
    "AdaptInputs", "ClassOrder", "DataGuards", "EntryInputs", "EntryRules", "EvaluateInputs", "ExtractInputs",
    "Extraction", "FrozenInputs", "MatrixProtocol", "ModelShape", "ModelSource", "OpenSetPools", "PretrainInputs",
    "RunSettings", "StageInputs", "TaskSource", "TrainInputs", "TrainRecipe", "WeightsFile",
]

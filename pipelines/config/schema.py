"""Scenario configuration: the YAML schema and its cross-field validation before any compute (loading files,
``--set`` overrides, error messages and the config hash: ``pipelines.config.load``).

A scenario says which data make up the pre-training pools, the fine-tuning pool and the open-set query/gallery
sets, how the fine-tuning classes are split into tasks, which backbone and how many d-Simplex slots (K) the models
have, which method trains them, when third-party models replace the fine-tuned one, and how compatibility is
measured. The schema checks each field (types, ranges, choices); every rule across fields is in
``pipelines.config.validate``, run once at load. Validation never touches the data (paper configs name data roots
that may not exist on this machine): what can only be checked against the data is checked where the data is read.

Conventions: task numbers are 0-based in code and files except ``replacements[i].at_task``, which is 1-based as in
the papers. Learning rates are plain numbers; metrics are fractions in [0, 1].
"""
from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, Field, PrivateAttr, SerializeAsAny, ValidationInfo, field_validator, model_validator

from compat_core.kinds import AdapterKind, ClassifierFamily
from pipelines.config.method_params import MethodParams
from pipelines.graph.stage_kind import StageKind
from pipelines.methods import METHODS
from pipelines.training.settings import (
    PRETRAIN_OVERRIDES,
    SEED_LIMIT,
    OptimizerSpec,
    ScheduleSpec,
    StrictModel,
    TrainConfig,
)

PRETRAIN_PREFIX = "pretrain:"


class Portion(StrictModel):
    """A seeded, class-stratified part of a pool: per class, a ``fraction`` of its samples is ``first``, the rest ``second``.

    Used to make a query and a gallery set out of one open-set test pool (query = first, gallery = second).
    """

    fraction: float = Field(0.5, gt=0.0, lt=1.0, description="share of each class's samples in the 'first' part")
    take: Literal["first", "second"] = "first"
    seed: int = Field(0, ge=0, lt=SEED_LIMIT)


class Normalization(StrictModel):
    """Per-channel statistics, fractions of 255, that a pool's transforms use instead of its reader's own."""

    mean: list[float] = Field(min_length=1, description="per-channel mean in [0, 1]")
    std: list[float] = Field(min_length=1, description="per-channel standard deviation, > 0")

    @model_validator(mode="after")
    def _per_channel(self) -> "Normalization":
        if len(self.mean) != len(self.std):
            raise ValueError(f"normalize.mean and normalize.std need one value per channel, got {len(self.mean)} "
                             f"and {len(self.std)}")
        if any(not 0.0 <= m <= 1.0 for m in self.mean) or any(s <= 0.0 for s in self.std):
            raise ValueError(f"normalize: mean values must lie in [0, 1] and std values be > 0 (fractions of 255), "
                             f"got mean {self.mean} std {self.std}")
        return self


class PoolSpec(StrictModel):
    """One labelled image pool: ``load_dataset(dataset, root, split, **options)`` then optional filtering."""

    dataset: str = Field(description="name in compat_core.data.DATASETS (e.g. glyphs, cifar100)")
    root: str | None = Field(None, description="local folder or s3:// URI of the data; None = the reader's default")
    split: str = "train"
    options: dict[str, Any] = Field(default_factory=dict, description="extra keyword options of the dataset reader")
    classes: list[int] | None = Field(None, description="dataset class ids to keep (None = all classes of the split)")
    per_class: int | None = Field(None, ge=1, description="keep at most this many samples per class (first ones)")
    portion: Portion | None = None
    num_samples: int | None = Field(
        None, ge=1, description="expected samples after filtering: used by `compat plan` estimates only"
    )
    normalize: Normalization | None = Field(
        None, description="statistics replacing the reader's own in this pool's transforms (None: the reader's), "
        "e.g. the public IAM-CL2R code's CIFAR-100 values (0.5071, 0.4867, 0.4408) / (0.2675, 0.2565, 0.2761), which "
        "it uses for CIFAR-100 training and for the CIFAR-10 queries and gallery (src/iamcl2r/dataset/cifar.py:14-27, "
        "48-52)")

    def identity(self) -> tuple:
        """What makes two pools draw from the same class space (for the open-set guard)."""
        return (self.dataset, self.root, self.split, json.dumps(self.options, sort_keys=True, default=str))


class ModelSpec(StrictModel):
    backbone: str = Field(description="name in compat_core.models.BACKBONES")
    backbone_config: dict[str, Any] = Field(default_factory=dict)
    num_slots: int = Field(ge=2, description="K: d-Simplex classes pre-allocated; feature dimension is K - 1")
    head: Literal["auto", "junction", "backbone"] = Field(
        "auto", description="retrieval feature: 'junction' = Linear(m, K-1) output (d-Simplex methods need it); "
        "'backbone' = the backbone output with the classifier on it (the papers' learnable-classifier baselines); "
        "'auto' = backbone for learnable classifiers, junction for the d-Simplex")
    simplex_norm: Literal["row", "row_eps"] = Field(
        "row", description="d-Simplex prototype rows: 'row' (default) divided by their exact norm (unit rows, SPEC "
        "section 3); 'row_eps' divided by norm + 1e-8, as the public IAM-CL2R code builds them "
        "(src/iamcl2r/models/__init__.py:114): prototypes 1e-8 shorter, for step-by-step parity with it")


class ReplaySpec(StrictModel):
    per_class: int = Field(20, ge=0, description="images kept per seen class (0 disables replay)")
    strategy: Literal["random", "herding"] = "random"
    epoch_length: Literal["task", "reference"] = Field(
        "task", description="half-memory/half-task epochs: 'task' = one pass over the task data (batch_size // 2 task "
        "samples per batch); 'reference' = (task + memory) // batch_size batches, as the public CL2R / IAM-CL2R code; "
        "a side holding <= batch_size / 2 samples is drawn with replacement, as the public IAM-CL2R code (the public "
        "CL2R code draws without replacement and cannot run a side smaller than batch_size / 2)")


def method_params_model(name: str) -> type[MethodParams]:
    """The params model registered by method ``name`` (KeyError naming the valid methods)."""
    return METHODS.get(name).Params


class MethodSpec(StrictModel):
    name: str = Field(description="name in pipelines.methods.METHODS (e.g. er, dsimplex-hoc)")
    params: SerializeAsAny[MethodParams] = Field(
        default_factory=MethodParams, validate_default=True,  # omitted params are the method's defaults, typed
        description="method hyper-parameters: the Params model of method.name")

    @field_validator("name")
    @classmethod
    def _registered(cls, value: str) -> str:
        if value not in METHODS:
            raise ValueError(f"unknown method {value!r}; valid: {', '.join(METHODS.names())}")
        return value

    @field_validator("params", mode="before")
    @classmethod
    def _select_params(cls, value: Any, info: ValidationInfo) -> MethodParams:
        name = info.data.get("name")
        if name is None:
            return MethodParams()  # the unknown name is the error reported
        if isinstance(value, BaseModel):
            value = dict(value)
        return method_params_model(name).model_validate({} if value is None else value)


class TaskSourceSpec(StrictModel):
    """A task given by its own data (``tasks.sources[i]``): every class of ``data`` is new and takes the class
    positions (so the slots) after those of every earlier task; the tasks of ``tasks.spec`` come first, then the
    sources in the order listed, so appending a source never changes an earlier task's classes, slots or keys."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="short name of the batch of classes, e.g. 2026-12")
    data: PoolSpec = Field(description="the task's pool: a published format the readers know (local folder or "
                           "s3:// prefix in data.root) or the Parquet shards of `compat ingest` (dataset: shards)")
    num_classes: int = Field(ge=1, description="classes (identities) in the pool: the K check uses it at load; "
                             "checked against the data before any compute")


class TaskSpec(StrictModel):
    spec: str = Field(description="initial classes + increments, e.g. '10+6x15' (7 tasks)")
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT, description="class-order seed (None: the scenario seed)")
    order: Literal["seeded", "given"] = Field(
        "seeded", description="'seeded': the sorted class ids shuffled with the seed; 'given': data.classes in the "
        "order listed, else the classes in the dataset's id order (the reference codes' order)")

    sources: list[TaskSourceSpec] = Field(
        default_factory=list, description="tasks given by their own data, appended after the tasks of 'spec' "
        "(task len(spec's tasks) + i, 0-based, is sources[i]): next month's identities are a new entry here")

    @field_validator("spec")
    @classmethod
    def _parse(cls, value: str) -> str:
        parse_increments(value)
        return value


class PretrainSpec(StrictModel):
    """A third-party model trained by the pipeline on its own class pool (slots 0..num_classes-1, left to right)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    pool: PoolSpec
    num_classes: int = Field(ge=1, description="classes in the pool (checked against the data when the stage runs)")
    epochs: int | None = Field(None, ge=1, description="None: training.epochs")
    backbone: str | None = None
    backbone_config: dict[str, Any] | None = None
    optimizer: OptimizerSpec | None = None
    schedule: ScheduleSpec | None = None
    batch_size: int | None = Field(None, ge=2)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    init: str | None = Field(
        None, description="external weights pre-training starts from (path / s3:// URI of a safetensors file or a torch "
        "state dict read with weights_only=True, e.g. the published DINOv3 checkpoint); None: random initialisation")
    init_sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$",
                                    description="expected sha256 of the init file (checked before loading)")
    init_ignore_keys: list[str] | None = Field(
        None, description="glob patterns of init checkpoint keys known not to fit (e.g. 'dino_head.*'); every other "
        "key must load into the backbone and every backbone key must be loaded")
    classifier: Literal["method", ClassifierFamily] = Field(
        "method", description="classifier family the third-party model is trained with: 'method' (the method under "
        "test's: d-Simplex or learnable, as the reference pre-trains each method's models) or one fixed family, so "
        "that runs of different methods share the same third-party models (a learnable-classifier method adopts a "
        "d-Simplex model with exactly its logits, see compat_core.models.learnable_from_simplex)")

    def resolved_classifier(self, method_classifier: ClassifierFamily) -> ClassifierFamily:
        """The classifier family this entry trains with, given the method's ('simplex' or 'learnable')."""
        return method_classifier if self.classifier == "method" else self.classifier


class ReplacementSpec(StrictModel):
    """At task ``at_task`` (1-based, as the papers) the fine-tuned model is replaced by another one, then fine-tuned."""

    at_task: int = Field(description="1-based task number of the first task trained from the new model")
    source: str = Field(description="path / URI / MLflow URI of external weights, or 'pretrain:<name>'")
    backbone: str | None = Field(None, description="backbone of the new model (None: model.backbone)")
    backbone_config: dict[str, Any] | None = None
    sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$")
    ignore_keys: list[str] | None = Field(
        None, description="glob patterns of source keys (or model keys) known not to fit; the rest must match exactly")
    num_pretrain_classes: int | None = Field(
        None, ge=0, description="slots 0.. used by the external model's own classes (for the K check)"
    )
    anchor: Literal["loaded", "replaced"] = Field(
        "loaded", description="frozen old model of the replacement's first task: 'loaded' (the new model itself, as "
        "the papers and their public code) or 'replaced' (this project's extension, not in the papers: the "
        "fine-tuned model it replaces, so the new model is trained to be compatible with the index it inherits; "
        "d-Simplex methods only)")
    adapters: list[AdapterKind] = Field(
        default_factory=list,
        description="adapters fitted between the replaced (old) and the new model at this replacement, evaluated "
                    "and stored by an 'adapt' stage: procrustes|affine|mlp (new->old queries), fct|fan (old->new "
                    "gallery)",
    )
    adapter_params: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per-adapter settings, e.g. {affine: {rank: 64}, mlp: {epochs: 30}}")


class EvaluationSpec(StrictModel):
    query_set: PoolSpec
    gallery_set: PoolSpec
    metric: Literal["recall_at_1", "map", "verification", "tar_at_far"] = "recall_at_1"
    gallery: Literal["instances", "class_means"] = "instances"
    label_level: Literal["fine", "coarse"] = "fine"
    strict: bool = Field(True, description="compatibility criterion uses > (True) or >= (False)")
    closed_set: bool = Field(
        False, description="the named override of the open-set guard: True lets the query and gallery sets hold "
        "training classes (a closed-set protocol, e.g. PSP Tab. 1(a) on the CIFAR100 test set); `compat plan` prints "
        "it. False (default): a test class seen in training refuses the run")
    far: float = Field(1e-3, gt=0.0, lt=1.0, description="false-acceptance rate for tar_at_far")
    verification_pairs: int = Field(3000, ge=1, description="positive (and as many negative) pairs for verification")
    feature_dtype: Literal["float16", "float32"] = "float16"
    features: Literal["auto", "direct", "bridge"] = Field(
        "auto", description="what extract stores: d-dim features (direct) or m-dim embeddings for the exact "
                            "linear-head bridge (bridge); auto: the bridge when d = K-1 > m (pipelines.stages.bridge_features)")
    batch_size: int = Field(256, ge=1, description="extraction batch size")


class StageResources(StrictModel):
    """What one stage asks a scheduler for (Ray). ``num_gpus`` None: 1 when the cluster has GPUs, else 0."""

    num_gpus: float | None = Field(None, ge=0)
    num_cpus: float = Field(1, gt=0)
    memory: int | None = Field(None, ge=0, description="bytes")
    num_workers: int = Field(1, ge=1, description="data-parallel training workers (Ray Train, DDP), each with "
                             "num_cpus / num_gpus / memory; > 1 only for pretrain and finetune, on the Ray backend")
    custom: dict[str, float] = Field(default_factory=dict, description="Ray custom resources the stage needs, e.g. "
                                     "{gpu_a100: 1} or {spot: 0.01}: it only runs on nodes that list them")
    own_process: bool | None = Field(
        None, description="run each training node (pretrain, finetune, replace) in a Ray worker process of its own "
        "that exits after it (Ray's max_calls=1): everything the node held (optimiser state, allocator caches, a CUDA "
        "context) goes back to the OS and the next node starts clean, at the price of one worker start (seconds) per "
        "node; None: when the node asks for a GPU (Ray's own rule for GPU tasks), else reused workers")


class ResourcesSpec(StrictModel):
    pretrain: StageResources = Field(default_factory=StageResources)
    finetune: StageResources = Field(default_factory=StageResources)
    extract: StageResources = Field(default_factory=StageResources)
    evaluate: StageResources = Field(default_factory=lambda: StageResources(num_gpus=0))
    evaluation_actors: int | None = Field(None, ge=1, description="most matrix-entry tasks running at once on Ray "
                                                                   "(None: as many as Ray places)")
    autoscaling: bool = Field(False, description="the Ray cluster has an autoscaler: a stage no current node can "
                              "hold waits for one (logged) instead of failing at once")

    def for_stage(self, kind: StageKind) -> StageResources:
        """The resources a stage of ``kind`` runs under (its ``resources.<section>``)."""
        return getattr(self, StageKind(kind).config_section)


class PaperSpec(StrictModel):
    """What a shipped config reproduces and how it knowingly differs (printed by `compat plan`; not in the config hash)."""

    reproduces: str = Field(description="paper and table/figure the scenario reproduces, e.g. 'CL2R (2026) Table II'")
    divergences: list[str] = Field(default_factory=list, description="every deliberate difference from the papers' "
                                   "text, with the quote and the reason")
    public_code: list[str] = Field(default_factory=list, description="settings the papers do not state, taken from "
                                   "the public code that produced the tables")
    choices: list[str] = Field(default_factory=list, description="settings neither the papers nor their public code "
                               "state, and our choice")
    public_code_differences: list[str] = Field(
        default_factory=list, description="settings where this config differs from the public code that produced "
        "the tables, each with the public code's value and its file:line (and the --set that follows it, if any)")


class OutputSpec(StrictModel):
    dir: str = Field("runs/{name}", description="run directory (local path or s3:// URI); {name} = scenario name")
    shared_store: str | None = Field(
        None, description="store (local folder or s3:// URI) of third-party models shared by runs: a pretrain stage "
        "whose key is committed there is copied into the run instead of trained, and one this run trains is "
        "published there; stage keys are content hashes, so only identical models are shared. Runs that train the "
        "same model at once take turns (a claim per stage key); None: every run trains its own")
    registered_model: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.-]+$",
        description="MLflow registered model that every run of this scenario adds its versions to (each run sets "
        "<run name>__task-N; bare task-N only from a run of the config unchanged); None = the scenario name")


class ScenarioConfig(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    seed: int = Field(0, ge=0, lt=SEED_LIMIT, description="scenario seed in [0, 2^63); task t trains with seed*1000+t")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    data: PoolSpec = Field(description="the fine-tuning pool, split into tasks")
    tasks: TaskSpec
    model: ModelSpec
    method: MethodSpec
    training: TrainConfig = Field(default_factory=TrainConfig)
    replay: ReplaySpec = Field(default_factory=ReplaySpec)
    pretrain: list[PretrainSpec] = Field(default_factory=list)
    initial_model: str | None = Field(
        None, description="weights the first task starts from: 'pretrain:<name>', a path/URI, or None (random init)"
    )
    initial_model_ignore_keys: list[str] | None = Field(
        None, description="glob patterns of initial_model checkpoint keys known not to fit (external files only)")
    replacements: list[ReplacementSpec] = Field(default_factory=list)
    evaluation: EvaluationSpec
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    output: OutputSpec = Field(default_factory=OutputSpec)
    paper: PaperSpec | None = Field(None, description="which paper table the config reproduces, and divergences")
    # the `protocol:` preset whose values pipelines.config.load wrote in (pipelines.config.protocols); not dumped
    _protocol: str | None = PrivateAttr(None)

    @property
    def protocol(self) -> str | None:
        """Name of the protocol preset applied at load (its values are in the config), None without one."""
        return self._protocol

    # ---- derived values -------------------------------------------------------------------------------------
    @property
    def increments(self) -> list[int]:
        return parse_increments(self.tasks.spec)

    @property
    def num_split_tasks(self) -> int:
        """Tasks cut from ``data`` by ``tasks.spec`` (they come first)."""
        return len(self.increments)

    @property
    def num_tasks(self) -> int:
        """Every task: the split tasks, then one per ``tasks.sources`` entry."""
        return len(self.increments) + len(self.tasks.sources)

    def task_source(self, task: int) -> TaskSourceSpec | None:
        """The ``tasks.sources`` entry of 0-based ``task`` (None for a task cut from ``data``)."""
        index = task - len(self.increments)
        return self.tasks.sources[index] if 0 <= index < len(self.tasks.sources) else None

    @property
    def task_seed(self) -> int:
        return self.seed if self.tasks.seed is None else self.tasks.seed

    def replacement_at(self, task: int) -> ReplacementSpec | None:
        """The replacement whose first task is ``task`` (0-based), if any."""
        for replacement in self.replacements:
            if replacement.at_task - 1 == task:
                return replacement
        return None

    def pretrain_spec(self, name: str) -> PretrainSpec:
        for spec in self.pretrain:
            if spec.name == name:
                return spec
        raise KeyError(f"no pretrain entry named {name!r}; defined: {[p.name for p in self.pretrain]}")

    def output_dir(self) -> str:
        return self.output.dir.replace("{name}", self.name)

    def train_config(self, seed: int, device: str | None, pretrain: PretrainSpec | None = None) -> TrainConfig:
        """What a stage trains with: the ``training`` section (with ``pretrain``'s overrides for a pre-training
        stage, which always keeps its last epoch) and the values other sections own (BOUND_FIELDS) bound in.
        device None: left at the loop's default (a stage's inputs leave it out; it is bound where the stage runs)."""
        values = {"seed": seed, "epoch_length": self.replay.epoch_length,
                  "selection_strict": self.evaluation.strict, "eval_batch_size": self.evaluation.batch_size}
        if device is not None:
            values["device"] = str(device)
        if pretrain is not None:
            values.update({name: getattr(pretrain, name) for name in PRETRAIN_OVERRIDES
                           if getattr(pretrain, name) is not None})
            values["model_selection"] = "last"
        return self.training.bound(**values)


MAX_TASKS = 10_000
_INCREMENT_PATTERN = re.compile(r"^\s*(\d+)\s*(?:x\s*(\d+))?\s*$")


def parse_increments(spec: str) -> list[int]:
    """'10+6x15' -> [10, 15, 15, 15, 15, 15, 15]: classes per task (0-based task index = list position).

    ``AxB`` means A tasks of B classes. Kept here so configs validate without the data package; it must agree
    with ``compat_core.data.tasks.parse_increments`` (a test checks both on the shipped specs).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"tasks.spec: expected text like '10+6x15', got {spec!r}")
    counts: list[int] = []
    for part in spec.split("+"):
        match = _INCREMENT_PATTERN.match(part)
        if not match:
            raise ValueError(f"tasks.spec: cannot read {part.strip()!r} in {spec!r}; write N or AxB, e.g. '10+6x15'")
        repeat = 1 if match.group(2) is None else int(match.group(1))
        if len(counts) + repeat > MAX_TASKS:
            raise ValueError(f"tasks.spec: {spec!r} has more than {MAX_TASKS} tasks; a scenario's matrix has T(T+1)/2 "
                             f"entries, so keep T at most {MAX_TASKS}")
        if match.group(2) is None:
            counts.append(int(match.group(1)))
        else:
            counts.extend([int(match.group(2))] * repeat)
    if not counts or min(counts) < 1:
        raise ValueError(f"tasks.spec: every task needs at least one class, got {spec!r}")
    return counts


def resolved_head(config: ScenarioConfig, classifier: ClassifierFamily) -> str:
    """'junction' or 'backbone': the model head a scenario's models get (``model.head``, 'auto' resolved by the
    method's classifier family: backbone output for learnable classifiers, as the papers' baselines)."""
    if config.model.head != "auto":
        return config.model.head
    return "backbone" if classifier == "learnable" else "junction"


__all__ = [
    "PRETRAIN_PREFIX",
    "EvaluationSpec",
    "MethodParams",
    "MethodSpec",
    "ModelSpec",
    "PaperSpec",
    "PoolSpec",
    "PretrainSpec",
    "ReplacementSpec",
    "ReplaySpec",
    "ResourcesSpec",
    "ScenarioConfig",
    "StageResources",
    "TaskSourceSpec",
    "TaskSpec",
    "parse_increments",
    "resolved_head",
]

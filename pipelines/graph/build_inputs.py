"""The typed inputs of each stage (``pipelines.stages.inputs``) built from a validated scenario config.

Every value a stage reads is resolved here, once: fallbacks (a pretrain entry's seed, backbone and training
settings), the classifier family and model head, a weights file's digest, the class order up to a task. A task's
inputs hold only what it consumes, so the inputs (and keys) of tasks 0..t do not depend on later tasks.
"""
from __future__ import annotations

from pipelines.config.schema import PRETRAIN_PREFIX, ScenarioConfig, StageResources
from pipelines.graph.source_digests import data_digest, hashed_source
from pipelines.graph.stage_kind import StageKind
from pipelines.methods import METHODS
from pipelines.stages.inputs import (
    AdaptInputs,
    ClassOrder,
    EntryRules,
    ExtractInputs,
    Extraction,
    ModelShape,
    ModelSource,
    PretrainInputs,
    TaskSource,
    TrainInputs,
    TrainRecipe,
    WeightsFile,
)
from pipelines.training.settings import TrainConfig

# TrainConfig fields only compatibility-based model selection reads, and those a pre-training never reads either (no
# replay memory, last-epoch selection): held at their defaults where unread, so that they never change a key
_SELECTION_ONLY = ("selection_holdout", "selection_strict")
_UNREAD_BY_PRETRAINING = _SELECTION_ONLY + ("replay_sampling", "epoch_length", "eval_batch_size")


def _defaults(names: tuple[str, ...]) -> dict:
    return {name: TrainConfig.model_fields[name].default for name in names}


def stage_threads(resources: StageResources) -> int:
    """torch intra-op threads a stage computes with, on every backend: its ``num_cpus`` (at least 1).

    Float reductions (GEMM, convolutions) are split by thread count, so results depend on it: it is fixed per stage
    and part of the stage's inputs, so the same key gives the same bytes in-process, on Ray and after a resume.
    """
    return max(1, int(resources.num_cpus))


def method_classifier(config: ScenarioConfig):
    """The classifier family of the config's method (simplex | learnable)."""
    return METHODS.get(config.method.name).classifier


def weights_file(location: str, sha256: str | None, ignore_keys: list[str] | None, config_key: str) -> WeightsFile:
    """A weights file as a stage reads it: the pinned digest, else the file's (read now), else its location."""
    identity = hashed_source(location, sha256)
    digest = identity.get("file_sha256")
    return WeightsFile(location=location, sha256=digest, unreadable=None if digest else location,
                       pinned=bool(sha256), ignore_keys=None if ignore_keys is None else tuple(ignore_keys),
                       config_key=config_key)


def model_source(config: ScenarioConfig, source: str, config_key: str, *, sha256: str | None = None,
                 ignore_keys: list[str] | None = None, backbone: str | None = None,
                 backbone_config: dict | None = None, num_pretrain_classes: int | None = None) -> ModelSource:
    """What a line starts from: a pretrain stage's output, or a weights file loaded into a fresh model."""
    if source.startswith(PRETRAIN_PREFIX):
        return ModelSource(pretrain=source[len(PRETRAIN_PREFIX):], config_key=config_key)
    return ModelSource(file=weights_file(source, sha256, ignore_keys, config_key),
                       model=ModelShape.of(config, method_classifier(config), backbone, backbone_config),
                       num_pretrain_classes=num_pretrain_classes, config_key=config_key)


def pretrain_inputs(config: ScenarioConfig, index: int) -> PretrainInputs:
    """Inputs of ``config.pretrain[index]``: its classifier family resolved (never "method": an ER run and a
    d-Simplex run that both pre-train d-Simplex models get the same key, so a shared store trains it once)."""
    spec = config.pretrain[index]
    classifier = spec.resolved_classifier(method_classifier(config))
    seed = spec.seed if spec.seed is not None else config.seed
    init = None if spec.init is None else weights_file(spec.init, spec.init_sha256, spec.init_ignore_keys,
                                                       f"pretrain[{spec.name}].init")
    resources = config.resources.pretrain
    return PretrainInputs(
        name=spec.name, pool=spec.pool, num_classes=spec.num_classes, classifier=classifier, seed=seed,
        model=ModelShape.of(config, classifier, spec.backbone, spec.backbone_config), init=init,
        training=TrainRecipe.of(config.train_config(seed, None, spec), **_defaults(_UNREAD_BY_PRETRAINING)),
        threads=stage_threads(resources), workers=resources.num_workers)


def train_inputs(config: ScenarioConfig, task: int) -> TrainInputs:
    """Inputs of task ``task`` (finetune, or replace at a replacement's first task)."""
    replacement = config.replacement_at(task)
    start, anchor = None, None
    if replacement is not None:
        index = config.replacements.index(replacement)
        start = model_source(config, replacement.source, f"replacements[{index}].source", sha256=replacement.sha256,
                             ignore_keys=replacement.ignore_keys, backbone=replacement.backbone,
                             backbone_config=replacement.backbone_config,
                             num_pretrain_classes=replacement.num_pretrain_classes)
        anchor = replacement.anchor
    elif task == 0 and config.initial_model:
        start = model_source(config, config.initial_model, "initial_model",
                             ignore_keys=config.initial_model_ignore_keys)
    resources = config.resources.for_stage(StageKind.REPLACE if replacement is not None else StageKind.FINETUNE)
    training = config.train_config(config.seed * 1000 + task, None)
    unread = () if training.model_selection == "compatibility" else _SELECTION_ONLY
    own_data = task_source(config, task)
    return TrainInputs(
        task=task, seed=config.seed, data=None if own_data else config.data,
        classes=None if own_data else ClassOrder.of(config, task), own_data=own_data,
        model=ModelShape.of(config, method_classifier(config)), method=config.method,
        training=TrainRecipe.of(training, **_defaults(unread)), replay=config.replay, start=start,
        anchor=anchor, threads=stage_threads(resources), workers=resources.num_workers)


def task_source(config: ScenarioConfig, task: int) -> TaskSource | None:
    """The own data of 0-based ``task`` (``tasks.sources``) with its content digest and first class position (every
    class of the split tasks and of the sources before it); None for a task cut from ``data``."""
    spec = config.task_source(task)
    if spec is None:
        return None
    index = task - config.num_split_tasks
    first = sum(config.increments) + sum(source.num_classes for source in config.tasks.sources[:index])
    digest = data_digest(spec.data)
    pool = spec.data.model_copy(update={"root": None}) if digest else spec.data
    return TaskSource(name=spec.name, pool=pool, sha256=digest, num_classes=spec.num_classes, first_position=first,
                      location=spec.data.root if digest else None, config_key=f"tasks.sources[{index}]")


def extract_inputs(config: ScenarioConfig, task: int, split: str) -> ExtractInputs:
    evaluation = config.evaluation
    return ExtractInputs(task=task, split=split, pool=getattr(evaluation, f"{split}_set"),
                         extraction=Extraction.of(config), features=evaluation.features,
                         feature_dtype=evaluation.feature_dtype, threads=stage_threads(config.resources.extract))


def adapt_inputs(config: ScenarioConfig, index: int) -> AdaptInputs:
    """Inputs of the adapters listed at ``config.replacements[index]``."""
    replacement = config.replacements[index]
    return AdaptInputs(task=replacement.at_task - 1, adapters=tuple(replacement.adapters),
                       adapter_params=replacement.adapter_params, seed=config.seed, rules=EntryRules.of(config),
                       strict=config.evaluation.strict, threads=stage_threads(config.resources.evaluate))


__all__ = ["adapt_inputs", "extract_inputs", "method_classifier", "model_source", "pretrain_inputs",
           "stage_threads", "task_source", "train_inputs", "weights_file"]

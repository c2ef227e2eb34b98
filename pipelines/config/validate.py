"""Every cross-field rule of a scenario config, checked once at load by :func:`validate`.

The schema (``pipelines.config.schema``) checks each field on its own: types, ranges, choices. The rules here relate
fields to each other and to the registries (methods, backbones, datasets), and each problem is one line that starts
with the key path and says what to change. ``pipelines.config.load.validate_config`` (and so ``load_config``) runs
them after the schema, so a config that loads is one the graph compiler and the stages accept; nothing downstream
checks a config rule again. What can only be known from the data (pool sizes, files, weights) is checked where the
data is read (``pipelines.config.preflight`` and the stages).
"""
from __future__ import annotations

from typing import Callable

from compat_core.data.datasets import dataset_info, dataset_names
from compat_core.models.backbones import BACKBONES
from pipelines.config.model_uri import is_model_uri, parse_model_uri
from pipelines.config.schema import PRETRAIN_PREFIX, PoolSpec, ScenarioConfig, resolved_head
from pipelines.methods import METHODS
from pipelines.training.settings import BOUND_FIELDS


class ConfigError(ValueError):
    """A scenario config that cannot run; the message lists every problem with its key path."""


def validate(config: ScenarioConfig, source: str = "<config>") -> ScenarioConfig:
    """``config`` when every cross-field rule holds; else ConfigError listing every problem, one line each."""
    problems = config_problems(config)
    if problems:
        raise ConfigError(f"invalid scenario config {source}:\n  " + "\n  ".join(problems))
    return config


def config_problems(config: ScenarioConfig) -> list[str]:
    """``key.path: what is wrong; the fix`` for every broken rule (empty when the config is valid)."""
    return [problem for rule in RULES for problem in rule(config)]


# ---- seeds and sections ---------------------------------------------------------------------------------------------
def seed_problems(config: ScenarioConfig) -> list[str]:
    """Per-task seeds stay in torch's range; values other sections own are not set in ``training``."""
    problems = []
    if config.seed * 1000 + config.num_tasks - 1 >= 2 ** 64:
        problems.append(f"seed: {config.seed} is too large: task t trains with seed*1000+t, which must stay below "
                        f"2^64 (torch's seed range); use a seed below {(2 ** 64 - config.num_tasks) // 1000}")
    for name in sorted(config.training.model_fields_set & set(BOUND_FIELDS)):
        problems.append(f"training.{name}: set by {BOUND_FIELDS[name]}, not in the training section")
    return problems


def training_problems(config: ScenarioConfig) -> list[str]:
    """A pretrain entry's own epochs leave room for the training section's warm-up."""
    warmup = config.training.warmup_epochs
    return [f"pretrain[{i}].epochs: {spec.epochs} epochs leave no room for training.warmup_epochs = {warmup} "
            f"(warm-up must be shorter than training); raise the epochs or lower the warm-up"
            for i, spec in enumerate(config.pretrain) if spec.epochs is not None and warmup >= spec.epochs]


def resource_problems(config: ScenarioConfig) -> list[str]:
    """Only training stages run data-parallel."""
    return [f"resources.{name}.num_workers must be 1 (only pretrain and finetune train data-parallel), got "
            f"{getattr(config.resources, name).num_workers}"
            for name in ("extract", "evaluate") if getattr(config.resources, name).num_workers != 1]


# ---- pre-training and model sources ---------------------------------------------------------------------------------
def pretrain_problems(config: ScenarioConfig) -> list[str]:
    """Unique pretrain names; a pinned digest names a file; a pretrain entry's classifier family can feed the
    method."""
    problems = []
    names = [spec.name for spec in config.pretrain]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        problems.append(f"pretrain: names must be unique, {duplicates} appear more than once")
    method_classifier = METHODS.get(config.method.name).classifier
    for index, spec in enumerate(config.pretrain):
        if spec.init_sha256 is not None and spec.init is None:
            problems.append(f"pretrain[{index}].init_sha256: set but init is not; give the weights file the digest "
                            f"belongs to (pretrain[{index}].init)")
        if spec.resolved_classifier(method_classifier) == "learnable" and method_classifier == "simplex":
            problems.append(f"pretrain[{index}].classifier: 'learnable' cannot feed method {config.method.name!r}, "
                            f"whose d-Simplex classifier needs a d-Simplex model; use 'simplex' or 'method'")
    return problems


def model_sources(config: ScenarioConfig) -> dict[str, str]:
    """Config key -> the weights source it names (``initial_model``, ``replacements[i].source``)."""
    sources = {"initial_model": config.initial_model} if config.initial_model else {}
    sources.update({f"replacements[{i}].source": r.source for i, r in enumerate(config.replacements)})
    return sources


def source_problems(config: ScenarioConfig) -> list[str]:
    """``pretrain:<name>`` sources name a pretrain entry; ``models:/`` sources follow the MLflow URI grammar."""
    problems = []
    names = [spec.name for spec in config.pretrain]
    for key, source in model_sources(config).items():
        if source.startswith(PRETRAIN_PREFIX) and source[len(PRETRAIN_PREFIX):] not in names:
            problems.append(f"{key}: {source!r} names no pretrain entry; define it under 'pretrain' (defined: {names})")
        if is_model_uri(source):
            try:
                parse_model_uri(source, key)
            except ValueError as error:
                problems.append(str(error))
    return problems


def replacement_problems(config: ScenarioConfig) -> list[str]:
    """Replacements inside the sequence, one per task; what their anchor and adapters need of the method and the
    evaluation."""
    problems = []
    num_tasks = config.num_tasks
    method_classifier = METHODS.get(config.method.name).classifier
    seen_tasks: dict[int, int] = {}
    for index, replacement in enumerate(config.replacements):
        key = f"replacements[{index}]"
        if not 2 <= replacement.at_task <= num_tasks:
            problems.append(f"{key}.at_task: must be in 2..{num_tasks} (1-based task number) for a {num_tasks}-task "
                            f"sequence, got {replacement.at_task}")
        if replacement.at_task in seen_tasks:
            problems.append(f"{key}.at_task: task {replacement.at_task} is already replaced by "
                            f"replacements[{seen_tasks[replacement.at_task]}]; use one replacement per task")
        seen_tasks[replacement.at_task] = index
        if replacement.anchor == "replaced" and method_classifier != "simplex":
            problems.append(f"{key}.anchor: 'replaced' needs a d-Simplex method (one fixed classifier shared by "
                            f"both lines); {config.method.name!r} has a {method_classifier} classifier whose outputs "
                            f"differ between the lines")
        if replacement.adapters and config.evaluation.metric not in ("recall_at_1", "map"):
            problems.append(f"{key}.adapters: adapters are evaluated with recall_at_1 or map retrieval; "
                            f"evaluation.metric is {config.evaluation.metric!r} (remove the adapters or change the "
                            f"metric)")
    return problems


# ---- slots and classes ----------------------------------------------------------------------------------------------
def slot_problems(config: ScenarioConfig) -> list[str]:
    """Third-party classes fill slots 0.. left to right, fine-tuning classes K-1.. right to left: they must not meet;
    a listed class set has as many classes as the tasks use."""
    problems = []
    total_classes = sum(config.increments)
    left_slots = [0] + [spec.num_classes for spec in config.pretrain]
    left_slots += [r.num_pretrain_classes for r in config.replacements if r.num_pretrain_classes is not None]
    needed = max(left_slots) + total_classes
    if config.model.num_slots < needed:
        problems.append(f"model.num_slots: K={config.model.num_slots} is too small: {total_classes} fine-tuning "
                        f"classes (tasks.spec {config.tasks.spec!r}) + {max(left_slots)} pre-training slots need "
                        f"K >= {needed}")
    else:
        problems += task_source_slot_problems(config, max(left_slots), total_classes)
    if config.data.classes is not None and len(set(config.data.classes)) != total_classes:
        problems.append(f"data.classes: {len(set(config.data.classes))} distinct classes listed but tasks.spec "
                        f"{config.tasks.spec!r} uses {total_classes}")
    return problems


def task_source_slot_problems(config: ScenarioConfig, pretrain_slots: int, split_classes: int) -> list[str]:
    """The first ``tasks.sources`` entry whose classes no longer fit in the K slots: how many slots remain free after
    the tasks before it, and the K that holds every task listed (K is in every stage key: a larger K is a new run)."""
    K = config.model.num_slots
    used = pretrain_slots + split_classes
    needed = used + sum(source.num_classes for source in config.tasks.sources)
    for index, source in enumerate(config.tasks.sources):
        if used + source.num_classes > K:
            task = config.num_split_tasks + index + 1
            return [f"model.num_slots: K={K} is too small for tasks.sources[{index}] ({source.name!r}, task {task}): "
                    f"it brings {source.num_classes} classes but only {K - used} slot(s) remain free after the "
                    f"tasks before it ({pretrain_slots} pre-training slots + {used - pretrain_slots} classes of "
                    f"tasks 1..{task - 1}); set model.num_slots: {needed} to hold every task listed (K is part of "
                    f"every stage key, so a larger K is a new run: pre-allocate K for the classes to come)"]
        used += source.num_classes
    return []


def task_source_problems(config: ScenarioConfig) -> list[str]:
    """``tasks.sources``: unique names; a method that retrains on every task's data so far, or one without replay
    exemplars stored as shards, cannot take a task from another pool."""
    problems = []
    names = [source.name for source in config.tasks.sources]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        problems.append(f"tasks.sources: names must be unique, {duplicates} appear more than once")
    method = METHODS.get(config.method.name)
    if config.tasks.sources and method.retrain_from_scratch:
        problems.append(f"tasks.sources: method {config.method.name!r} retrains every model on the data of all "
                        f"tasks so far, which a task given by its own data does not keep; use a method that "
                        f"fine-tunes task after task (e.g. er, dsimplex-hoc) or put the classes in tasks.spec")
    return problems


def open_set_problems(config: ScenarioConfig) -> list[str]:
    """The open-set guard on what is visible without the data: the same class space cannot feed training and test
    with overlapping (or unrestricted) class lists (the data-level guard runs where the test pools are read)."""
    problems = []
    if config.evaluation.closed_set:
        return problems  # the named override: test classes may be training classes (printed by `compat plan`)
    training_pools = [("data", config.data)] + [(f"pretrain[{i}].pool", p.pool) for i, p in enumerate(config.pretrain)]
    training_pools += [(f"tasks.sources[{i}].data", s.data) for i, s in enumerate(config.tasks.sources)]
    for test_key, test_pool in (("evaluation.query_set", config.evaluation.query_set),
                                ("evaluation.gallery_set", config.evaluation.gallery_set)):
        for train_key, train_pool in training_pools:
            if train_pool.identity() != test_pool.identity():
                continue
            if train_pool.classes is None or test_pool.classes is None:
                problems.append(f"{test_key}: draws from the same dataset split as {train_key} "
                                f"({train_pool.dataset}/{train_pool.split}) without disjoint 'classes' lists; "
                                f"the open-set protocol needs test classes never seen in training (a closed-set "
                                f"protocol: evaluation.closed_set: true)")
                continue
            overlap = sorted(set(train_pool.classes) & set(test_pool.classes))
            if overlap:
                problems.append(f"{test_key}.classes: overlap with {train_key}.classes on {overlap[:10]}"
                                f"{' ...' if len(overlap) > 10 else ''}; training and test classes must be disjoint")
    return problems


# ---- registries -----------------------------------------------------------------------------------------------------
def pools(config: ScenarioConfig) -> dict[str, PoolSpec]:
    """Config key -> every pool the scenario reads."""
    found = {"data": config.data, "evaluation.query_set": config.evaluation.query_set,
             "evaluation.gallery_set": config.evaluation.gallery_set}
    found.update({f"pretrain[{i}].pool": p.pool for i, p in enumerate(config.pretrain)})
    found.update({f"tasks.sources[{i}].data": s.data for i, s in enumerate(config.tasks.sources)})
    return found


def training_backbones(config: ScenarioConfig) -> dict[str, str]:
    """Config key -> backbone name of every backbone the scenario names: the model's, pre-training entries' and
    replacements' own."""
    backbones = {"model.backbone": config.model.backbone}
    backbones.update({f"pretrain[{i}].backbone": p.backbone for i, p in enumerate(config.pretrain) if p.backbone})
    backbones.update({f"replacements[{i}].backbone": r.backbone for i, r in enumerate(config.replacements)
                      if r.backbone})
    return backbones


def registry_problems(config: ScenarioConfig) -> list[str]:
    """Backbones, datasets, splits and dataset options against the registries (a typo fails at load with its key
    path and the valid names, not when a stage runs); ``training.channels_last: on`` against the backbones."""
    problems = []
    for key, name in training_backbones(config).items():
        if name not in BACKBONES:
            problems.append(f"{key}: unknown backbone {name!r}; valid: {', '.join(BACKBONES.names())}")
        elif config.training.channels_last == "on" and not BACKBONES.get(name).convolutional:
            problems.append(f"training.channels_last: on needs convolutional backbones; {key} is {name!r}, which has "
                            f"no 2-D convolution besides its patch embedding; use auto or off")
    known = dataset_names()
    for key, pool in pools(config).items():
        if pool.dataset not in known:
            problems.append(f"{key}.dataset: unknown dataset {pool.dataset!r}; valid: {', '.join(known)}")
            continue
        info = dataset_info(pool.dataset)
        if info.splits and pool.split not in info.splits:
            problems.append(f"{key}.split: dataset {pool.dataset!r} has no split {pool.split!r}; valid: "
                            f"{', '.join(info.splits)}")
        unknown = sorted(set(pool.options) - set(info.options)) if info.options or info.splits else []
        if unknown:
            problems.append(f"{key}.options: {pool.dataset!r} has no option(s) {unknown}; valid: "
                            f"{', '.join(sorted(info.options)) or 'none'}")
    return problems


# ---- what the method needs ------------------------------------------------------------------------------------------
def method_problems(config: ScenarioConfig) -> list[str]:
    """What the method's class needs of the rest of the config (its name and params are checked by the schema)."""
    method_class = METHODS.get(config.method.name)
    problems = []
    if resolved_head(config, method_class.classifier) == "backbone":
        if method_class.classifier == "simplex":
            problems.append(f"model.head: 'backbone' needs a learnable-classifier method; {config.method.name!r} uses "
                            f"the d-Simplex, which needs the junction")
        others = [(f"pretrain[{i}]", p.backbone, p.backbone_config) for i, p in enumerate(config.pretrain)]
        others += [(f"replacements[{i}]", r.backbone, r.backbone_config) for i, r in enumerate(config.replacements)]
        for key, backbone, backbone_config in others:
            if (backbone is not None and backbone != config.model.backbone) or (
                    backbone_config is not None and backbone_config != config.model.backbone_config):
                problems.append(f"{key}.backbone: another architecture than model.backbone with the backbone-output "
                                f"features of {config.method.name!r} gives features of another width that no "
                                f"cross-model entry can compare; set model.head: junction (a shared K-1 junction)")
    if method_class.retrain_from_scratch and (config.replacements or config.initial_model):
        key = "replacements" if config.replacements else "initial_model"
        problems.append(f"{key}: method {config.method.name!r} retrains every model from the same initial weights, "
                        f"so it never starts from third-party weights; remove '{key}'")
    return problems


def bridge_obstacle(method: str, head: str) -> str | None:
    """Why the exact linear-head bridge cannot represent a model of ``method`` with ``head`` (None: it can)."""
    if METHODS.get(method).training_free:
        return f"method {method} stores logits, not junction features"
    if head != "junction":
        return "the model has no junction (model.head: backbone): its feature is the embedding itself"
    return None


def evaluation_problems(config: ScenarioConfig) -> list[str]:
    """``evaluation.features: bridge`` only where the bridge is exact (pipelines.stages.bridge_features)."""
    if config.evaluation.features != "bridge":
        return []
    obstacle = bridge_obstacle(config.method.name, resolved_head(config, METHODS.get(config.method.name).classifier))
    if obstacle is None:
        return []
    return [f"evaluation.features: 'bridge' is not possible here: {obstacle}; use auto or direct"]


RULES: tuple[Callable[[ScenarioConfig], list[str]], ...] = (
    seed_problems, training_problems, resource_problems, pretrain_problems, source_problems, replacement_problems,
    slot_problems, task_source_problems, open_set_problems, registry_problems, method_problems, evaluation_problems,
)

__all__ = ["ConfigError", "RULES", "bridge_obstacle", "config_problems", "model_sources", "validate"]

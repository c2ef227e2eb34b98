"""Scenario configs from files to validated objects and back: ``--set`` overrides, validation with errors that name
every bad key and list the valid ones, the cross-field checks that need the method registry, and the config as plain
data, YAML and a stable hash. The schema itself is ``pipelines.config.schema``."""
from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from compat_core import io
from compat_core.data.datasets import dataset_info, dataset_names
from compat_core.models.backbones import BACKBONES
from pipelines.config.local_paths import absolute_config, check_overridden_roots
from pipelines.config.method_params import error_lines
from pipelines.config.model_uri import is_model_uri, parse_model_uri
from pipelines.config.schema import ScenarioConfig, method_params_model, resolved_head
from pipelines.methods import METHODS


def apply_override(document: dict, assignment: str) -> None:
    """Apply one ``key.sub=value`` override in place; list items are addressed by index (``replacements.0.at_task``).

    The value is parsed as YAML (``3`` -> int, ``[1, 2]`` -> list, ``null`` -> None, ``a`` -> str).
    """
    if "=" not in assignment:
        raise ValueError(f"--set {assignment!r}: expected KEY=VALUE, e.g. training.epochs=5")
    key, raw_value = assignment.split("=", 1)
    key = key.strip()
    if not key:
        raise ValueError(f"--set {assignment!r}: empty key")
    try:
        value = yaml.safe_load(raw_value) if raw_value.strip() else ""
    except yaml.YAMLError as error:
        raise ValueError(f"--set {key}: value {raw_value!r} is not valid YAML ({error})") from None
    parts = re.split(r"\.|\[(\d+)\]", key)
    parts = [p for p in parts if p]
    node: Any = document
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        where = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ValueError(f"--set {key}: {where!r} must be an index below {len(node)}")
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                if node.get(part) is None:
                    node[part] = {}
                node = node[part]
        else:
            raise ValueError(f"--set {key}: {'.'.join(parts[:depth])!r} is a value, not a section")


def format_validation_error(error: ValidationError, source: str, document: Any = None,
                            root: type[BaseModel] | None = None) -> str:
    """One line per problem, each starting with the key path (``replacements[0].at_task: ...``); an unknown key
    lists the valid keys of its section (resolved in ``root``, default ScenarioConfig, along ``document``)."""
    return f"invalid scenario config {source}:\n  " + "\n  ".join(
        error_lines(error, document, root or ScenarioConfig, method_params_model))


class ConfigError(ValueError):
    """A scenario config that cannot run; the message lists every problem with its key path."""


def validate_config(document: dict, source: str = "<config>") -> ScenarioConfig:
    """Validate a plain dict into a :class:`ScenarioConfig` (and the method's own parameter schema)."""
    if not isinstance(document, dict):
        raise ConfigError(f"invalid scenario config {source}: expected a mapping at the top level")
    try:
        config = ScenarioConfig.model_validate(document)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, source, document)) from None
    check_method(config, source)
    check_names(config, source)
    return config


def check_names(config: ScenarioConfig, source: str = "<config>") -> None:
    """Backbones, datasets, splits and dataset options against the registries, and ``models:/`` sources against the
    MLflow URI grammar, so a typo fails at load time with its key path and the valid names (not when a stage runs)."""
    problems = []
    backbones = {"model.backbone": config.model.backbone}
    backbones.update({f"pretrain[{i}].backbone": p.backbone for i, p in enumerate(config.pretrain) if p.backbone})
    backbones.update({f"replacements[{i}].backbone": r.backbone for i, r in enumerate(config.replacements)
                      if r.backbone})
    for key, name in backbones.items():
        if name not in BACKBONES:
            problems.append(f"{key}: unknown backbone {name!r}; valid: {', '.join(BACKBONES.names())}")
    pools = {"data": config.data, "evaluation.query_set": config.evaluation.query_set,
             "evaluation.gallery_set": config.evaluation.gallery_set}
    pools.update({f"pretrain[{i}].pool": p.pool for i, p in enumerate(config.pretrain)})
    known = dataset_names()
    for key, pool in pools.items():
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
    sources = {f"replacements[{i}].source": r.source for i, r in enumerate(config.replacements)}
    if config.initial_model:
        sources["initial_model"] = config.initial_model
    for key, uri in sources.items():
        if is_model_uri(uri):
            try:
                parse_model_uri(uri, key)
            except ValueError as error:
                problems.append(str(error))
    if problems:
        raise ConfigError(f"invalid scenario config {source}:\n  " + "\n  ".join(problems))


def check_method(config: ScenarioConfig, source: str = "<config>") -> None:
    """What the method's class needs of the rest of the config (its name and params are checked by MethodSpec)."""
    method_class = METHODS.get(config.method.name)
    head = resolved_head(config, method_class.classifier)
    if head == "backbone":
        if method_class.classifier == "simplex":
            raise ConfigError(f"invalid scenario config {source}:\n  model.head: 'backbone' needs a learnable-classifier "
                              f"method; {config.method.name!r} uses the d-Simplex, which needs the junction")
        others = [(f"pretrain[{i}]", p.backbone, p.backbone_config) for i, p in enumerate(config.pretrain)]
        others += [(f"replacements[{i}]", r.backbone, r.backbone_config) for i, r in enumerate(config.replacements)]
        for key, backbone, backbone_config in others:
            if (backbone is not None and backbone != config.model.backbone) or (
                    backbone_config is not None and backbone_config != config.model.backbone_config):
                raise ConfigError(
                    f"invalid scenario config {source}:\n  {key}.backbone: another architecture than model.backbone "
                    f"with the backbone-output features of {config.method.name!r} gives features of another width "
                    f"that no cross-model entry can compare; set model.head: junction (a shared K-1 junction)")
    if getattr(method_class, "retrain_from_scratch", False) and (config.replacements or config.initial_model):
        key = "replacements" if config.replacements else "initial_model"
        raise ConfigError(
            f"invalid scenario config {source}:\n  {key}: method {config.method.name!r} retrains every model from the "
            f"same initial weights, so it never starts from third-party weights; remove '{key}'")


def read_document(path: str | os.PathLike) -> dict:
    """Read a YAML config file into a dict (local path or URI)."""
    text = io.read_bytes(path).decode("utf-8")
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML ({error})") from None
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: expected a mapping of config sections at the top level")
    return document


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> ScenarioConfig:
    """Load, override (``key.sub=value``) and validate a scenario YAML; raises ConfigError listing every problem.

    Local paths (data roots, weights, output.dir, output.shared_store) come back absolute, resolved against the
    current folder (pipelines.config.local_paths), so a Ray Job or a Tune trial running elsewhere writes where asked."""
    document = read_document(path)
    original = copy.deepcopy(document)
    for assignment in overrides or []:
        apply_override(document, assignment)
    config = absolute_config(validate_config(document, source=os.fspath(path)))
    if overrides:
        try:
            before = absolute_config(validate_config(original, source=os.fspath(path)))
        except ConfigError:
            before = None  # the file alone is incomplete; its overrides complete it
        if before is not None:
            try:
                check_overridden_roots(before, config)
            except ValueError as error:
                raise ConfigError(str(error)) from None
    return config


def config_to_dict(config: ScenarioConfig) -> dict:
    """The resolved config as plain JSON-compatible data (defaults filled in)."""
    return config.model_dump(mode="json")


def dump_config(config: ScenarioConfig) -> str:
    return yaml.safe_dump(config_to_dict(config), sort_keys=False)


def stable_hash(value: Any) -> str:
    """sha256 hex digest of a JSON-serialisable value with sorted keys (stage keys, config hashes)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def config_hash(config: ScenarioConfig) -> str:
    """Hash of everything that changes results (the output location excluded)."""
    data = copy.deepcopy(config_to_dict(config))
    data.pop("output", None)
    data.pop("resources", None)
    data.pop("description", None)
    data.pop("paper", None)
    for holder, name in [(data, "initial_model_ignore_keys"), *((entry, "init_ignore_keys") for entry in
                         data.get("pretrain", [])), *((entry, "ignore_keys") for entry in data.get("replacements", []))]:
        if holder.get(name) is None:  # unset ignore lists leave the hash of configs written without them alone
            holder.pop(name, None)
    for key in HOW_NOT_WHAT:  # where work is saved and how the input is read, not what it computes
        data.get("training", {}).pop(key, None)
    return stable_hash(data)


# training keys that change how a stage runs, never its results (the input stream yields the same batches in the
# same order for any number of workers): left out of stage keys and config hashes
HOW_NOT_WHAT = ("checkpoint_every_epochs", "checkpoint_every_minutes", "input_workers", "prefetch_batches")


__all__ = [
    "ConfigError", "apply_override", "config_hash", "config_to_dict", "dump_config",
    "format_validation_error", "load_config", "read_document", "stable_hash", "validate_config", "HOW_NOT_WHAT",
]

"""Scenario configs from files to validated objects and back: ``--set`` overrides, validation with errors that name
every bad key and list the valid ones, and the config as plain data, YAML and a stable hash. The schema itself is
``pipelines.config.schema``, the cross-field rules ``pipelines.config.validate``."""
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
from pipelines.config.local_paths import absolute_config, check_overridden_roots
from pipelines.config.method_params import error_lines
from pipelines.config.protocols import PROTOCOL_KEY, apply_protocol
from pipelines.config.schema import ScenarioConfig, method_params_model
from pipelines.config.validate import ConfigError, validate


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


def validate_config(document: dict, source: str = "<config>") -> ScenarioConfig:
    """Validate a plain dict into a :class:`ScenarioConfig`: a ``protocol:`` preset written in
    (:mod:`pipelines.config.protocols`), the schema (each field, and the method's own parameter schema), then every
    cross-field rule once (:func:`pipelines.config.validate.validate`)."""
    if not isinstance(document, dict):
        raise ConfigError(f"invalid scenario config {source}: expected a mapping at the top level")
    protocol = document.get(PROTOCOL_KEY)
    if protocol is not None:
        document = _with_protocol(document, source)
    elif PROTOCOL_KEY in document:  # protocol: null, no preset
        document = {key: value for key, value in document.items() if key != PROTOCOL_KEY}
    try:
        config = ScenarioConfig.model_validate(document)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, source, document)) from None
    config = validate(config, source)
    config._protocol = protocol
    return config


def _with_protocol(document: dict, source: str, scenario: dict | None = None) -> dict:
    """``document`` with its ``protocol:`` preset's values written in, for the pools and method of ``scenario``
    (default: ``document``); ConfigError naming the key otherwise."""
    try:
        return apply_protocol(document, document[PROTOCOL_KEY], source, scenario)
    except ValueError as error:
        raise ConfigError(str(error)) from None


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
    protocol = document.pop(PROTOCOL_KEY, None)
    if protocol is not None:  # file, then the preset's values, then every --set: --set may change a preset key
        document = _with_protocol({**original, PROTOCOL_KEY: protocol}, os.fspath(path), scenario=document)
        for assignment in overrides or []:
            apply_override(document, assignment)
        document.pop(PROTOCOL_KEY, None)
    config = absolute_config(validate_config(document, source=os.fspath(path)))
    config._protocol = protocol
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
    if data.get("model", {}).get("simplex_norm") == "row":  # the default: the hash of configs written without it
        data["model"].pop("simplex_norm")
    if not data.get("tasks", {}).get("sources"):  # no own-data task: the hash of configs written without them
        data.get("tasks", {}).pop("sources", None)
    for key in HOW_NOT_WHAT:  # where work is saved and how the input is read, not what it computes
        data.get("training", {}).pop(key, None)
    return stable_hash(data)


# training keys that change how a stage runs, never its results (the input stream yields the same batches in the
# same order for any number of workers): left out of stage keys and config hashes
HOW_NOT_WHAT = ("checkpoint_every_epochs", "checkpoint_every_minutes", "input_workers", "prefetch_batches",
                "persistent_workers", "prefetch_first_batches")


__all__ = [
    "ConfigError", "apply_override", "config_hash", "config_to_dict", "dump_config",
    "format_validation_error", "load_config", "read_document", "stable_hash", "validate_config", "HOW_NOT_WHAT",
]

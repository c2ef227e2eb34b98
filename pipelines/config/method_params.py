"""The base of every method's hyper-parameter model, and the one formatting of pydantic validation errors as
``key.path: message`` lines (an unknown key lists the valid keys of its section).

Both sit below the config schema and the method registry: methods subclass :class:`MethodParams` and format their
own errors here, the schema (``pipelines.config.schema``) selects a method's params model through the registry, and the
config loader passes that lookup in (``params_model_of``) to list the valid keys of a ``method.params`` section.
"""
from __future__ import annotations

import typing
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, ValidationError

from pipelines.training.settings import StrictModel


class MethodParams(StrictModel):
    """Base of every method's hyper-parameters: each method registers a subclass as its ``Params`` (defaults = the
    papers' values), selected by ``method.name``; unknown names and out-of-range values fail at load time."""

    # YAML gives native types: no "5" -> 5.0 or true -> 1 coercion, and no inf / nan
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


def _format_location(location: tuple) -> str:
    text = ""
    for part in location:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


def error_lines(error: ValidationError, document: Any, root: type[BaseModel],
                params_model_of: Callable[[str], type[MethodParams]] | None = None) -> list[str]:
    """``key.path: message`` per problem of ``error``; unknown keys list the valid keys of their section, resolved
    in ``root`` along ``document`` (``params_model_of(method name)`` resolves a ``MethodParams`` section)."""
    lines = []
    for item in error.errors():
        location = _format_location(tuple(item["loc"]))
        message = item["msg"]
        if message.startswith("Value error, "):
            message = message[len("Value error, "):]
        if item["type"] == "extra_forbidden":
            valid = _valid_keys(root, tuple(item["loc"])[:-1], document, params_model_of)
            message = f"unknown key; valid: {', '.join(valid)}" if valid else "unknown key (check the spelling)"
        elif item["type"] == "missing":
            message = "required key is missing"
        elif "input" in item and item["type"] not in ("value_error",):
            message = f"{message} (got {item['input']!r})"
        lines.append(f"{location}: {message}" if location else message)
    return lines


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The config section model inside a field annotation (``X``, ``X | None``, ``list[X]``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in typing.get_args(annotation):
        found = _section_model(argument)
        if found is not None:
            return found
    return None


def _valid_keys(model: type[BaseModel] | None, location: tuple, document: Any,
                params_model_of: Callable[[str], type[MethodParams]] | None) -> list[str]:
    """Keys a section accepts: walk ``location`` through the models (method params by the method's name)."""
    node = document
    for part in location:
        if isinstance(part, int):
            node = node[part] if isinstance(node, list) and 0 <= part < len(node) else None
            continue
        if model is None or part not in model.model_fields:
            return []
        parent, node = node, node.get(part) if isinstance(node, dict) else None
        model = _section_model(model.model_fields[part].annotation)
        if model is MethodParams:
            name = parent.get("name") if isinstance(parent, dict) else None
            if params_model_of is None:
                return []
            try:
                model = params_model_of(name)
            except KeyError:
                return []
    if model is None:
        return []
    return sorted(name for name, field in model.model_fields.items() if not field.exclude)

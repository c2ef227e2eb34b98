"""Dataclasses <-> JSON, the one codec of every stored record and manifest (stage records and their payloads, replay
shard and dataset manifests, a search's ``search.json``), and the one stored form of a manifest.

:func:`to_json` turns a dataclass into a plain JSON mapping: every field in declaration order, nested dataclasses,
lists, tuples and mappings converted in turn, and fields declared with :func:`optional` left out while they are
None (so a document written before such a field existed reads back and writes again to the same JSON).
:func:`from_json` reads a mapping back into the dataclass, driven by the field annotations: nested dataclasses,
``X | None``, ``list[X]``, ``tuple[X, ...]`` and ``dict[str, X]`` are rebuilt typed, any other value is taken as
stored. A key the class does not know, or a required key that is missing, is a ValueError naming where it was found.

:func:`encode_manifest` / :func:`decode_manifest`: JSON with sorted keys and a one-space indent, UTF-8; a stored
manifest that is not a JSON object raises :class:`~compat_core.integrity.IntegrityError` naming its file.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import types
import typing
from typing import Any, Mapping, TypeVar

import numpy as np

from compat_core.integrity import IntegrityError

T = TypeVar("T")
_OPTIONAL = "optional"


def optional(default: Any = None) -> Any:
    """A dataclass field left out of the JSON mapping while it is None (``default``: its value when absent)."""
    return dataclasses.field(default=default, metadata={_OPTIONAL: True})


def to_json(value: Any) -> Any:
    """``value`` as plain JSON data: dataclasses as mappings (``optional`` fields left out while None), tuples as
    lists, mappings and lists converted item by item, numpy scalars and arrays as numbers and lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {spec.name: to_json(getattr(value, spec.name)) for spec in dataclasses.fields(value)
                if not (spec.metadata.get(_OPTIONAL) and getattr(value, spec.name) is None)}
    if isinstance(value, Mapping):
        return {key: to_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(item) for item in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def from_json(cls: type[T], data: Any, where: str = "", path: str = "") -> T:
    """The ``cls`` instance of a JSON mapping (an instance of ``cls`` is returned as is). where: the document
    (e.g. ``stage record KEY``), path: the key path inside it; a ValueError names both and the keys when a key is
    unknown or a required one missing."""
    if isinstance(data, cls):
        return data
    name = cls.__name__
    location = ": ".join(part for part in (where, path) if part) or name
    if not isinstance(data, Mapping):
        raise ValueError(f"{location}: expected a mapping for {name}, got {type(data).__name__}")
    specs = dataclasses.fields(cls)
    names = [spec.name for spec in specs]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ValueError(f"{location}: unknown key(s) {unknown} for {name}; known: {', '.join(names)}")
    missing = [spec.name for spec in specs if spec.name not in data and spec.default is dataclasses.MISSING
               and spec.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{location}: missing key(s) {missing} for {name}")
    hints = _hints(cls)
    return cls(**{key: _decode(hints[key], value, where, f"{path}.{key}" if path else key)
                  for key, value in data.items()})


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _decode(hint: Any, value: Any, where: str, path: str) -> Any:
    """``value`` rebuilt as annotated by ``hint`` where that names dataclasses or containers of them."""
    if value is None:
        return None
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return from_json(hint, value, where, path)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [arg for arg in args if arg is not type(None)]
        return _decode(inner[0], value, where, path) if len(inner) == 1 else value
    if origin is list and args and isinstance(value, list):
        return [_decode(args[0], item, where, f"{path}[{index}]") for index, item in enumerate(value)]
    if origin is tuple and args and isinstance(value, (list, tuple)):
        kinds = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
        return tuple(_decode(kind, item, where, f"{path}[{index}]") for index, (kind, item) in
                     enumerate(zip(kinds, value)))
    if origin is dict and len(args) == 2:
        if not isinstance(value, Mapping):
            location = ": ".join(part for part in (where, path) if part)
            raise ValueError(f"{location}: expected a mapping, got {type(value).__name__}")
        return {key: _decode(args[1], item, where, f"{path}.{key}") for key, item in value.items()}
    return value


def encode_manifest(document: Any) -> bytes:
    """The stored form of a manifest (a mapping or a dataclass): JSON, keys sorted, one-space indent, UTF-8."""
    return json.dumps(to_json(document), indent=1, sort_keys=True).encode("utf-8")


def decode_manifest(data: bytes | str, uri: str | os.PathLike, what: str = "manifest",
                    stage_key: str | None = None) -> dict:
    """The mapping of a stored manifest; IntegrityError naming ``what`` and the file when it is not a JSON object."""
    try:
        document = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise IntegrityError.mismatch(what, uri, "manifest JSON", "valid JSON", f"invalid ({error})",
                                      stage_key=stage_key) from None
    if not isinstance(document, dict):
        raise IntegrityError.mismatch(what, uri, "manifest", "a JSON object", type(document).__name__,
                                      stage_key=stage_key)
    return document


__all__ = ["decode_manifest", "encode_manifest", "from_json", "optional", "to_json"]

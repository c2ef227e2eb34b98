"""Backbones, the compatible model (backbone -> junction -> d-Simplex), precision helpers and weight loading.

Importing this package imports no torch: each name below resolves from its module on first use (PEP 562), so code
that only needs the backbone registry (config validation, ``compat plan``) stays torch-free.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BACKBONES": "backbones",
    "create_backbone": "backbones",
    "embedding_width": "backbones",
    "small_test_config": "backbones",
    "CLASSIFIERS": "compat_model",
    "CompatModel": "compat_model",
    "ModelOutput": "compat_model",
    "create_model": "compat_model",
    "frozen_copy": "compat_model",
    "learnable_from_simplex": "compat_model",
    "load_model": "compat_model",
    "model_from_config": "compat_model",
    "save_model": "compat_model",
    "autocast_context": "precision",
    "prepare_batch": "precision",
    "prepare_for_speed": "precision",
    "LoadReport": "weights",
    "load_external_weights": "weights",
    "register_uri_resolver": "weights",
    "unregister_uri_resolver": "weights",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = sorted(_EXPORTS)

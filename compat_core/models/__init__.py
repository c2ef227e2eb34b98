"""Backbones, the compatible model (backbone -> junction -> d-Simplex), precision helpers and weight loading."""
from compat_core.models.backbones import BACKBONES, create_backbone, small_test_config
from compat_core.models.compat_model import (
    CLASSIFIERS,
    CompatModel,
    ModelOutput,
    create_model,
    frozen_copy,
    learnable_from_simplex,
    load_model,
    model_from_config,
    save_model,
)
from compat_core.models.precision import autocast_context, prepare_batch, prepare_for_speed
from compat_core.models.weights import (
    LoadReport,
    load_external_weights,
    register_uri_resolver,
)

__all__ = [
    "BACKBONES",
    "CLASSIFIERS",
    "CompatModel",
    "LoadReport",
    "ModelOutput",
    "autocast_context",
    "create_backbone",
    "create_model",
    "frozen_copy",
    "learnable_from_simplex",
    "load_external_weights",
    "load_model",
    "model_from_config",
    "prepare_batch",
    "prepare_for_speed",
    "register_uri_resolver",
    "save_model",
    "small_test_config",
]

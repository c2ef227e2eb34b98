"""Training recipes ("methods"): one registry of torch-free cards, ``get_method(name, **hparams)`` builds one.

:data:`METHODS` maps each name to its :class:`MethodCard` (hyper-parameter model, classifier family, traits), read by
config validation and graph compilation without importing torch. Every module of ``pipelines/methods/cards/`` is
imported here and registers its card, so a new method is one card module and one objective module, no list edited.
:func:`get_method` builds the torch :class:`pipelines.methods.objective.Method` a card names; the training loop in
:mod:`pipelines.training.loop` owns the model and optimiser and asks that object for its loss.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from pipelines.methods import cards
from compat_core.kinds import CLASSIFIERS
from pipelines.methods.card import METHODS, MethodCard, register_method


def _register_cards() -> None:
    """Import every card module of ``pipelines/methods/cards/`` (each registers its methods on import)."""
    for module in sorted(info.name for info in pkgutil.iter_modules(cards.__path__) if not info.ispkg):
        importlib.import_module(f"{cards.__name__}.{module}")


_register_cards()


def get_method(name: str, **hparams: Any):
    """A fresh method object; unknown names raise KeyError listing the valid ones, bad hparams raise ValueError."""
    return METHODS.get(name).build(**hparams)


def configured_method(spec: Any):
    """A fresh method object of a config's ``method`` section: ``spec.name`` with ``spec.params``."""
    return get_method(spec.name, **dict(spec.params))


__all__ = [
    "CLASSIFIERS",
    "METHODS",
    "MethodCard",
    "configured_method",
    "get_method",
    "register_method",
]

"""Training recipes ("methods"): one registry, ``get_method(name, **hparams)`` builds one with validated settings.

Every method is a :class:`pipelines.methods.base.Method`; the training loop in :mod:`pipelines.training.loop` owns the
model and optimiser and asks the method for its loss.
"""
from __future__ import annotations

from typing import Any

from compat_core.registry import Registry
from pipelines.methods.advbct import AdvBCTER
from pipelines.methods.base import Batch, Method, TaskContext
from pipelines.methods.bct import BCTER
from pipelines.methods.cores import CoReS
from pipelines.methods.cvs import CVS
from pipelines.methods.dsimplex import DSimplexFD, DSimplexHOC
from pipelines.methods.er import ER
from pipelines.methods.fan import FAN
from pipelines.methods.lce import LCEER
from pipelines.methods.training_free import LSP, PSP

METHODS: Registry = Registry("method")
for _method_type in (ER, DSimplexHOC, DSimplexFD, CoReS, BCTER, LCEER, AdvBCTER, FAN, CVS, PSP, LSP):
    METHODS.register(_method_type.name, _method_type)


def get_method(name: str, **hparams: Any) -> Method:
    """A fresh method object; unknown names raise KeyError listing the valid ones, bad hparams raise ValueError."""
    return METHODS.get(name)(**hparams)


def configured_method(spec: Any) -> Method:
    """A fresh method object of a config's ``method`` section: ``spec.name`` with ``spec.params``."""
    return get_method(spec.name, **dict(spec.params))


__all__ = [
    "Batch",
    "METHODS",
    "Method",
    "TaskContext",
    "configured_method",
    "get_method",
]

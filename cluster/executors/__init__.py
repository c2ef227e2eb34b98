"""Executors of the cluster layer, one module each, registered in :data:`pipelines.engine.backends.EXECUTORS` when
this package is imported: every module here is imported and registers its :class:`ExecutorCard`. A card names its
executor by dotted path, so importing this package (argument parsing does) imports no Ray."""
from __future__ import annotations

import importlib
import pkgutil

from pipelines.engine.backends import EXECUTORS, ExecutorCard, build_executor, executor_names


def _register_cards() -> None:
    for module in sorted(info.name for info in pkgutil.iter_modules(__path__) if not info.ispkg):
        importlib.import_module(f"{__name__}.{module}")


_register_cards()

__all__ = ["EXECUTORS", "ExecutorCard", "build_executor", "executor_names"]

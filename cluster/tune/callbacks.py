"""Tune callback classes built on first use: a module defines its callback as a mixin and gets the class from
:func:`lazy_callback_class`, so importing it does not import Ray (slow); the class is cached in that module under
the name pickle looks up (Tune stores callbacks with the experiment)."""
from __future__ import annotations

from typing import Any


def lazy_callback_class(module_globals: dict[str, Any], class_name: str, mixin: type) -> type:
    """The Ray Tune ``Callback`` subclass ``class_name`` of ``mixin``, created once per module and cached in
    ``module_globals`` (the module's ``globals()``) under ``_<class_name>_CLASS``."""
    cache = f"_{class_name}_CLASS"
    existing = module_globals.get(cache)
    if existing is not None:
        return existing
    from ray.tune import Callback

    cls = type(class_name, (mixin, Callback), {"__module__": module_globals["__name__"], "__doc__": mixin.__doc__})
    module_globals[cache] = cls
    return cls


__all__ = ["lazy_callback_class"]

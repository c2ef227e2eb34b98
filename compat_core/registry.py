"""One small registry type used for backbones, methods and datasets.

An unknown name raises a ``KeyError`` that lists every valid name, so a typo in a config is fixed in one step.
"""
from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to factories (classes or functions) of one kind (``kind`` is used in error messages)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str, obj: T | None = None):
        """Register ``obj`` under ``name``; usable as ``@REGISTRY.register("name")``."""
        if not name or not isinstance(name, str):
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def _add(target: T) -> T:
            if name in self._entries and self._entries[name] is not target:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = target
            return target

        if obj is not None:
            return _add(obj)
        return _add

    def get(self, name: str) -> T:
        """The object registered as ``name``; raises KeyError listing every valid name when there is none."""
        try:
            return self._entries[name]
        except KeyError:
            valid = ", ".join(sorted(self._entries)) or "(none registered)"
            raise KeyError(f"unknown {self.kind} {name!r}; valid {self.kind} names: {valid}") from None

    def names(self) -> list[str]:
        """Every registered name, sorted alphabetically."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)


__all__ = ["Registry", "Callable"]

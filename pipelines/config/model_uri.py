"""MLflow model-registry URIs, the one grammar: ``models:/NAME/VERSION``, ``models:/NAME/latest`` and
``models:/NAME@ALIAS``, parsed into a :class:`ModelUri` by :func:`parse_model_uri` (config sources, the run driver's
alias pinning, the registry resolver, the gate, the gallery index and the search service). Imports no MLflow."""
from __future__ import annotations

import re
from dataclasses import dataclass

SCHEME = "models:"
LATEST = "latest"
_GRAMMAR = re.compile(r"^models:/(?P<name>[^/@\s]+)(?:/(?P<version>\d+|latest)|@(?P<alias>[A-Za-z0-9_-]+))/?$")
EXPECTED = ("models:/NAME@ALIAS (e.g. models:/my-model@task-3), models:/NAME/VERSION or models:/NAME/latest")


@dataclass(frozen=True)
class ModelUri:
    """A registered model and which of its versions: ``version`` (digits, or ``latest``: the highest) or ``alias``
    (exactly one of them). ``str()`` gives the URI back."""

    name: str
    version: str | None = None
    alias: str | None = None

    def __post_init__(self) -> None:
        if (self.version is None) == (self.alias is None):
            raise ValueError(f"model URI of {self.name!r}: give exactly one of version and alias, got version "
                             f"{self.version!r} and alias {self.alias!r}")
        text = str(self)
        if not _GRAMMAR.match(text):
            raise ValueError(f"model URI {text!r}: expected {EXPECTED}")

    def __str__(self) -> str:
        return f"models:/{self.name}/{self.version}" if self.alias is None else f"models:/{self.name}@{self.alias}"

    @property
    def uri(self) -> str:
        return str(self)

    @property
    def pinned(self) -> bool:
        """True for ``models:/NAME/<digits>``: the same content whenever it is read (aliases and latest move)."""
        return self.version is not None and self.version != LATEST

    def at_version(self, version: str | int) -> "ModelUri":
        """``models:/NAME/<version>`` of the same registered model."""
        return ModelUri(self.name, str(version))


def is_model_uri(text: object) -> bool:
    """True when ``text`` uses the ``models:`` scheme (whether or not it follows the grammar)."""
    return isinstance(text, str) and text.startswith(SCHEME)


def parse_model_uri(uri: str, where: str = "model URI") -> ModelUri:
    """The :class:`ModelUri` of ``uri``; ValueError naming ``where`` (a config key, an option) and the URI otherwise."""
    match = _GRAMMAR.match(uri) if isinstance(uri, str) else None
    if match is None:
        raise ValueError(f"{where}: {uri!r} is not an MLflow model URI; expected {EXPECTED}")
    return ModelUri(match["name"], match["version"], match["alias"])


__all__ = ["LATEST", "ModelUri", "is_model_uri", "parse_model_uri"]

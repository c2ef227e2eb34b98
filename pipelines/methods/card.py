"""What a scenario config sees of a method, without torch: its :class:`MethodCard` (name, hyper-parameter model,
classifier family, traits) and the registry of every card, :data:`METHODS`.

A method is a card (``pipelines/methods/cards/<name>.py``: torch-free, read when a config is validated or a graph
compiled) and its training objective (``pipelines/methods/<name>.py``: the torch :class:`pipelines.methods.objective.Method`
subclass), which the card names by dotted path and :meth:`MethodCard.build` imports only when a stage trains or
extracts. Cards register themselves when :mod:`pipelines.methods` imports every module of ``cards/``, so adding a method
edits no list.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from compat_core.registry import Registry
from compat_core.kinds import CLASSIFIERS
from pipelines.config.method_params import MethodParams


METHODS: Registry = Registry("method")


@dataclass(frozen=True)
class MethodCard:
    """A method as configs and the stage graph see it.

    name: the ``method.name`` of configs. Params: the pydantic model of ``method.params`` (defaults = the papers'
    values). classifier: 'simplex' (fixed d-Simplex) or 'learnable' (growing linear head). objective:
    ``"module:Class"`` of the torch Method subclass that computes the loss. Traits the stages and the graph read:
    uses_replay (batches half memory / half task data), needs_old_model (the loss reads the frozen previous model),
    retrain_from_scratch (every task trains on all data seen so far from the same initial weights),
    requires_initial_state (the loop restarts from the weights drawn once for the sequence), independent_init (every
    step draws its own initial weights), training_free (compatibility comes from projecting the classifier outputs at
    extraction), adapts_gallery (matrix entries map gallery features through adapters the method trains).
    paper: what the method takes from its own paper (formula, weights) and which values the paper leaves open and
    are choices here, one line each; `compat plan` prints them under the config's paper section.
    """

    name: str
    Params: type[MethodParams]
    classifier: str
    objective: str
    uses_replay: bool = False
    needs_old_model: bool = False
    retrain_from_scratch: bool = False
    requires_initial_state: bool = False
    independent_init: bool = False
    training_free: bool = False
    adapts_gallery: bool = False
    paper: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.classifier not in CLASSIFIERS:
            raise ValueError(f"method {self.name!r}: classifier must be one of {CLASSIFIERS}, got {self.classifier!r}")
        if not (isinstance(self.Params, type) and issubclass(self.Params, MethodParams)):
            raise ValueError(f"method {self.name!r}: Params must be a MethodParams subclass, got {self.Params!r}")
        module, _, attribute = self.objective.partition(":")
        if not module or not attribute:
            raise ValueError(f"method {self.name!r}: objective must be 'module:Class', got {self.objective!r}")

    def objective_class(self) -> type:
        """The torch Method subclass named by ``objective`` (imports its module, and so torch)."""
        module, _, attribute = self.objective.partition(":")
        return getattr(importlib.import_module(module), attribute)

    def build(self, **hparams: Any) -> Any:
        """A fresh method object with validated ``hparams`` (ValueError naming the method and each bad key)."""
        return self.objective_class()(**hparams)


def register_method(card: MethodCard) -> MethodCard:
    """Add ``card`` to :data:`METHODS` under its name (ValueError when another card holds that name)."""
    METHODS.register(card.name, card)
    return card


__all__ = ["METHODS", "MethodCard", "MethodParams", "register_method"]

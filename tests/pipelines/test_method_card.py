"""pipelines.methods.card: a card refuses what cannot be a method, names its objective, and the registry refuses a
second card under a taken name."""
from __future__ import annotations

import pytest
from pydantic import BaseModel

from compat_core.registry import Registry
from pipelines.methods.card import MethodCard, MethodParams
from pipelines.methods.er import ER


def test_a_card_refuses_a_bad_classifier_params_or_objective():
    with pytest.raises(ValueError, match="classifier must be one of \\('simplex', 'learnable'\\), got 'linear'"):
        MethodCard("m", MethodParams, "linear", "pipelines.methods.er:ER")
    with pytest.raises(ValueError, match="Params must be a MethodParams subclass"):
        MethodCard("m", BaseModel, "simplex", "pipelines.methods.er:ER")
    with pytest.raises(ValueError, match="objective must be 'module:Class', got 'pipelines.methods.er.ER'"):
        MethodCard("m", MethodParams, "simplex", "pipelines.methods.er.ER")


def test_a_card_builds_its_objective_with_validated_hyper_parameters():
    card = MethodCard("er-again", MethodParams, "learnable", "pipelines.methods.er:ER")
    assert card.objective_class() is ER
    with pytest.raises(ValueError, match="method 'er': lam: unknown key"):
        card.build(lam=1.0)  # ER's card takes no hyper-parameters


def test_a_taken_name_is_refused():
    registry: Registry = Registry("method")
    card = MethodCard("x", MethodParams, "simplex", "pipelines.methods.cores:CoReS")
    registry.register("x", card)
    registry.register("x", card)  # the same card again is harmless (a module imported twice)
    with pytest.raises(ValueError, match="method 'x' is already registered"):
        registry.register("x", MethodCard("x", MethodParams, "learnable", "pipelines.methods.er:ER"))

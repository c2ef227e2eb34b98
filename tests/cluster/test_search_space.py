"""Search-space grammar: validation errors name the key; Optuna define-by-run sampling honours types and conditions."""
from __future__ import annotations

import math

import numpy as np
import optuna
import pytest

from cluster.tune.search_space import SearchSpaceError, parse_space
from cluster.tune.spec import apply_values, objective_metric, trial_config
from pipelines.results.assemble import headline_metrics

optuna.logging.set_verbosity(optuna.logging.WARNING)

CONDITIONAL = {
    "parameters": {
        "method.name": {"type": "categorical", "values": ["er", "dsimplex-hoc"]},
        "method.params.rho": {"type": "categorical", "values": [0.1, 5.0, 25.0], "when": {"method.name": "dsimplex-hoc"}},
        "training.optimizer.lr": {"type": "loguniform", "low": 0.001, "high": 0.1},
        "replay.per_class": {"type": "int", "low": 5, "high": 40, "step": 5},
        "training.optimizer.momentum": {"type": "uniform", "low": 0.5, "high": 0.9},
    }
}


@pytest.mark.parametrize("parameters, expected", [
    ({"a.b": {"type": "gaussian"}}, "parameters.a.b.type: expected one of"),
    ({"a.b": {"type": "uniform", "low": 1, "high": 1}}, "parameters.a.b: low (1) must be below high (1)"),
    ({"a.b": {"type": "uniform", "low": 0}}, "parameters.a.b.high: required"),
    ({"a.b": {"type": "loguniform", "low": 0, "high": 1}}, "parameters.a.b.low: loguniform needs low > 0"),
    ({"a.b": {"type": "int", "low": 0, "high": 10, "step": 3}}, "parameters.a.b.step: high - low (10)"),
    ({"a.b": {"type": "int", "low": 0.5, "high": 10}}, "parameters.a.b.low: type int needs an integer"),
    ({"a.b": {"type": "categorical", "values": []}}, "parameters.a.b.values: expected a non-empty list"),
    ({"a.b": {"type": "categorical", "values": [1], "low": 0}}, "parameters.a.b: unknown field(s) ['low']"),
    ({"x": {"type": "uniform", "low": 0, "high": 1, "when": {"m": "a"}},
      "m": {"type": "categorical", "values": ["a"]}}, "parameters.x.when: 'm' is not a parameter declared before"),
    ({"m": {"type": "categorical", "values": ["a", "b"]},
      "x": {"type": "uniform", "low": 0, "high": 1, "when": {"m": "c"}}}, "parameters.x.when.m: ['c'] are not among"),
    ({"m": {"type": "uniform", "low": 0, "high": 1},
      "x": {"type": "uniform", "low": 0, "high": 1, "when": {"m": 0.5}}}, "'m' must be a categorical parameter"),
])
def test_invalid_spaces_name_the_key(parameters, expected):
    with pytest.raises(SearchSpaceError) as error:
        parse_space({"parameters": parameters}, "space.yaml")
    assert expected in str(error.value)
    assert str(error.value).startswith("space.yaml")


def test_top_level_and_fixed_errors():
    with pytest.raises(SearchSpaceError, match=r"space.yaml: unknown top-level key\(s\) \['parameter'\]"):
        parse_space({"parameter": {}}, "space.yaml")
    with pytest.raises(SearchSpaceError, match=r"fixed: \['a.b'\] are also sampled"):
        parse_space({"parameters": {"a.b": {"type": "categorical", "values": [1]}}, "fixed": {"a.b": 2}}, "space.yaml")


def test_define_by_run_samples_types_ranges_and_conditions():
    space = parse_space(CONDITIONAL, "space.yaml")
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=3))
    seen_methods = set()
    for _ in range(60):
        trial = study.ask()
        space(trial)
        params = trial.params
        seen_methods.add(params["method.name"])
        # rho exists exactly when the method is d-Simplex-HOC
        assert ("method.params.rho" in params) == (params["method.name"] == "dsimplex-hoc")
        if "method.params.rho" in params:
            assert params["method.params.rho"] in (0.1, 5.0, 25.0)
        assert 0.001 <= params["training.optimizer.lr"] <= 0.1
        assert params["replay.per_class"] in (5, 10, 15, 20, 25, 30, 35, 40)
        assert 0.5 <= params["training.optimizer.momentum"] <= 0.9
        study.tell(trial, 0.0)
    assert seen_methods == {"er", "dsimplex-hoc"}
    # log-uniform: about half of the draws fall below the geometric midpoint sqrt(0.001 * 0.1) = 0.01
    below = np.mean([t.params["training.optimizer.lr"] < 0.01 for t in study.trials])
    assert 0.3 < below < 0.7


def test_seeded_sampling_is_reproducible():
    space = parse_space(CONDITIONAL, "space.yaml")

    def draws(seed):
        study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
        values = []
        for index in range(12):
            trial = study.ask()
            space(trial)
            values.append(trial.params)
            study.tell(trial, float(index % 3))
        return values

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_representative_points_cover_every_choice_and_activate_conditions():
    space = parse_space({"parameters": {
        "method.name": {"type": "categorical", "values": ["er", "dsimplex-hoc"]},
        "method.params.lam": {"type": "categorical", "values": [0.0, 1.0], "when": {"method.name": "dsimplex-hoc"}},
        "training.epochs": {"type": "int", "low": 1, "high": 3},
    }}, "space.yaml")
    assert space.representative_points() == [
        {"method.name": "er", "training.epochs": 1},
        {"method.name": "dsimplex-hoc", "method.params.lam": 0.0, "training.epochs": 1},
        {"method.name": "dsimplex-hoc", "method.params.lam": 1.0, "training.epochs": 1},
        {"method.name": "er", "training.epochs": 3},
    ]
    assert parse_space(space.to_dict(), "again").to_dict() == space.to_dict()


def test_trial_config_applies_values_and_drops_params_of_another_method():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))
    import tiny_scenario_helpers as tiny

    tiny.register()  # the tiny-synth dataset: configs naming it validate only once it is registered
    base = tiny.scenario("dsimplex-hoc", {"lam": 0.1, "rho": 10.0})
    config = trial_config(base, {"training.epochs": 2}, {"method.params.rho": 5.0, "replay.per_class": 7}, "/tmp/x")
    assert config.method.params.model_dump() == {"lam": 0.1, "rho": 5.0, "masking": "standard"}
    assert (config.training.epochs, config.replay.per_class, config.output.dir) == (2, 7, "/tmp/x")
    switched = trial_config(base, {}, {"method.name": "er"}, "/tmp/y")
    assert switched.method.name == "er" and switched.method.params.model_dump() == {}
    assert apply_values({"a": [{"b": 1}]}, {"a.0.b": 2.5}) == {"a": [{"b": 2.5}]}
    with pytest.raises(ValueError, match="method.params"):
        trial_config(base, {}, {"method.params.lamda": 0.3}, "/tmp/z")


def test_headline_metrics_of_a_prefix_hand_worked():
    nan = float("nan")
    # C[1,0] = 0.6 > C[0,0] = 0.5: the one pair is compatible
    two = np.array([[0.5, nan], [0.6, 0.7]])
    metrics = headline_metrics(two)
    assert metrics["AC"] == 1.0
    assert math.isclose(metrics["AA"], (0.5 + 0.6 + 0.7) / 3)
    assert math.isclose(metrics["ACA"], 0.6)          # 0.6 summed over 1 pair
    assert math.isclose(metrics["BC"], 0.6 - 0.5)
    assert math.isclose(metrics["FC"], 0.6 - 0.7)
    one = headline_metrics(np.array([[0.5]]))
    assert one == {"AC": None, "AA": 0.5, "ACA": None, "BC": None, "FC": None}
    # three models: pairs (1,0) 0.4 < 0.5 fails, (2,0) 0.55 > 0.5 ok, (2,1) 0.65 > 0.6 ok -> ACA = (0.55+0.65)/3
    three = np.array([[0.5, nan, nan], [0.4, 0.6, nan], [0.55, 0.65, 0.8]])
    metrics = headline_metrics(three)
    assert math.isclose(metrics["AC"], 2 / 3) and math.isclose(metrics["ACA"], (0.55 + 0.65) / 3)
    assert objective_metric("ACA") == "ACA" and objective_metric("aa") == "AA"
    with pytest.raises(ValueError, match="--objective: unknown objective 'acc'"):
        objective_metric("acc")

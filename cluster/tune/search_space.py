"""Search spaces for ``compat tune``: a small YAML grammar, validated, turned into an Optuna define-by-run function.

A space file maps scenario config keys (the dotted paths of ``--set``) to ranges::

    description: d-Simplex-HOC lambda / rho ablation
    parameters:                                   # sampled in this order
      method.name: {type: categorical, values: [er, dsimplex-hoc]}
      method.params.lam: {type: categorical, values: [0, 0.05, 0.1], when: {method.name: dsimplex-hoc}}
      method.params.rho: {type: loguniform, low: 0.1, high: 25, when: {method.name: [dsimplex-hoc]}}
      training.optimizer.lr: {type: loguniform, low: 0.001, high: 0.1}
      training.epochs: {type: int, low: 1, high: 4}          # optional step (default 1) and log
      replay.per_class: {type: int, low: 5, high: 40, step: 5}
      training.optimizer.momentum: {type: uniform, low: 0.5, high: 0.95}   # optional step
    fixed:                                        # optional: overrides applied to every trial
      training.epochs: 2

Types: ``uniform`` (float in [low, high], optional ``step``), ``loguniform`` (float, 0 < low < high, sampled
uniformly in log space), ``int`` (integers low..high inclusive, optional ``step`` and ``log``), ``categorical``
(``values``: a non-empty list of scalars). ``when`` makes a parameter conditional: it is sampled only when every
named parameter (a categorical declared *before* it) took one of the listed values; otherwise the config keeps its
own value for that key. Every error names the file and the key.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from compat_core import io as cio

PARAMETER_TYPES = ("uniform", "loguniform", "int", "categorical")
_ALLOWED_FIELDS = {
    "uniform": {"type", "low", "high", "step", "when"},
    "loguniform": {"type", "low", "high", "when"},
    "int": {"type", "low", "high", "step", "log", "when"},
    "categorical": {"type", "values", "when"},
}
_TOP_LEVEL = {"description", "parameters", "fixed"}


class SearchSpaceError(ValueError):
    """A search-space file or mapping that cannot be used; the message names the file and key."""


@dataclass(frozen=True)
class Parameter:
    """One sampled config key. ``when``: {earlier categorical key: allowed values} that must all hold."""

    key: str
    type: str
    low: float | int | None = None
    high: float | int | None = None
    step: float | int | None = None
    log: bool = False
    values: tuple = ()
    when: dict[str, tuple] = field(default_factory=dict)

    def active(self, sampled: dict[str, Any]) -> bool:
        """True when every condition holds for the values sampled so far (missing condition key: inactive)."""
        return all(key in sampled and sampled[key] in allowed for key, allowed in self.when.items())

    def corner_values(self) -> list[Any]:
        """Values that exercise the range's ends (categorical: every value); used to validate configs up front."""
        if self.type == "categorical":
            return list(self.values)
        return [self.low, self.high]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _parse_parameter(key: str, spec: Any, earlier: dict[str, Parameter], where: str) -> Parameter:
    name = f"{where}: parameters.{key}"
    if not isinstance(key, str) or not key or any(not part for part in key.split(".")):
        raise SearchSpaceError(f"{where}: parameter key {key!r}: expected a dotted config path like "
                               f"method.params.lam")
    if not isinstance(spec, dict):
        raise SearchSpaceError(f"{name}: expected a mapping like {{type: uniform, low: 0, high: 1}}, got {spec!r}")
    kind = spec.get("type")
    if kind not in PARAMETER_TYPES:
        raise SearchSpaceError(f"{name}.type: expected one of {', '.join(PARAMETER_TYPES)}, got {kind!r}")
    unknown = sorted(set(spec) - _ALLOWED_FIELDS[kind])
    if unknown:
        raise SearchSpaceError(f"{name}: unknown field(s) {unknown} for type {kind}; allowed: "
                               f"{sorted(_ALLOWED_FIELDS[kind])}")
    when = _parse_when(spec.get("when"), earlier, name)
    if kind == "categorical":
        values = spec.get("values")
        if not isinstance(values, list) or not values:
            raise SearchSpaceError(f"{name}.values: expected a non-empty list, got {values!r}")
        bad = [v for v in values if not _is_scalar(v)]
        if bad:
            raise SearchSpaceError(f"{name}.values: expected scalars (numbers, strings, booleans, null), got {bad}")
        if len({json.dumps(v) for v in values}) != len(values):
            raise SearchSpaceError(f"{name}.values: duplicates in {values}")
        return Parameter(key, kind, values=tuple(values), when=when)
    for bound in ("low", "high"):
        if bound not in spec:
            raise SearchSpaceError(f"{name}.{bound}: required for type {kind}")
        if not _is_number(spec[bound]):
            raise SearchSpaceError(f"{name}.{bound}: expected a finite number, got {spec[bound]!r}")
    low, high = spec["low"], spec["high"]
    if not low < high:
        raise SearchSpaceError(f"{name}: low ({low}) must be below high ({high})")
    step = spec.get("step")
    if step is not None and (not _is_number(step) or step <= 0):
        raise SearchSpaceError(f"{name}.step: expected a number > 0, got {step!r}")
    log = spec.get("log", False)
    if not isinstance(log, bool):
        raise SearchSpaceError(f"{name}.log: expected true or false, got {log!r}")
    if kind == "loguniform" and low <= 0:
        raise SearchSpaceError(f"{name}.low: loguniform needs low > 0, got {low}")
    if kind == "int":
        for bound, value in (("low", low), ("high", high), ("step", step)):
            if value is not None and not float(value).is_integer():
                raise SearchSpaceError(f"{name}.{bound}: type int needs an integer, got {value!r}")
        low, high = int(low), int(high)
        step = int(step) if step is not None else 1
        if log and (low <= 0 or step != 1):
            raise SearchSpaceError(f"{name}: log-scaled int needs low > 0 and step 1 (got low {low}, step {step})")
        if (high - low) % step:
            raise SearchSpaceError(f"{name}.step: high - low ({high - low}) must be a multiple of step ({step})")
    return Parameter(key, kind, low=low, high=high, step=step, log=log or kind == "loguniform", when=when)


def _parse_when(when: Any, earlier: dict[str, Parameter], name: str) -> dict[str, tuple]:
    if when is None:
        return {}
    if not isinstance(when, dict) or not when:
        raise SearchSpaceError(f"{name}.when: expected a mapping {{earlier parameter: value or [values]}}, "
                               f"got {when!r}")
    conditions = {}
    for other, allowed in when.items():
        if other not in earlier:
            raise SearchSpaceError(f"{name}.when: {other!r} is not a parameter declared before this one "
                                   f"(declared before: {sorted(earlier) or 'none'})")
        if earlier[other].type != "categorical":
            raise SearchSpaceError(f"{name}.when: {other!r} must be a categorical parameter to condition on, "
                                   f"it is {earlier[other].type}")
        allowed = tuple(allowed) if isinstance(allowed, list) else (allowed,)
        missing = [v for v in allowed if v not in earlier[other].values]
        if missing:
            raise SearchSpaceError(f"{name}.when.{other}: {missing} are not among its values "
                                   f"{list(earlier[other].values)}")
        conditions[other] = allowed
    return conditions


class SearchSpace:
    """A validated search space; calling it with an Optuna trial samples the active parameters (define-by-run).

    It is a plain picklable object (Ray Tune pickles the searcher, including this space, into the experiment
    state so that a resumed search continues with the same space).
    """

    def __init__(self, parameters: list[Parameter], fixed: dict[str, Any] | None = None, description: str = "",
                 source: str = "<space>") -> None:
        if not parameters:
            raise SearchSpaceError(f"{source}: parameters: at least one parameter is needed")
        self.parameters = list(parameters)
        self.fixed = dict(fixed or {})
        self.description = description
        self.source = source
        overlap = sorted(set(self.fixed) & {p.key for p in self.parameters})
        if overlap:
            raise SearchSpaceError(f"{source}: fixed: {overlap} are also sampled parameters; keep one of the two")

    def __call__(self, trial: Any) -> None:
        """Optuna define-by-run: suggest each active parameter in declaration order (values are captured by Tune)."""
        sampled: dict[str, Any] = {}
        for parameter in self.parameters:
            if not parameter.active(sampled):
                continue
            sampled[parameter.key] = suggest(trial, parameter)
        return None

    @property
    def keys(self) -> list[str]:
        return [p.key for p in self.parameters]

    def to_dict(self) -> dict:
        """The space as the YAML grammar's mapping (for search.json and MLflow params)."""
        parameters = {}
        for p in self.parameters:
            entry: dict[str, Any] = {"type": p.type}
            if p.type == "categorical":
                entry["values"] = list(p.values)
            else:
                entry.update(low=p.low, high=p.high)
                if p.step is not None and not (p.type == "int" and p.step == 1):
                    entry["step"] = p.step
                if p.type == "int" and p.log:
                    entry["log"] = True
            if p.when:
                entry["when"] = {k: list(v) for k, v in p.when.items()}
            parameters[p.key] = entry
        return {"description": self.description, "parameters": parameters, "fixed": dict(self.fixed)}

    def representative_points(self) -> list[dict[str, Any]]:
        """Assignments covering every categorical value and both ends of every range, conditions respected.

        Each point varies one parameter; the others take their first value, except the parameters the varied one is
        conditioned on, which take a value that activates it. Points are built in declaration order.
        """
        points = []
        for varied in self.parameters:
            for value in varied.corner_values():
                sampled: dict[str, Any] = {}
                for parameter in self.parameters:
                    if not parameter.active(sampled):
                        continue
                    if parameter is varied:
                        sampled[parameter.key] = value
                    elif parameter.key in varied.when:  # a value that activates the varied parameter
                        sampled[parameter.key] = varied.when[parameter.key][0]
                    else:
                        sampled[parameter.key] = parameter.corner_values()[0]
                if sampled.get(varied.key, object()) == value and sampled not in points:
                    points.append(sampled)
        return points


def suggest(trial: Any, parameter: Parameter) -> Any:
    """One ``trial.suggest_*`` call for ``parameter`` (Optuna's Trial API, or Ray's captor around it)."""
    if parameter.type == "categorical":
        return trial.suggest_categorical(parameter.key, list(parameter.values))
    if parameter.type == "int":
        return trial.suggest_int(parameter.key, parameter.low, parameter.high, step=parameter.step or 1,
                                 log=parameter.log)
    if parameter.type == "loguniform":
        return trial.suggest_float(parameter.key, float(parameter.low), float(parameter.high), log=True)
    return trial.suggest_float(parameter.key, float(parameter.low), float(parameter.high),
                               step=None if parameter.step is None else float(parameter.step))


def parse_space(document: Any, source: str = "<space>") -> SearchSpace:
    """Validate a space mapping (the YAML grammar of the module docstring) into a :class:`SearchSpace`."""
    if not isinstance(document, dict):
        raise SearchSpaceError(f"{source}: expected a mapping with 'parameters' at the top level")
    unknown = sorted(set(document) - _TOP_LEVEL)
    if unknown:
        raise SearchSpaceError(f"{source}: unknown top-level key(s) {unknown}; allowed: {sorted(_TOP_LEVEL)}")
    parameters_doc = document.get("parameters")
    if not isinstance(parameters_doc, dict) or not parameters_doc:
        raise SearchSpaceError(f"{source}: parameters: expected a non-empty mapping of config key -> range")
    parameters: dict[str, Parameter] = {}
    for key, spec in parameters_doc.items():
        parameters[key] = _parse_parameter(key, spec, dict(parameters), source)
    fixed = document.get("fixed") or {}
    if not isinstance(fixed, dict):
        raise SearchSpaceError(f"{source}: fixed: expected a mapping of config key -> value, got {fixed!r}")
    description = document.get("description") or ""
    if not isinstance(description, str):
        raise SearchSpaceError(f"{source}: description: expected text, got {description!r}")
    return SearchSpace(list(parameters.values()), fixed, description, source)


def load_space(path: str | os.PathLike) -> SearchSpace:
    """Read and validate a search-space YAML file (local path or URI)."""
    source = os.fspath(path)
    if not cio.exists(source):
        raise FileNotFoundError(f"search space {source}: no such file")
    try:
        document = yaml.safe_load(cio.read_bytes(source).decode("utf-8"))
    except yaml.YAMLError as error:
        raise SearchSpaceError(f"{source}: not valid YAML ({error})") from None
    return parse_space(document, source)


__all__ = ["Parameter", "SearchSpace", "SearchSpaceError", "PARAMETER_TYPES", "parse_space", "load_space",
           "suggest"]

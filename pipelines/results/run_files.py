"""A finished run directory read back and checked: ``config.yaml``, ``matrix.json`` and ``metrics.json`` as the
run's :class:`pipelines.results.assemble.RunResult` (fractions; the metrics checked against a recomputation from the
matrix), the file names of a run directory, and readable metric names.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import yaml

from compat_core.evaluation.metrics import CompatibilityMatrix, metrics_by_task
from pipelines.results.assemble import HEADLINE_METRICS, MATRIX_FILE, METRICS_FILE, RunResult

CONFIG_FILE = "config.yaml"
REPORT_FILE = "report.md"
MATRIX_PNG = "matrix.png"
CURVES_PNG = "aa_tau.png"
MATRIX_CSV = "matrix.csv"

SUMMARY_METRICS = HEADLINE_METRICS

_METRIC_NAMES = {
    "recall_at_1": "Recall@1",
    "map": "mAP",
    "verification": "verification accuracy",
    "tar_at_far": "TAR@FAR",
}

# When a metrics.json value differs from the matrix recomputation by more than this, the report says so.
_CONSISTENCY_TOLERANCE = 1e-9


def metric_display_name(metric: str) -> str:
    """Readable name of a retrieval metric key (``recall_at_1`` -> ``Recall@1``); unknown keys are returned as is."""
    return _METRIC_NAMES.get(metric, metric)


# --------------------------------------------------------------------------------------------------------------------
# Loading a run directory
# --------------------------------------------------------------------------------------------------------------------


def _require_file(run_dir: Path, name: str) -> Path:
    path = run_dir / name
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: missing; {run_dir} is not a finished run directory (expected {CONFIG_FILE}, {MATRIX_FILE} and "
            f"{METRICS_FILE}, written when `compat run` completes)"
        )
    return path


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None


def _as_fraction(value: Any, where: str, signed: bool = False) -> float:
    """A metrics.json number as float; ``null`` becomes NaN (undefined metric)."""
    if value is None:
        return float("nan")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: expected a number (fraction) or null, got {value!r}")
    low = -1.0 if signed else 0.0
    if not (math.isfinite(value) and low <= value <= 1.0):
        raise ValueError(f"{where}: expected a fraction in [{low:g}, 1] (not percent), got {value!r}")
    return float(value)


def _parse_metrics(data: Any, path: Path, num_tasks: int) -> tuple[dict[str, float], list[float], list[float]]:
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object with keys {', '.join(SUMMARY_METRICS)}, AC_tau, AA_tau")
    metrics = {}
    for key in SUMMARY_METRICS:
        if key not in data:
            raise KeyError(f"{path}: missing key {key!r} (expected {', '.join(SUMMARY_METRICS)} as fractions)")
        metrics[key] = _as_fraction(data[key], f"{path}: {key}", signed=key in ("BC", "FC"))
    curves = []
    for key in ("AC_tau", "AA_tau"):
        if key not in data:
            raise KeyError(f"{path}: missing key {key!r} (expected a list of {num_tasks} fractions, one per task)")
        values = data[key]
        if not isinstance(values, list) or len(values) != num_tasks:
            raise ValueError(
                f"{path}: {key} must be a list of {num_tasks} values (one per task, matching {MATRIX_FILE}), "
                f"got {values!r}"
            )
        curves.append([_as_fraction(v, f"{path}: {key}[{i}]") for i, v in enumerate(values)])
    return metrics, curves[0], curves[1]


def _parse_replacements(config: dict, path: Path, num_tasks: int) -> dict[int, str]:
    replacements = config.get("replacements") or []
    if not isinstance(replacements, list):
        raise ValueError(
            f"{path}: replacements must be a list of {{at_task: <1-based task>, ...}}, got {replacements!r}"
        )
    sources: dict[int, str] = {}
    for index, entry in enumerate(replacements):
        at_task = entry.get("at_task") if isinstance(entry, dict) else None
        if isinstance(at_task, bool) or not isinstance(at_task, int) or not 1 <= at_task <= num_tasks:
            raise ValueError(
                f"{path}: replacements[{index}].at_task must be a 1-based task number in 1..{num_tasks}, "
                f"got {at_task!r}"
            )
        sources[at_task] = str(entry.get("source", ""))
    return dict(sorted(sources.items()))


def _consistency_warnings(matrix: CompatibilityMatrix, metrics: dict[str, float], ac_tau: list[float],
                          aa_tau: list[float]) -> list[str]:
    """metrics.json is the contract, but a stale file (matrix rewritten without metrics) must not go unnoticed."""
    expected = dict(matrix.summary())
    curves = metrics_by_task(matrix.values, strict=matrix.strict)
    problems = []

    def differs(a: float, b: float) -> bool:
        return not ((math.isnan(a) and math.isnan(b)) or abs(a - b) <= _CONSISTENCY_TOLERANCE)

    for key in SUMMARY_METRICS:
        if differs(metrics[key], expected[key]):
            problems.append(f"{METRICS_FILE} {key} = {metrics[key]!r} but {MATRIX_FILE} gives {expected[key]!r}")
    for key, stored in (("AC_tau", ac_tau), ("AA_tau", aa_tau)):
        bad = [i + 1 for i, (a, b) in enumerate(zip(stored, curves[key])) if differs(a, b)]
        if bad:
            problems.append(f"{METRICS_FILE} {key} differs from {MATRIX_FILE} at tau = {bad}")
    return problems


def _variant_parent(run_dir: Path) -> Path | None:
    """The run directory of a protocol variant folder written by ``compat eval`` (``RUN/eval-*/``), else None.

    Such a folder holds its own matrix.json and metrics.json but shares the run's config.yaml one level up.
    """
    if (run_dir / CONFIG_FILE).is_file() or not (run_dir / MATRIX_FILE).is_file():
        return None
    parent = run_dir.resolve().parent
    return parent if (parent / CONFIG_FILE).is_file() else None


def load_run(run_dir: str | Path) -> RunResult:
    """Read ``config.yaml``, ``matrix.json`` and ``metrics.json`` of a finished run directory.

    A ``compat eval`` variant folder (``RUN/eval-<variant>/`` with matrix.json and metrics.json but no config.yaml)
    is read with the run's config.yaml; its name becomes ``<run name>/<folder>``.

    Raises ``FileNotFoundError`` naming the first missing file, ``ValueError``/``KeyError`` naming the file and key
    that is malformed. Numbers stay fractions; nothing is converted to percent here.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: not a directory (expected a run directory written by `compat run`)")
    variant_of = _variant_parent(run_dir)
    config_path = _require_file(variant_of or run_dir, CONFIG_FILE)
    matrix_path = _require_file(run_dir, MATRIX_FILE)
    metrics_path = _require_file(run_dir, METRICS_FILE)

    try:
        config = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise ValueError(f"{config_path}: not valid YAML ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(
            f"{config_path}: expected a mapping (the resolved scenario config), got {type(config).__name__}"
        )
    try:
        matrix = CompatibilityMatrix.from_json(matrix_path.read_text(encoding="utf-8"))
    except (ValueError, KeyError) as error:
        # KeyError's str() quotes its message; args[0] is the message itself
        raise ValueError(f"{matrix_path}: {error.args[0] if error.args else error}") from None
    document = _read_json(metrics_path)
    metrics, ac_tau, aa_tau = _parse_metrics(document, metrics_path, matrix.num_models)

    method = config.get("method")
    method_name = method.get("name") if isinstance(method, dict) else method
    if not isinstance(method_name, str) or not method_name:
        raise ValueError(
            f"{config_path}: method.name: expected the method's name (e.g. er, dsimplex-hoc), got {method!r}"
        )
    name = config.get("name")
    if not isinstance(name, str) or not name:
        name = (variant_of or run_dir).resolve().name  # a hand-made config may lack a name; the folder still names it
    if variant_of is not None:
        name = f"{name}/{run_dir.name}"
    _parse_replacements(config, config_path, matrix.num_models)
    return RunResult(matrix, document, config, run_dir=run_dir, name=name, source=str(run_dir),
                     warnings=_consistency_warnings(matrix, metrics, ac_tau, aa_tau))


# How each summary metric is shown: (scale, decimals, unit text).
SUMMARY_FORMAT = {
    "AC": (1.0, 4, "fraction of model pairs that satisfy the compatibility criterion"),
    "AA": (100.0, 2, "percent (mean of self- and cross-tests)"),
    "ACA": (100.0, 2, "percent (compatible cross-tests summed over all pairs)"),
    "BC": (100.0, 2, "percentage points (last model's cross-tests minus old self-tests)"),
    "FC": (100.0, 2, "percentage points (cross-test vs previous gallery minus own self-test)"),
}


def format_metric(key: str, value: float | None) -> str:
    """``value`` (a fraction; None or NaN: undefined) as the reports show ``key``: scaled, rounded, signed."""
    scale, decimals, _ = SUMMARY_FORMAT[key]
    if value is None or math.isnan(value):
        return "n/a"
    signed = key in ("BC", "FC")
    return f"{scale * value:+.{decimals}f}" if signed else f"{scale * value:.{decimals}f}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: Sequence[str] | None = None) -> str:
    align = align or ["---"] * len(header)
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def criterion_text(strict: bool) -> str:
    return "C[t,k] > C[k,k]" if strict else "C[t,k] >= C[k,k]"


def write_text_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling, so a reader never sees half a file."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text, encoding="utf-8")
    temporary.replace(path)

"""Reports of a finished run directory and summaries across runs.

A finished run directory holds ``config.yaml`` (resolved scenario), ``matrix.json`` (written by
:meth:`compat_core.metrics.CompatibilityMatrix.to_json`: fractions, 0-based rows = query model, columns = gallery
model, ``null`` above the diagonal) and ``metrics.json`` (``AC``, ``AA``, ``ACA``, ``BC``, ``FC`` as fractions,
``AC_tau``/``AA_tau`` lists indexed by ``tau - 1``). :func:`write_reports` adds ``report.md``, ``matrix.png``,
``aa_tau.png`` and ``matrix.csv``.

Units in what people read: AC is a fraction of model pairs; AA, ACA and matrix entries are printed in percent; BC and
FC are differences of accuracies, printed in percentage points. Task numbers shown to people are 1-based.

:func:`load_run_summary` turns one run into a :class:`RunSummary` for ``compat compare``; other inputs (e.g. a Ray
Tune experiment directory with one run per trial) plug in as a :data:`RUN_SOURCES` entry, see :func:`load_runs`.
"""
from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import yaml

from compat_core.metrics import CompatibilityMatrix, empirical_compatibility
from compat_core.registry import Registry

__all__ = [
    "RUN_SOURCES",
    "RunResults",
    "RunSummary",
    "RunSource",
    "aa_tau_figure",
    "compare_figure",
    "compare_table_csv",
    "compare_table_markdown",
    "load_run",
    "load_run_summary",
    "load_runs",
    "matrix_figure",
    "metric_display_name",
    "render_report_markdown",
    "summary_table_markdown",
    "write_compare",
    "write_reports",
    "write_run_reports",
]

CONFIG_FILE = "config.yaml"
MATRIX_FILE = "matrix.json"
METRICS_FILE = "metrics.json"
REPORT_FILE = "report.md"
MATRIX_PNG = "matrix.png"
CURVES_PNG = "aa_tau.png"
MATRIX_CSV = "matrix.csv"

SUMMARY_METRICS = ("AC", "AA", "ACA", "BC", "FC")

# Light red for failing cross-tests; the value colour map is blue so the two never get confused.
FAIL_COLOR = "#f7b2b2"
REPLACEMENT_COLOR = "#d95f02"
VALUE_CMAP = "Blues"
DPI = 110

_METRIC_NAMES = {
    "recall_at_1": "Recall@1",
    "map": "mAP",
    "verification": "verification accuracy",
    "tar_at_far": "TAR@FAR",
}

# How each summary metric is shown: (scale, decimals, unit text).
_SUMMARY_FORMAT = {
    "AC": (1.0, 4, "fraction of model pairs that satisfy the compatibility criterion"),
    "AA": (100.0, 2, "percent (mean of self- and cross-tests)"),
    "ACA": (100.0, 2, "percent (compatible cross-tests summed over all pairs)"),
    "BC": (100.0, 2, "percentage points (last model's cross-tests minus old self-tests)"),
    "FC": (100.0, 2, "percentage points (cross-test vs previous gallery minus own self-test)"),
}

# When a metrics.json value differs from the matrix recomputation by more than this, the report says so.
_CONSISTENCY_TOLERANCE = 1e-9


def metric_display_name(metric: str) -> str:
    """Readable name of a retrieval metric key (``recall_at_1`` -> ``Recall@1``); unknown keys are returned as is."""
    return _METRIC_NAMES.get(metric, metric)


# --------------------------------------------------------------------------------------------------------------------
# Loading a run directory
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class RunResults:
    """Everything the reports show about one finished run.

    metrics: ``AC``, ``AA``, ``ACA``, ``BC``, ``FC`` as fractions (NaN where undefined, e.g. pair metrics with T=1).
    ac_tau / aa_tau: length T, entry ``i`` is the metric over the first ``i + 1`` tasks (fractions, NaN undefined).
    replacement_tasks: 1-based task numbers where a replacement model enters, sorted.
    replacement_sources: 1-based task number -> weights source written in config.yaml.
    warnings: inconsistencies found while loading (shown in the report, never silently dropped).
    """

    run_dir: Path
    name: str
    method: str
    matrix: CompatibilityMatrix
    metrics: dict[str, float]
    ac_tau: list[float]
    aa_tau: list[float]
    replacement_tasks: list[int]
    replacement_sources: dict[int, str]
    config: dict[str, Any]
    warnings: list[str] = field(default_factory=list)

    @property
    def num_tasks(self) -> int:
        """T, the number of models (rows of the matrix)."""
        return self.matrix.num_models

    @property
    def gallery(self) -> str:
        """Gallery protocol (``instances`` or ``class_means``) from matrix.json, ``unknown`` when not recorded."""
        return str(self.matrix.protocol.get("gallery", "unknown"))

    @property
    def failing(self) -> np.ndarray:
        """Bool (T, T), True at cross-tests (t > k, 0-based) that fail the empirical compatibility criterion."""
        T = self.num_tasks
        return np.tri(T, k=-1, dtype=bool) & ~empirical_compatibility(self.matrix.values, strict=self.matrix.strict)


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
    from compat_core.metrics import metrics_by_task

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


def load_run(run_dir: str | Path) -> RunResults:
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
    metrics, ac_tau, aa_tau = _parse_metrics(_read_json(metrics_path), metrics_path, matrix.num_models)

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
    sources = _parse_replacements(config, config_path, matrix.num_models)
    return RunResults(
        run_dir=run_dir,
        name=name,
        method=method_name,
        matrix=matrix,
        metrics=metrics,
        ac_tau=ac_tau,
        aa_tau=aa_tau,
        replacement_tasks=list(sources),
        replacement_sources=sources,
        config=config,
        warnings=_consistency_warnings(matrix, metrics, ac_tau, aa_tau),
    )


# --------------------------------------------------------------------------------------------------------------------
# Text and Markdown
# --------------------------------------------------------------------------------------------------------------------


def _format_metric(key: str, value: float) -> str:
    scale, decimals, _ = _SUMMARY_FORMAT[key]
    if math.isnan(value):
        return "n/a"
    signed = key in ("BC", "FC")
    return f"{scale * value:+.{decimals}f}" if signed else f"{scale * value:.{decimals}f}"


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: Sequence[str] | None = None) -> str:
    align = align or ["---"] * len(header)
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def summary_table_markdown(results: RunResults) -> str:
    """Markdown table of AC, AA, ACA, BC, FC with each one's unit (AC fraction; others percent / points)."""
    rows = [[key, _format_metric(key, results.metrics[key]), _SUMMARY_FORMAT[key][2]] for key in SUMMARY_METRICS]
    return _markdown_table(["metric", "value", "unit"], rows, ["---", "---:", "---"])


def _criterion_text(strict: bool) -> str:
    return "C[t,k] > C[k,k]" if strict else "C[t,k] >= C[k,k]"


def _task_label(task: int, replacement_tasks: Sequence[int]) -> str:
    return f"{task} (R)" if task in replacement_tasks else str(task)


def matrix_table_markdown(results: RunResults) -> str:
    """The matrix in percent (2 decimals): rows = query model, columns = gallery model, 1-based tasks.

    Self-tests are bold, failing cross-tests end with ``✗``, ``-`` marks the undefined upper triangle.
    """
    values, failing, T = results.matrix.values, results.failing, results.num_tasks
    header = ["query \\ gallery"] + [_task_label(k + 1, results.replacement_tasks) for k in range(T)]
    rows = []
    for t in range(T):
        cells = [_task_label(t + 1, results.replacement_tasks)]
        for k in range(T):
            if k > t:
                cells.append("-")
            elif k == t:
                cells.append(f"**{100 * values[t, k]:.2f}**")
            else:
                cells.append(f"{100 * values[t, k]:.2f}" + (" ✗" if failing[t, k] else ""))
        rows.append(cells)
    return _markdown_table(header, rows, ["---"] + ["---:"] * T)


def per_task_table_markdown(results: RunResults) -> str:
    """tau, AC_tau (fraction), AA_tau (percent), self-test (percent) and the replacement entering at that task."""
    rows = []
    for index in range(results.num_tasks):
        tau = index + 1
        ac, aa = results.ac_tau[index], results.aa_tau[index]
        source = results.replacement_sources.get(tau)
        rows.append([
            str(tau),
            "n/a" if math.isnan(ac) else f"{ac:.4f}",
            "n/a" if math.isnan(aa) else f"{100 * aa:.2f}",
            f"{100 * results.matrix.values[index, index]:.2f}",
            f"replacement: `{source}`" if source is not None else "",
        ])
    return _markdown_table(
        ["tau (tasks)", "AC_tau (fraction)", "AA_tau (percent)", "self-test (percent)", "event"],
        rows, ["---:", "---:", "---:", "---:", "---"],
    )


def render_report_markdown(results: RunResults, images: dict[str, str] | None = None) -> str:
    """The text of ``report.md``; ``images`` maps a caption to a path relative to the run directory."""
    matrix = results.matrix
    metric = metric_display_name(matrix.metric)
    failing = results.failing
    pairs = results.num_tasks * (results.num_tasks - 1) // 2
    replaced = ", ".join(str(t) for t in results.replacement_tasks) or "none"
    lines = [
        f"# Compatibility report: {results.name}",
        "",
        f"- method: `{results.method}`",
        f"- tasks (models): {results.num_tasks}",
        f"- metric: {metric} (`{matrix.metric}`), gallery: `{results.gallery}`",
        f"- compatibility criterion: cross-test {_criterion_text(matrix.strict)} "
        f"({'strict' if matrix.strict else 'non-strict'}); {int(failing.sum())} of {pairs} cross-tests fail it",
        f"- replacements at tasks (1-based): {replaced}",
        "",
    ]
    if results.warnings:
        lines += ["> **Warning**: metrics.json and matrix.json disagree; re-run `compat eval` on this run.", ">"]
        lines += [f"> - {problem}" for problem in results.warnings]
        lines.append("")
    lines += ["## Summary", "", summary_table_markdown(results), ""]
    lines += [
        "## Compatibility matrix",
        "",
        f"{metric} in percent. Rows: query model of task t; columns: gallery model of task k (1-based). "
        f"Diagonal (bold) = self-tests; `✗` = cross-test that fails the criterion {_criterion_text(matrix.strict)}; "
        "`(R)` = a replacement model enters at this task; `-` = undefined (gallery model newer than query model).",
        "",
        matrix_table_markdown(results),
        "",
        "## Per task",
        "",
        "AC_tau and AA_tau over the first tau tasks (the leading tau x tau block of the matrix).",
        "",
        per_task_table_markdown(results),
        "",
    ]
    from pipelines.reports_upgrades import load_upgrades, section_markdown  # gate verdicts, backfilling

    lines += section_markdown(results, load_upgrades(results.run_dir),
                              (images or {}).pop("Partial backfilling", None))
    lines += [
        "## Protocol",
        "",
        f"- metric: `{matrix.metric}` (stored as `{matrix.units}` in `{MATRIX_FILE}`)",
    ]
    lines += [f"- {key}: `{value}`" for key, value in sorted(matrix.protocol.items()) if key != "metric"]
    lines.append(f"- model ids (rows/columns in order): {', '.join(f'`{i}`' for i in matrix.model_ids)}")
    lines.append(f"- matrix as CSV (fractions): [{MATRIX_CSV}]({MATRIX_CSV})")
    if images:
        lines += ["", "## Figures", ""]
        for caption, relative in images.items():
            lines += [f"![{caption}]({relative})", ""]
    return "\n".join(lines).rstrip() + "\n"


# --------------------------------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # reports are written on headless machines (CI, cluster workers)
    import matplotlib.pyplot as plt

    return plt


def _text_color(rgba: Sequence[float]) -> str:
    luminance = 0.2126 * rgba[0] + 0.7152 * rgba[1] + 0.0722 * rgba[2]
    return "white" if luminance < 0.5 else "black"


def matrix_figure(results: RunResults):
    """Heatmap of the matrix in percent as a matplotlib Figure (the caller saves or closes it); returns (fig, ax).

    Data coordinates: cell ``[t, k]`` (0-based query t, gallery k) is centred at ``(x=k, y=t)``; row 0 at the top.
    Failing cross-tests are filled with :data:`FAIL_COLOR` instead of the value colour; the upper triangle is blank.
    """
    plt = _pyplot()
    from matplotlib.colors import to_rgba
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    T = results.num_tasks
    values = results.matrix.values
    failing = results.failing
    side = min(max(0.42 * T + 3.0, 5.5), 16.0)
    fig, ax = plt.subplots(figsize=(side + 1.2, side + 0.6), dpi=DPI, layout="constrained")

    percent = np.where(np.tri(T, dtype=bool), 100.0 * values, np.nan)
    cmap = plt.get_cmap(VALUE_CMAP).with_extremes(bad=(1.0, 1.0, 1.0, 0.0))  # NaN (upper triangle) stays blank
    image = ax.imshow(percent, cmap=cmap, vmin=0.0, vmax=100.0, interpolation="nearest")
    fail_layer = np.where(failing, 1.0, np.nan)
    ax.imshow(fail_layer, cmap=_single_color_cmap(FAIL_COLOR), vmin=0.0, vmax=1.0, interpolation="nearest")
    colorbar = fig.colorbar(image, ax=ax, shrink=0.8, pad=0.02)
    colorbar.set_label(f"{metric_display_name(results.matrix.metric)} (percent)")

    if T <= 40:  # beyond that the numbers are unreadable; the colours still carry the information
        font_size = max(5.0, min(11.0, 130.0 / T))
        for t in range(T):
            for k in range(t + 1):
                fill = to_rgba(FAIL_COLOR) if failing[t, k] else cmap(percent[t, k] / 100.0)
                ax.text(k, t, f"{percent[t, k]:.1f}", ha="center", va="center", fontsize=font_size,
                        color=_text_color(fill), fontweight="bold" if t == k else "normal")

    # Outline each block of cross-tests that span a replacement: queries from the new model line (rows >= i) against
    # galleries of older lines (columns < i).
    for task in results.replacement_tasks:
        first = task - 1
        ax.plot([-0.5, first - 0.5], [first - 0.5, first - 0.5], color=REPLACEMENT_COLOR, linestyle="--", linewidth=1.6)
        ax.plot([first - 0.5, first - 0.5], [first - 0.5, T - 0.5], color=REPLACEMENT_COLOR, linestyle="--",
                linewidth=1.6)

    step = 1 if T <= 40 else math.ceil(T / 40)
    ticks = list(range(0, T, step))
    labels = [f"{i + 1}▸" if i + 1 in results.replacement_tasks else str(i + 1) for i in ticks]
    ax.set_xticks(ticks, labels)
    ax.set_yticks(ticks, labels)
    for tick_labels in (ax.get_xticklabels(), ax.get_yticklabels()):
        for label, i in zip(tick_labels, ticks):
            if i + 1 in results.replacement_tasks:
                label.set_color(REPLACEMENT_COLOR)
                label.set_fontweight("bold")
    ax.set_xlabel("gallery model (task k)")
    ax.set_ylabel("query model (task t)")
    ax.set_xlim(-0.5, T - 0.5)
    ax.set_ylim(T - 0.5, -0.5)
    for spine in ("top", "right"):
        ax.spines[spine].set_visible(False)

    summary = results.metrics
    ax.set_title(
        f"{results.name}: method {results.method}\n"
        f"{metric_display_name(results.matrix.metric)} (percent), gallery: {results.gallery};   "
        f"AC {_format_metric('AC', summary['AC'])}, AA {_format_metric('AA', summary['AA'])}%",
        fontsize=11 if side < 10 else 14,
    )
    handles = [
        Patch(facecolor=FAIL_COLOR, edgecolor="#b04040",
              label=f"fails compatibility criterion ({_criterion_text(results.matrix.strict)} is false)"),
    ]
    if results.replacement_tasks:
        handles.append(Line2D([], [], color=REPLACEMENT_COLOR, linestyle="--", linewidth=1.6,
                              label="replacement: new model line starts at task ▸"))
    fig.legend(handles=handles, loc="outside lower center", ncols=1, fontsize=9, frameon=False)
    return fig, ax


def _single_color_cmap(color: str):
    from matplotlib.colors import ListedColormap

    return ListedColormap([color]).with_extremes(bad=(1.0, 1.0, 1.0, 0.0))


def _replacement_lines(ax, tasks: Sequence[int], label_first: bool) -> None:
    for index, task in enumerate(tasks):
        ax.axvline(task, color=REPLACEMENT_COLOR, linestyle="--", linewidth=1.3,
                   label="replacement" if label_first and index == 0 else None)


def aa_tau_figure(results: RunResults):
    """Two panels over tau = 1..T: AA_tau and the self-tests (percent) on top, AC_tau (fraction) below."""
    plt = _pyplot()
    T = results.num_tasks
    taus = np.arange(1, T + 1)
    width = min(max(0.3 * T + 4.5, 6.5), 14.0)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(width, 6.2), dpi=DPI, sharex=True, layout="constrained",
                                      height_ratios=(3, 2))
    top.plot(taus, 100.0 * np.asarray(results.aa_tau), "o-", color="#1f4e9c", linewidth=2, label="AA_tau")
    top.plot(taus, 100.0 * np.diag(results.matrix.values), "s--", color="#7f7f7f", linewidth=1, markersize=4,
             label="self-test of model t")
    _replacement_lines(top, results.replacement_tasks, label_first=True)
    top.set_ylabel(f"{metric_display_name(results.matrix.metric)} (percent)")
    top.set_ylim(0, 100)
    top.legend(loc="best", fontsize=9)
    top.grid(alpha=0.3)
    top.set_title(f"{results.name}: method {results.method}, gallery: {results.gallery}", fontsize=11)

    bottom.plot(taus, np.asarray(results.ac_tau), "D-", color="#2a9d55", linewidth=2, label="AC_tau")
    _replacement_lines(bottom, results.replacement_tasks, label_first=False)
    bottom.set_ylabel("AC_tau (fraction of pairs)")
    bottom.set_ylim(-0.03, 1.03)
    bottom.set_xlabel("tau: number of tasks seen (1-based)")
    bottom.set_xticks(taus if T <= 40 else taus[:: math.ceil(T / 40)])
    bottom.set_xlim(0.5, T + 0.5)
    bottom.grid(alpha=0.3)
    bottom.legend(loc="best", fontsize=9)
    for task in results.replacement_tasks:
        top.annotate(f"R@{task}", xy=(task, 100), xytext=(3, -12), textcoords="offset points",
                     color=REPLACEMENT_COLOR, fontsize=8)
    return fig, (top, bottom)


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=DPI)  # no bbox_inches="tight": keeps pixel positions equal to the figure's transforms
    _pyplot().close(fig)
    return path


def _write_text_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text, encoding="utf-8")
    temporary.replace(path)


def write_reports(run_dir: str | Path) -> dict[str, Path]:
    """Write ``report.md``, ``matrix.png``, ``aa_tau.png`` and ``matrix.csv`` into a finished run directory.

    Returns ``{"report": ..., "matrix_png": ..., "aa_tau_png": ..., "matrix_csv": ...}``. Raises like
    :func:`load_run` when the run directory is incomplete or malformed.
    """
    return write_run_reports(load_run(run_dir))


def write_run_reports(results: RunResults) -> dict[str, Path]:
    """:func:`write_reports` for an already loaded run; files go to ``results.run_dir``."""
    run_dir = results.run_dir
    paths = {
        "matrix_csv": run_dir / MATRIX_CSV,
        "matrix_png": run_dir / MATRIX_PNG,
        "aa_tau_png": run_dir / CURVES_PNG,
        "report": run_dir / REPORT_FILE,
    }
    _write_text_atomically(paths["matrix_csv"], results.matrix.to_csv())
    _save(matrix_figure(results)[0], paths["matrix_png"])
    _save(aa_tau_figure(results)[0], paths["aa_tau_png"])
    images = {"Compatibility matrix": MATRIX_PNG, "AA_tau and AC_tau across tasks": CURVES_PNG}
    from pipelines.reports_upgrades import BACKFILL_PNG, backfill_figure, load_upgrades

    upgrades = load_upgrades(run_dir)
    if any("random" in (record.get("backfill") or {}) for record in upgrades):
        paths["backfill_png"] = _save(backfill_figure(upgrades), run_dir / BACKFILL_PNG)
        images["Partial backfilling"] = BACKFILL_PNG
    _write_text_atomically(paths["report"], render_report_markdown(results, images))
    return paths


# --------------------------------------------------------------------------------------------------------------------
# Comparing runs
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class RunSummary:
    """One row of ``compat compare``: headline metrics (fractions, NaN undefined) and per-task curves of one run.

    label: unique display name among the compared runs (``name`` unless two runs share it).
    source: where it was loaded from (a run directory, or e.g. a trial of a search).
    replacement_tasks: 1-based.
    """

    name: str
    method: str
    num_tasks: int
    metrics: dict[str, float]
    aa_tau: list[float]
    ac_tau: list[float]
    metric: str
    gallery: str
    replacement_tasks: list[int]
    source: str
    label: str = ""

    def __post_init__(self) -> None:
        if not self.label:
            self.label = self.name


@dataclass(frozen=True)
class RunSource:
    """A kind of compare input: ``matches(path)`` says whether ``load(path)`` can read it (one or more runs)."""

    description: str
    matches: Callable[[Path], bool]
    load: Callable[[Path], list[RunSummary]]


RUN_SOURCES: Registry[RunSource] = Registry("run source")


def load_run_summary(path: str | Path) -> RunSummary:
    """Summary of one finished run directory (reads config.yaml, matrix.json, metrics.json)."""
    results = load_run(path)
    return RunSummary(
        name=results.name,
        method=results.method,
        num_tasks=results.num_tasks,
        metrics=dict(results.metrics),
        aa_tau=list(results.aa_tau),
        ac_tau=list(results.ac_tau),
        metric=results.matrix.metric,
        gallery=results.gallery,
        replacement_tasks=list(results.replacement_tasks),
        source=str(path),
    )


RUN_SOURCES.register(
    "run-directory",
    RunSource(
        description=f"a run directory with {CONFIG_FILE}, {MATRIX_FILE} and {METRICS_FILE}",
        matches=lambda path: (path / METRICS_FILE).is_file() or (path / MATRIX_FILE).is_file(),
        load=lambda path: [load_run_summary(path)],
    ),
)


def load_runs(paths: Sequence[str | Path]) -> list[RunSummary]:
    """Summaries of every input, in input order; a path is read by the first :data:`RUN_SOURCES` entry (in name
    order) whose ``matches`` accepts it, and may yield several runs (e.g. one per trial of a search).

    A path no source recognises goes to the run-directory loader so the error names the missing file. When two runs
    share a name their labels become ``name (source path)``.
    """
    summaries: list[RunSummary] = []
    for raw in paths:
        path = Path(raw)
        source = next((RUN_SOURCES.get(n) for n in RUN_SOURCES.names() if RUN_SOURCES.get(n).matches(path)), None)
        summaries += source.load(path) if source is not None else [load_run_summary(path)]
    names = [s.name for s in summaries]
    for summary in summaries:
        if names.count(summary.name) > 1:
            summary.label = f"{summary.name} ({summary.source})"
    return summaries


_COMPARE_HEADER = ["run", "method", "T", "AC", "AA", "ACA", "BC", "FC"]


def compare_table_markdown(summaries: Sequence[RunSummary]) -> str:
    """Markdown table across runs: AC as a fraction, AA/ACA in percent, BC/FC in percentage points."""
    header = ["run", "method", "T", "AC (fraction)", "AA (%)", "ACA (%)", "BC (pp)", "FC (pp)", "metric / gallery"]
    rows = [
        [s.label, s.method, str(s.num_tasks), *(_format_metric(k, s.metrics[k]) for k in SUMMARY_METRICS),
         f"{s.metric} / {s.gallery}"]
        for s in summaries
    ]
    return _markdown_table(header, rows, ["---", "---", "---:"] + ["---:"] * 5 + ["---"])


def compare_table_csv(summaries: Sequence[RunSummary]) -> str:
    """CSV across runs with every metric as an unrounded fraction (BC/FC signed), for scripts."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow([*_COMPARE_HEADER, "metric", "gallery", "replacement_tasks", "source"])
    for s in summaries:
        writer.writerow([
            s.label, s.method, s.num_tasks,
            *("" if math.isnan(s.metrics[k]) else repr(s.metrics[k]) for k in SUMMARY_METRICS),
            s.metric, s.gallery, " ".join(str(t) for t in s.replacement_tasks), s.source,
        ])
    return buffer.getvalue()


def compare_figure(summaries: Sequence[RunSummary]):
    """Left: AA_tau (percent) of every run on one axis, replacements marked; right: grouped bars of AC/AA/ACA.

    AC is drawn as percent of pairs so the three bars share one axis. Returns (fig, (curves_ax, bars_ax)).
    """
    plt = _pyplot()
    fig, (curves, bars) = plt.subplots(1, 2, figsize=(13, 5.2), dpi=DPI, layout="constrained",
                                       width_ratios=(3, 2))
    colors = plt.get_cmap("tab10")
    markers = "osD^v<>ph*"
    for index, s in enumerate(summaries):
        color = colors(index % 10)
        taus = np.arange(1, s.num_tasks + 1)
        curves.plot(taus, 100.0 * np.asarray(s.aa_tau), marker=markers[index % len(markers)], color=color,
                    linewidth=2, label=s.label)
        for task in s.replacement_tasks:
            # a ring on the curve rather than a full-height line: runs may replace at different tasks
            curves.plot(task, 100.0 * s.aa_tau[task - 1], marker="o", markersize=15, markerfacecolor="none",
                        markeredgewidth=1.8, color=color, linestyle="none")
    curves.plot([], [], marker="o", markersize=12, markerfacecolor="none", markeredgewidth=1.8, color="#444444",
                linestyle="none", label="replacement enters (ring)")
    max_tasks = max(s.num_tasks for s in summaries)
    curves.set_xlabel("tau: number of tasks seen (1-based)")
    curves.set_ylabel("AA_tau (percent)")
    curves.set_xlim(0.5, max_tasks + 0.5)
    curves.set_xticks(range(1, max_tasks + 1, max(1, math.ceil(max_tasks / 20))))
    curves.set_ylim(0, 100)
    curves.grid(alpha=0.3)
    curves.legend(fontsize=9, loc="best")
    curves.set_title("AA_tau across tasks", fontsize=11)

    groups = ("AC", "AA", "ACA")
    width = 0.8 / max(len(summaries), 1)
    positions = np.arange(len(groups))
    for index, s in enumerate(summaries):
        heights = [100.0 * s.metrics[key] for key in groups]
        offsets = positions - 0.4 + width * (index + 0.5)
        drawn = bars.bar(offsets, np.nan_to_num(heights), width=width * 0.95, color=colors(index % 10), label=s.label)
        if len(summaries) <= 6:  # with more runs the numbers overlap; compare.md has them
            bars.bar_label(drawn, labels=["n/a" if math.isnan(h) else f"{h:.1f}" for h in heights], fontsize=8,
                           padding=2)
    bars.set_xticks(positions, ["AC (% of pairs)", "AA (%)", "ACA (%)"])
    bars.set_ylim(0, 108)
    bars.set_ylabel("percent")
    bars.grid(axis="y", alpha=0.3)
    bars.set_title("Final metrics (colours as on the left)", fontsize=11)
    return fig, (curves, bars)


def write_compare(summaries: Sequence[RunSummary], output_dir: str | Path) -> dict[str, Path]:
    """Write ``compare.md``, ``compare.csv`` and ``compare.png`` into ``output_dir`` (created if missing)."""
    if not summaries:
        raise ValueError("write_compare: expected at least one run summary, got none")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "markdown": output_dir / "compare.md",
        "csv": output_dir / "compare.csv",
        "png": output_dir / "compare.png",
    }
    notes = []
    protocols = {(s.metric, s.gallery) for s in summaries}
    if len(protocols) > 1:
        notes.append("> **Note**: the runs use different metrics or gallery protocols; their numbers are not "
                     "directly comparable.")
    text = "\n".join([
        "# Run comparison",
        "",
        "AC is a fraction of model pairs; AA and ACA are percent; BC and FC are percentage points (pp).",
        "",
        compare_table_markdown(summaries),
        "",
        *notes,
        *([""] if notes else []),
        f"![AA_tau and final metrics]({paths['png'].name})",
        "",
    ])
    _write_text_atomically(paths["markdown"], text)
    _write_text_atomically(paths["csv"], compare_table_csv(summaries))
    _save(compare_figure(summaries)[0], paths["png"])
    return paths

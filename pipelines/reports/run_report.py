"""Reports of a finished run directory and summaries across runs.

A finished run directory holds ``config.yaml`` (resolved scenario), ``matrix.json`` (written by
:meth:`compat_core.evaluation.metrics.CompatibilityMatrix.to_json`: fractions, 0-based rows = query model, columns = gallery
model, ``null`` above the diagonal) and ``metrics.json`` (``AC``, ``AA``, ``ACA``, ``BC``, ``FC`` as fractions,
``AC_tau``/``AA_tau`` lists indexed by ``tau - 1``). :func:`write_reports` adds ``report.md``, ``matrix.png``,
``aa_tau.png`` and ``matrix.csv``.

Units in what people read: AC is a fraction of model pairs; AA, ACA and matrix entries are printed in percent; BC and
FC are differences of accuracies, printed in percentage points. Task numbers shown to people are 1-based.

Reading a run directory lives in ``pipelines.results.run_files``, the figures in ``pipelines.reports.figures``, the
comparison of runs in ``pipelines.reports.compare``; this module renders ``report.md`` and writes the report files.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Sequence

from pipelines.reports.figures import aa_tau_figure, matrix_figure, save_figure
from pipelines.reports.upgrades import BACKFILL_PNG, backfill_figure, load_upgrades, section_markdown
from pipelines.results.assemble import RunResult
from pipelines.results.run_files import (
    CURVES_PNG,
    MATRIX_CSV,
    MATRIX_FILE,
    MATRIX_PNG,
    REPORT_FILE,
    SUMMARY_FORMAT,
    SUMMARY_METRICS,
    criterion_text,
    format_metric,
    load_run,
    markdown_table,
    metric_display_name,
    write_text_atomically,
)
from pipelines.store.run_store import RunStore

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------------------------
# Text and Markdown
# --------------------------------------------------------------------------------------------------------------------




def summary_table_markdown(results: RunResult) -> str:
    """Markdown table of AC, AA, ACA, BC, FC with each one's unit (AC fraction; others percent / points)."""
    rows = [[key, format_metric(key, results.headline[key]), SUMMARY_FORMAT[key][2]] for key in SUMMARY_METRICS]
    return markdown_table(["metric", "value", "unit"], rows, ["---", "---:", "---"])



def _task_label(task: int, replacement_tasks: Sequence[int]) -> str:
    return f"{task} (R)" if task in replacement_tasks else str(task)


def matrix_table_markdown(results: RunResult) -> str:
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
    return markdown_table(header, rows, ["---"] + ["---:"] * T)


def per_task_table_markdown(results: RunResult) -> str:
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
    return markdown_table(
        ["tau (tasks)", "AC_tau (fraction)", "AA_tau (percent)", "self-test (percent)", "event"],
        rows, ["---:", "---:", "---:", "---:", "---"],
    )


def render_report_markdown(results: RunResult, images: dict[str, str] | None = None) -> str:
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
        f"- compatibility criterion: cross-test {criterion_text(matrix.strict)} "
        f"({'strict' if matrix.strict else 'non-strict'}); {int(failing.sum())} of {pairs} cross-tests fail it",
        f"- replacements at tasks (1-based): {replaced}",
        f"- precision: {results.precision or 'unknown'} (`training.autocast` as resolved for this run)",
        f"- compiled training step: {results.compiled or 'unknown'} (`training.compile` as resolved for this run)",
        f"- channels_last training layout: {results.channels_last or 'unknown'} (`training.channels_last` as resolved "
        f"for this run)",
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
        f"Diagonal (bold) = self-tests; `✗` = cross-test that fails the criterion {criterion_text(matrix.strict)}; "
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



def write_reports(run_dir: str | Path) -> dict[str, Path]:
    """Write ``report.md``, ``matrix.png``, ``aa_tau.png`` and ``matrix.csv`` into a finished run directory.

    Returns ``{"report": ..., "matrix_png": ..., "aa_tau_png": ..., "matrix_csv": ...}``. Raises like
    :func:`load_run` when the run directory is incomplete or malformed.
    """
    return write_run_reports(load_run(run_dir))


def write_store_reports(store: RunStore) -> dict[str, Path]:
    """:func:`write_reports` for the finished run in ``store`` (what a command does with the engine's result).

    A run directory in object storage is not rendered here (``{}``): ``compat report RUN_DIR`` renders it from a
    local copy and uploads the files."""
    if not store.is_local:
        log.info("reports are written for local run directories only; run `compat report %s`", store.root)
        return {}
    return write_reports(store.base)


class ReportWriter:
    """An emit sink that writes the reports of the run in ``store`` (:func:`write_store_reports`) when the engine
    emits the run's RunResult, i.e. before the executor closes its sinks: a tracker ending its run there finds and
    logs them."""

    def __init__(self, store: RunStore) -> None:
        self.store = store

    def __call__(self, record: object) -> None:
        if isinstance(record, RunResult):
            write_store_reports(self.store)


def write_run_reports(results: RunResult) -> dict[str, Path]:
    """:func:`write_reports` for an already loaded run; files go to ``results.run_dir``."""
    run_dir = results.run_dir
    paths = {
        "matrix_csv": run_dir / MATRIX_CSV,
        "matrix_png": run_dir / MATRIX_PNG,
        "aa_tau_png": run_dir / CURVES_PNG,
        "report": run_dir / REPORT_FILE,
    }
    write_text_atomically(paths["matrix_csv"], results.matrix.to_csv())
    save_figure(matrix_figure(results)[0], paths["matrix_png"])
    save_figure(aa_tau_figure(results)[0], paths["aa_tau_png"])
    images = {"Compatibility matrix": MATRIX_PNG, "AA_tau and AC_tau across tasks": CURVES_PNG}
    upgrades = load_upgrades(run_dir)
    if any("random" in (record.get("backfill") or {}) for record in upgrades):
        paths["backfill_png"] = save_figure(backfill_figure(upgrades), run_dir / BACKFILL_PNG)
        images["Partial backfilling"] = BACKFILL_PNG
    write_text_atomically(paths["report"], render_report_markdown(results, images))
    return paths

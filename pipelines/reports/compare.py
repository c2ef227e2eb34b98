"""Runs side by side for ``compat compare``: each input becomes one or more
:class:`pipelines.results.assemble.RunResult` (a run directory through :func:`pipelines.results.run_files.load_run`;
other inputs, e.g. a Ray Tune experiment directory with one run per trial, plug in as a :data:`RUN_SOURCES` entry, see
:func:`load_runs`); the comparison table (markdown, CSV) and figure."""
from __future__ import annotations

import csv
import dataclasses
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from compat_core.registry import Registry
from pipelines.reports.figures import DPI, pyplot, save_figure
from pipelines.results.assemble import RunResult
from pipelines.results.run_files import (
    CONFIG_FILE,
    MATRIX_FILE,
    METRICS_FILE,
    SUMMARY_METRICS,
    format_metric,
    load_run,
    markdown_table,
    write_text_atomically,
)

# --------------------------------------------------------------------------------------------------------------------
# Comparing runs
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSource:
    """A kind of compare input: ``matches(path)`` says whether ``load(path)`` can read it (one or more runs)."""

    description: str
    matches: Callable[[Path], bool]
    load: Callable[[Path], list[RunResult]]


RUN_SOURCES: Registry[RunSource] = Registry("run source")


RUN_SOURCES.register(
    "run-directory",
    RunSource(
        description=f"a run directory with {CONFIG_FILE}, {MATRIX_FILE} and {METRICS_FILE}",
        matches=lambda path: (path / METRICS_FILE).is_file() or (path / MATRIX_FILE).is_file(),
        load=lambda path: [load_run(path)],
    ),
)


def load_runs(paths: Sequence[str | Path]) -> list[RunResult]:
    """The runs of every input, in input order; a path is read by the first :data:`RUN_SOURCES` entry (in name
    order) whose ``matches`` accepts it, and may yield several runs (e.g. one per trial of a search).

    A path no source recognises goes to the run-directory loader so the error names the missing file. When two runs
    share a name their labels become ``name (source path)``.
    """
    runs: list[RunResult] = []
    for raw in paths:
        path = Path(raw)
        source = next((RUN_SOURCES.get(n) for n in RUN_SOURCES.names() if RUN_SOURCES.get(n).matches(path)), None)
        runs += source.load(path) if source is not None else [load_run(path)]
    names = [run.name for run in runs]
    return [dataclasses.replace(run, label=f"{run.name} ({run.source})") if names.count(run.name) > 1 else run
            for run in runs]


_COMPARE_HEADER = ["run", "method", "T", "AC", "AA", "ACA", "BC", "FC"]


def compare_table_markdown(runs: Sequence[RunResult]) -> str:
    """Markdown table across runs: AC as a fraction, AA/ACA in percent, BC/FC in percentage points."""
    header = ["run", "method", "T", "AC (fraction)", "AA (%)", "ACA (%)", "BC (pp)", "FC (pp)", "metric / gallery"]
    rows = [
        [s.display_name, s.method, str(s.num_tasks), *(format_metric(k, s.headline[k]) for k in SUMMARY_METRICS),
         f"{s.metric} / {s.gallery}"]
        for s in runs
    ]
    return markdown_table(header, rows, ["---", "---", "---:"] + ["---:"] * 5 + ["---"])


def compare_table_csv(runs: Sequence[RunResult]) -> str:
    """CSV across runs with every metric as an unrounded fraction (BC/FC signed), for scripts."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow([*_COMPARE_HEADER, "metric", "gallery", "replacement_tasks", "source"])
    for s in runs:
        writer.writerow([
            s.display_name, s.method, s.num_tasks,
            *("" if math.isnan(s.headline[k]) else repr(s.headline[k]) for k in SUMMARY_METRICS),
            s.metric, s.gallery, " ".join(str(t) for t in s.replacement_tasks), s.source,
        ])
    return buffer.getvalue()


def compare_figure(runs: Sequence[RunResult]):
    """Left: AA_tau (percent) of every run on one axis, replacements marked; right: grouped bars of AC/AA/ACA.

    AC is drawn as percent of pairs so the three bars share one axis. Returns (fig, (curves_ax, bars_ax)).
    """
    plt = pyplot()
    fig, (curves, bars) = plt.subplots(1, 2, figsize=(13, 5.2), dpi=DPI, layout="constrained",
                                       width_ratios=(3, 2))
    colors = plt.get_cmap("tab10")
    markers = "osD^v<>ph*"
    for index, s in enumerate(runs):
        color = colors(index % 10)
        taus = np.arange(1, s.num_tasks + 1)
        curves.plot(taus, 100.0 * np.asarray(s.aa_tau), marker=markers[index % len(markers)], color=color,
                    linewidth=2, label=s.display_name)
        for task in s.replacement_tasks:
            # a ring on the curve rather than a full-height line: runs may replace at different tasks
            curves.plot(task, 100.0 * s.aa_tau[task - 1], marker="o", markersize=15, markerfacecolor="none",
                        markeredgewidth=1.8, color=color, linestyle="none")
    if any(s.replacement_tasks for s in runs):  # the legend names the ring only where one is drawn
        curves.plot([], [], marker="o", markersize=12, markerfacecolor="none", markeredgewidth=1.8, color="#444444",
                    linestyle="none", label="replacement enters (ring)")
    max_tasks = max(s.num_tasks for s in runs)
    curves.set_xlabel("tau: number of tasks seen (1-based)")
    curves.set_ylabel("AA_tau (percent)")
    curves.set_xlim(0.5, max_tasks + 0.5)
    curves.set_xticks(range(1, max_tasks + 1, max(1, math.ceil(max_tasks / 20))))
    curves.set_ylim(0, 100)
    curves.grid(alpha=0.3)
    curves.legend(fontsize=9, loc="best")
    curves.set_title("AA_tau across tasks", fontsize=11)

    groups = ("AC", "AA", "ACA")
    width = 0.8 / max(len(runs), 1)
    positions = np.arange(len(groups))
    for index, s in enumerate(runs):
        heights = [100.0 * s.headline[key] for key in groups]
        offsets = positions - 0.4 + width * (index + 0.5)
        drawn = bars.bar(offsets, np.nan_to_num(heights), width=width * 0.95, color=colors(index % 10),
                         label=s.display_name)
        if len(runs) <= 6:  # with more runs the numbers overlap; compare.md has them
            bars.bar_label(drawn, labels=["n/a" if math.isnan(h) else f"{h:.1f}" for h in heights], fontsize=8,
                           padding=2)
    bars.set_xticks(positions, ["AC (% of pairs)", "AA (%)", "ACA (%)"])
    bars.set_ylim(0, 108)
    bars.set_ylabel("percent")
    bars.grid(axis="y", alpha=0.3)
    bars.set_title("Final metrics (colours as on the left)", fontsize=11)
    return fig, (curves, bars)


def write_compare(runs: Sequence[RunResult], output_dir: str | Path) -> dict[str, Path]:
    """Write ``compare.md``, ``compare.csv`` and ``compare.png`` into ``output_dir`` (created if missing)."""
    if not runs:
        raise ValueError("write_compare: expected at least one run, got none")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "markdown": output_dir / "compare.md",
        "csv": output_dir / "compare.csv",
        "png": output_dir / "compare.png",
    }
    notes = []
    protocols = {(s.metric, s.gallery) for s in runs}
    if len(protocols) > 1:
        notes.append("> **Note**: the runs use different metrics or gallery protocols; their numbers are not "
                     "directly comparable.")
    text = "\n".join([
        "# Run comparison",
        "",
        "AC is a fraction of model pairs; AA and ACA are percent; BC and FC are percentage points (pp).",
        "",
        compare_table_markdown(runs),
        "",
        *notes,
        *([""] if notes else []),
        f"![AA_tau and final metrics]({paths['png'].name})",
        "",
    ])
    write_text_atomically(paths["markdown"], text)
    write_text_atomically(paths["csv"], compare_table_csv(runs))
    save_figure(compare_figure(runs)[0], paths["png"])
    return paths

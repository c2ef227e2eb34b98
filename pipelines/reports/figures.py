"""The report figures of a run: the matrix heatmap (failing cross-tests marked) and the AA_tau / AC_tau curves,
drawn with matplotlib on a headless backend, and saving a figure at the reports' resolution."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np

from pipelines.results.assemble import RunResult
from pipelines.results.run_files import criterion_text, format_metric, metric_display_name

# Light red for failing cross-tests; the value colour map is blue so the two never get confused.
FAIL_COLOR = "#f7b2b2"
REPLACEMENT_COLOR = "#d95f02"
VALUE_CMAP = "Blues"
DPI = 110


# --------------------------------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------------------------------


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # reports are written on headless machines (CI, cluster workers)
    import matplotlib.pyplot as plt

    return plt


def _text_color(rgba: Sequence[float]) -> str:
    luminance = 0.2126 * rgba[0] + 0.7152 * rgba[1] + 0.0722 * rgba[2]
    return "white" if luminance < 0.5 else "black"


def matrix_figure(results: RunResult):
    """Heatmap of the matrix in percent as a matplotlib Figure (the caller saves or closes it); returns (fig, ax).

    Data coordinates: cell ``[t, k]`` (0-based query t, gallery k) is centred at ``(x=k, y=t)``; row 0 at the top.
    Failing cross-tests are filled with :data:`FAIL_COLOR` instead of the value colour; the upper triangle is blank.
    """
    plt = pyplot()
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

    summary = results.headline
    ax.set_title(
        f"{results.name}: method {results.method}\n"
        f"{metric_display_name(results.matrix.metric)} (percent), gallery: {results.gallery};   "
        f"AC {format_metric('AC', summary['AC'])}, AA {format_metric('AA', summary['AA'])}%",
        fontsize=11 if side < 10 else 14,
    )
    handles = [
        Patch(facecolor=FAIL_COLOR, edgecolor="#b04040",
              label=f"fails compatibility criterion ({criterion_text(results.matrix.strict)} is false)"),
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


def aa_tau_figure(results: RunResult):
    """Two panels over tau = 1..T: AA_tau and the self-tests (percent) on top, AC_tau (fraction) below."""
    plt = pyplot()
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


def save_figure(fig, path: Path) -> Path:
    fig.savefig(path, dpi=DPI)  # no bbox_inches="tight": keeps pixel positions equal to the figure's transforms
    pyplot().close(fig)
    return path

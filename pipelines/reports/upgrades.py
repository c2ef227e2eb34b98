"""Report section for model upgrades: the gate's verdict at each replacement, without and with each adapter, and
the partial-backfilling curves (``adapters.json`` written by the run's ``adapt`` stages, see pipelines/stages/adapt.py).

The verdict without an adapter comes from the matrix itself: at a replacement entering at task ``t`` (1-based) the
gate compares the cross-test C[t, t-1] with the self-test C[t-1, t-1] (what ``compat gate`` decides when the new
model is the candidate and the old one the champion). Numbers are fractions in the tables' source and percent in the
report, as the rest of report.md.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from compat_core.evaluation.metrics import upgrade_verdict
from pipelines.reports.figures import pyplot

ADAPTERS_FILE = "adapters.json"
BACKFILL_PNG = "backfill.png"


def load_upgrades(run_dir: str | Path) -> list[dict]:
    """The adapt-stage records of a run (``adapters.json``), [] when the run fitted no adapters."""
    path = Path(run_dir) / ADAPTERS_FILE
    if not path.exists():
        return []
    records = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(records, list) or any(not isinstance(r, dict) or "task" not in r for r in records):
        raise ValueError(f"{path}: expected a list of adapt-stage records with 'task'")
    return records


def gate_rows(results: Any, upgrades: list[dict]) -> list[dict]:
    """One row per (replacement, adapter or none): task (1-based), adapter, cross, self_old, self_new, pass, margin."""
    values = results.matrix.values
    strict = results.matrix.strict
    by_task = {int(record["task"]) + 1: record for record in upgrades}
    rows = []
    for task in results.replacement_tasks:
        new, old = task - 1, task - 2   # 0-based rows of the new and the replaced model
        verdict = upgrade_verdict(float(values[new, old]), float(values[old, old]), float(values[new, new]), strict)
        rows.append({"task": task, "adapter": "none", **verdict})
        record = by_task.get(task)
        for kind, entry in sorted((record or {}).get("adapters", {}).items()):
            verdict = entry["verdict"]
            rows.append({"task": task, "adapter": kind, **verdict})
    return rows


def gate_table_markdown(results: Any, upgrades: list[dict]) -> str:
    sign = ">" if results.matrix.strict else ">="
    header = ["replacement at task", "adapter", "M(new, old)", "M(old, old)", "M(new, new) (re-index)",
              "margin (pp)", "gate"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    for row in gate_rows(results, upgrades):
        lines.append(f"| {row['task']} | {row['adapter']} | {100 * row['cross']:.2f} | {100 * row['self_old']:.2f} | "
                     f"{100 * row['self_new']:.2f} | {100 * row['margin']:+.2f} | "
                     f"{'pass' if row['compatible'] else 'refuse'} |")
    return "\n".join(lines) + f"\n\nGate: M(new, old) {sign} M(old, old) (the replaced model's self-test)."


def section_markdown(results: Any, upgrades: list[dict], image: str | None = None) -> list[str]:
    """Lines of the report's upgrade section ([] without replacements)."""
    if not results.replacement_tasks:
        return []
    lines = ["## Upgrade gate at replacements", "",
             "Would `compat gate` let the new model serve queries against the gallery indexed by the model it "
             "replaces? Without an adapter (from the matrix) and with each adapter fitted by the run's adapt stage "
             "on paired gallery features (percent).", "", gate_table_markdown(results, upgrades), ""]
    for record in upgrades:
        curves = record.get("backfill") or {}
        if "random" in curves:
            random, uncertain = curves["random"], curves["uncertainty"]
            points = ", ".join(f"{int(round(100 * f))}%: {100 * a:.1f} / {100 * b:.1f}" for f, a, b in
                               zip(random["fraction"], random["recall_at_1"], uncertain["recall_at_1"]))
            lines += [f"Backfilling at task {int(record['task']) + 1} (start: {curves.get('start')}), Recall@1 "
                      f"random / uncertainty-first by re-embedded fraction: {points}", ""]
    if image:
        lines += [f"![Partial backfilling]({image})", ""]
    return lines


def backfill_figure(upgrades: list[dict]):
    """Recall@1 and mAP against the re-embedded fraction, one column per replacement; dashed: old self-test."""
    plt = pyplot()
    with_curves = [record for record in upgrades if "random" in (record.get("backfill") or {})]
    fig, axes = plt.subplots(2, max(1, len(with_curves)), figsize=(5 * max(1, len(with_curves)), 7), squeeze=False)
    for column, record in enumerate(with_curves):
        for row, metric in enumerate(("recall_at_1", "map")):
            ax = axes[row][column]
            for order, style in (("random", "-o"), ("uncertainty", "-s")):
                curve = record["backfill"][order]
                ax.plot([100 * f for f in curve["fraction"]], [100 * v for v in curve[metric]], style, ms=3,
                        label=f"{order} order")
            baseline = record["baseline"][metric]
            ax.axhline(100 * baseline["self_old"], ls="--", color="grey", label="old self-test")
            ax.axhline(100 * baseline["cross"], ls=":", color="red", label="cross-test, no adapter")
            ax.set_title(f"task {int(record['task']) + 1}: {'Recall@1' if metric == 'recall_at_1' else 'mAP'} "
                         f"(start: {record['backfill'].get('start')})", fontsize=9)
            ax.set_xlabel("gallery re-embedded with the new model (%)")
            ax.set_ylabel("percent")
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


__all__ = ["ADAPTERS_FILE", "BACKFILL_PNG", "load_upgrades", "gate_rows", "gate_table_markdown", "section_markdown",
           "backfill_figure"]

"""The spread of a run's metrics over seeds: mean, sample standard deviation and min-max per (pool, method), as
rows, a Markdown table and files (``compat demo --seeds``)."""
from __future__ import annotations

import json
import math
from pathlib import Path

METRICS = ("AC", "AA", "ACA", "BC", "FC")


def spread(values: list[float]) -> dict:
    """Mean, sample standard deviation (n - 1; 0 for one value), min and max of ``values`` (fractions)."""
    count = len(values)
    mean = sum(values) / count
    std = math.sqrt(sum((value - mean) ** 2 for value in values) / (count - 1)) if count > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(values), "max": max(values), "n": count}


def summarise(records: list[dict]) -> list[dict]:
    """One row per (pool, method) of ``records`` (each {seed, pool, method, metrics}): each metric's :func:`spread`
    over the seeds, with the per-seed values. A metric missing from a run (None) is left out of its spread."""
    rows = []
    keys = list(dict.fromkeys((record["pool"], record["method"]) for record in records))
    for pool, method in keys:
        runs = [record for record in records if (record["pool"], record["method"]) == (pool, method)]
        row = {"pool": pool, "method": method, "seeds": [record["seed"] for record in runs]}
        for metric in METRICS:
            values = [record["metrics"].get(metric) for record in runs]
            row[metric] = {"per_seed": values, **(spread([v for v in values if v is not None])
                                                   if any(v is not None for v in values) else {})}
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    """The rows of :func:`summarise` as a Markdown table: mean ± std (min to max) per metric, fractions."""
    lines = ["| pool | method | seeds | " + " | ".join(METRICS) + " |", "| --- | --- | --- | " + " | ".join(
        "---" for _ in METRICS) + " |"]
    for row in rows:
        cells = []
        for metric in METRICS:
            value = row[metric]
            cells.append("-" if "mean" not in value else
                         f"{value['mean']:.3f} ± {value['std']:.3f} ({value['min']:.3f} to {value['max']:.3f})")
        lines.append(f"| {row['pool']} | {row['method']} | {','.join(str(s) for s in row['seeds'])} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_table(records: list[dict], output: str, command: list[str]) -> tuple[Path, Path]:
    """Write ``seeds.md`` (the table) and ``seeds.json`` (rows, per-run records and wall times) into ``output``."""
    rows = summarise(records)
    folder = Path(output)
    folder.mkdir(parents=True, exist_ok=True)
    text = ("Metrics over seeds (fractions; mean ± sample std (min to max)), `compat " + " ".join(command) + "`:\n\n"
            + format_table(rows) + "\n")
    markdown, document = folder / "seeds.md", folder / "seeds.json"
    markdown.write_text(text, encoding="utf-8")
    document.write_text(json.dumps({"command": command, "rows": rows, "runs": records}, indent=2), encoding="utf-8")
    return markdown, document

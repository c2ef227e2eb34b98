"""``compat compare RUN_DIR... [--output DIR]``: one table and one plot across finished runs.

Prints the table (run, method, T, AC, AA, ACA, BC, FC) and writes ``compare.md``, ``compare.csv`` (fractions) and
``compare.png`` into ``--output`` (default: ``compare-<names>`` in the folder that holds the compared runs, e.g.
``runs/demo/compare-er-dsimplex-hoc``; printed). Inputs are read by
:func:`pipelines.reports.run_report.load_runs`, so any source registered in ``pipelines.reports.run_report.RUN_SOURCES`` (e.g. a search
experiment directory) is accepted as well as run directories. Exit code 0 on success, 2 when an input cannot be read.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from app.commands.remote_runs import local_copies
from cluster.tune.runner import register_run_source
from pipelines.reports.compare import compare_table_markdown, load_runs, write_compare


def default_output(run_dirs: list) -> Path:
    """``<common parent of the inputs>/compare-<their names>`` (names joined by '-', at most 80 characters); for
    ``s3://`` runs ``./compare-<their names>``."""
    import os

    names = "-".join(str(path).rstrip("/").rsplit("/", 1)[-1] for path in run_dirs)[:80].rstrip("-") or "runs"
    if any("://" in str(path) for path in run_dirs):  # runs in object storage: the comparison is written here
        return Path.cwd() / f"compare-{names}"
    folders = [Path(os.path.abspath(path)) for path in run_dirs]
    parent = Path(os.path.commonpath([str(folder.parent) for folder in folders]))
    return parent / f"compare-{names}"


def register_run_sources() -> None:
    """Sources the application layer adds to ``pipelines.reports.run_report.RUN_SOURCES``: a `compat tune` search directory.
    Called when the command runs, never as an import side effect."""
    register_run_source()


def run(args: argparse.Namespace) -> int:
    register_run_sources()

    try:
        with local_copies(args.run_dirs) as folders:  # s3:// runs read through the standard AWS chain
            summaries = load_runs(folders)
        paths = write_compare(summaries, args.output or default_output(args.run_dirs))
    except (FileNotFoundError, ValueError, KeyError) as error:
        print(f"compat compare: error: {error.args[0] if error.args else error}", file=sys.stderr)
        return 2
    print("AC: fraction of model pairs; AA, ACA: percent; BC, FC: percentage points (pp)")
    print(compare_table_markdown(summaries))
    print("wrote: " + ", ".join(str(path) for path in paths.values()))
    return 0

"""``compat report RUN_DIR``: regenerate the reports of a finished run and print its summary table.

Writes ``report.md``, ``matrix.png``, ``aa_tau.png`` and ``matrix.csv`` next to ``matrix.json``. Exit code 0 on
success, 2 when RUN_DIR is not a finished run (the message names the missing or malformed file).
"""
from __future__ import annotations

import argparse
import sys

from app.commands.remote_runs import is_remote, local_copies, upload_reports
from pipelines.reports.run_report import summary_table_markdown, write_run_reports
from pipelines.reports.upgrades import gate_table_markdown, load_upgrades
from pipelines.results.run_files import load_run, metric_display_name
from pipelines.store.lease import RunFolderBusyError


def run(args: argparse.Namespace) -> int:
    try:
        with local_copies([args.run_dir]) as (folder,):
            results = load_run(folder)
            paths = write_run_reports(results)
            upgrades = None
            if results.replacement_tasks:
                upgrades = gate_table_markdown(results, load_upgrades(results.run_dir))
            if is_remote(args.run_dir):
                paths = upload_reports(args.run_dir, paths)
    except (FileNotFoundError, ValueError, KeyError, RunFolderBusyError) as error:
        # KeyError's str() adds quotes around the message; args[0] is the message itself
        print(f"compat report: error: {error.args[0] if error.args else error}", file=sys.stderr)
        return 2
    replaced = ", ".join(str(t) for t in results.replacement_tasks) or "none"
    print(f"{results.name}: method {results.method}, {results.num_tasks} tasks, "
          f"{metric_display_name(results.matrix.metric)}, gallery {results.gallery}, replacements at tasks {replaced}")
    print(summary_table_markdown(results))
    if upgrades is not None:
        print("upgrade gate at replacements (percent):")
        print(upgrades)
    for problem in results.warnings:
        print(f"compat report: warning: {problem}", file=sys.stderr)
    print("wrote: " + ", ".join(str(path) for path in paths.values()))
    return 0

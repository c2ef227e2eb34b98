"""Arguments of ``compat compare`` (the command itself is :mod:`app.commands.compare`): argparse only,
so that ``compat compare --help`` imports none of the command's dependencies."""
from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Positional RUN_DIR... and --output DIR."""
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="run directories (config.yaml, matrix.json, metrics.json) or their eval-* variant folders")
    parser.add_argument("--output", type=Path, default=None, metavar="DIR",
                        help="where compare.md, compare.csv and compare.png go; default: compare-<names> in the "
                             "folder holding the compared runs (printed)")

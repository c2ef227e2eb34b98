"""Arguments of ``compat models`` (the command itself is :mod:`app.commands.models`): argparse only."""
from __future__ import annotations

import argparse

HELP = "registry housekeeping: `compat models prune` removes per-run aliases of run folders that no longer exist"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("prune",),
                        help="prune: list (or with --apply remove) the per-run aliases (<run>__task-N, ...) whose "
                             "run folder is gone; bare scenario aliases and champion are never touched")
    parser.add_argument("--model", dest="models", action="append", default=[], metavar="NAME",
                        help="registered model to prune (repeatable; default: every registered model)")
    parser.add_argument("--apply", action="store_true",
                        help="remove the listed aliases (default: a dry run that only lists them)")
    parser.add_argument("--tracking-uri", default=None, metavar="URI",
                        help="MLflow tracking server (default: $MLFLOW_TRACKING_URI, else the machine's store)")

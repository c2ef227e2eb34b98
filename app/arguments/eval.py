"""Arguments of ``compat eval`` (the command itself is :mod:`app.commands.eval`): argparse only,
so that ``compat eval --help`` imports none of the command's dependencies."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="run directory written by `compat run`")
    parser.add_argument("--gallery", choices=("instances", "class_means"), help="gallery of instances or class means")
    parser.add_argument("--metric", choices=("recall_at_1", "map", "verification", "tar_at_far"))
    parser.add_argument("--label-level", choices=("fine", "coarse"))
    parser.add_argument("--strict", choices=("true", "false"), help="compatibility criterion > (true) or >= (false)")

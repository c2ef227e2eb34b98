"""Arguments of ``compat theory`` (the command itself is :mod:`app.commands.theory`): argparse only and the
defaults of :mod:`compat_core.evaluation.theory` (numpy), so that ``compat theory --help`` imports none of the command's
other dependencies."""
from __future__ import annotations

import argparse
from pathlib import Path

from compat_core.evaluation import theory


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options: --dims, --old-angle, --new-angle, --samples, --seed, --png."""
    parser.add_argument(
        "--dims", type=int, nargs="+", default=list(theory.DEFAULT_DIMS), metavar="D",
        help="representation dimensions d (>= 2); default: %(default)s",
    )
    parser.add_argument(
        "--old-angle", type=float, nargs="+", default=[theory.DEFAULT_OLD_CAP_DEG], metavar="DEG",
        help="half-angle(s) in degrees of the class cap before the update; default: %(default)s",
    )
    parser.add_argument(
        "--new-angle", type=float, nargs="+", default=[theory.DEFAULT_NEW_CAP_DEG], metavar="DEG",
        help="half-angle(s) in degrees of the (shrunken) cap after the update; default: %(default)s",
    )
    parser.add_argument(
        "--samples", type=int, nargs="+", default=[theory.DEFAULT_SAMPLES], metavar="N",
        help="Monte Carlo draws per setting; default: %(default)s",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed; default: %(default)s")
    parser.add_argument("--png", type=Path, default=None, metavar="PATH", help="also write a plot to PATH (PNG)")

"""Arguments of ``compat calibrate`` (the command itself is :mod:`app.commands.calibrate`): argparse only,
so that ``compat calibrate --help`` imports none of the command's dependencies."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options: CONFIG, --show, --force, --device, --threads."""
    parser.add_argument("config", nargs="?", default=None, metavar="CONFIG",
                        help="scenario config whose model's training/inference step is timed too (optional)")
    parser.add_argument("--show", action="store_true", help="print the cached calibration; measure nothing")
    parser.add_argument("--force", action="store_true", help="discard the cached calibration and measure again")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="torch threads to calibrate for (part of the key; stages use their num_cpus); "
                             "default: torch's current count")

"""Arguments of ``compat plan`` (the command itself is :mod:`app.commands.plan`): argparse only,
so that ``compat plan --help`` imports none of the command's dependencies."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="scenario YAML")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value (YAML-parsed; repeatable)")
    parser.add_argument("--check-data", action="store_true",
                        help="open every data pool (and pre-training init file) and list every one that is missing "
                             "or unreadable, all at once; exit 1 when any is")
    cost = parser.add_mutually_exclusive_group()
    cost.add_argument("--seconds-per-image", type=float, default=None, metavar="S",
                      help="GPU-seconds per training image (forward + backward + step) for the GPU-hour estimate")
    cost.add_argument("--calibrated", default=None, metavar="DEVICE",
                      help="take the per-image cost from this machine's calibration of the config's model on DEVICE "
                           "(`compat calibrate CONFIG --device DEVICE`)")
    parser.add_argument("--no-cost", action="store_true",
                        help="skip the cost section (it opens the data pools to count the sampler's epochs)")

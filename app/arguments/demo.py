"""Arguments of ``compat demo`` (the command itself is :mod:`app.commands.demo`): argparse only,
so that ``compat demo --help`` imports none of the command's dependencies."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", default="runs/demo", help="parent folder of the two runs (default runs/demo)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a value in both demo configs (YAML-parsed; repeatable)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="scenarios run at once (default: 2 when the machine has >= 2 cores, else 1)")
    parser.add_argument("--executor", choices=("ray", "local"), default="ray",
                        help="ray (default): stages as actors on an embedded local Ray instance; local: in-process")
    parser.add_argument("--tracking-uri", default=None, metavar="URI",
                        help="MLflow tracking for both runs; default: $MLFLOW_TRACKING_URI, else one SQLite "
                             "the machine's store (~/.local/share/compat/mlflow, see `compat ui`); 'none' turns it off")
    parser.add_argument("--experiment", default=None, metavar="NAME",
                        help="MLflow experiment of both runs, compared side by side (default: "
                             "$MLFLOW_EXPERIMENT_NAME, else compat-demo)")
    parser.add_argument("--seeds", default=None, metavar="S,S,...",
                        help="run the demo once per seed (e.g. 0,1,2) into OUTPUT/seed-S, each evaluated on the "
                             "validation and the test pool, and print and write (OUTPUT/seeds.md, seeds.json) AC, "
                             "AA, ACA, BC, FC of both methods as mean and spread over the seeds; default: one run "
                             "with the configs' seed, test pool only")
    parser.add_argument("--no-progress", action="store_true")

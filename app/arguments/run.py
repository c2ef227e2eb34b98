"""Arguments of ``compat run`` (the command itself is :mod:`app.commands.run`): argparse and the executor registry's
cards only, so that ``compat run --help`` imports none of the command's dependencies."""
from __future__ import annotations

import argparse

from app.arguments.cluster_access import add_executor_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="scenario YAML (optional with --resume: the run's config.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set training.epochs=5 (YAML-parsed; repeatable)")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR, skipping committed stages")
    parser.add_argument("--output", metavar="DIR", help="run directory (local path or s3:// URI); "
                                                         "default: the config's output.dir")
    add_executor_argument(parser, default="local", help="where stages run")
    parser.add_argument("--address", default=None, help="Ray address for --executor ray (auto | ray://... | http://...)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (log lines only)")
    parser.add_argument("--recompute", action="append", default=[], metavar="KEY",
                        help="with --resume: compute this committed stage again (a unique prefix of its key, as "
                             "printed by an integrity error); repeatable")
    parser.add_argument("--experiment", default=None, metavar="NAME",
                        help="MLflow experiment (default: $MLFLOW_EXPERIMENT_NAME, else the scenario name); put "
                             "runs you compare (e.g. ER and d-Simplex-HOC) in one experiment")
    parser.add_argument("--run-name", default=None, metavar="NAME",
                        help="the run's name in MLflow and the prefix of its registry aliases (NAME__task-3); "
                             "default: <run folder name>-<first 8 characters of the pipeline id>")
    parser.add_argument("--tracking-uri", default=None, metavar="URI",
                        help="MLflow tracking: sqlite:///PATH or http(s)://HOST:PORT; 'none' disables it; default: "
                             "$MLFLOW_TRACKING_URI, else the machine's one store (~/.local/share/compat/mlflow; "
                             "`compat ui` shows it)")
    # what a submitted job records as its origin in config.yaml: the command and overrides `compat submit` was given
    # (the job itself runs `compat run` on the staged, already overridden scenario)
    parser.add_argument("--origin-command", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--origin-set", action="append", default=[], help=argparse.SUPPRESS)

"""Arguments of ``compat tune`` (the command itself is :mod:`app.commands.tune`): argparse only,
so that ``compat tune --help`` imports none of the command's dependencies."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="scenario YAML (not needed with --resume)")
    parser.add_argument("--space", help="search-space YAML (see configs/spaces/)")
    parser.add_argument("--samples", type=int, default=8, help="trials in all (default 8)")
    parser.add_argument("--concurrent", type=int, default=1, help="trials running at once (default 1)")
    parser.add_argument("--objective", default="aca", help="aca (default) | ac | aa | bc | fc, maximised")
    parser.add_argument("--scheduler", choices=("asha", "none"), default="asha",
                        help="asha: stop bad trials early, compared after each task (default); none: run all")
    parser.add_argument("--storage", default="runs/tune",
                        help="where searches live: local folder (default runs/tune) or s3://bucket/prefix "
                             "(endpoint and credentials from the standard AWS environment/config)")
    parser.add_argument("--name", help="search name (default: tune-<scenario>-<date-time>)")
    parser.add_argument("--seed", type=int, default=0, help="Optuna sampler seed (default 0)")
    parser.add_argument("--resume", metavar="SEARCH_DIR", help="continue an interrupted search")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value for every trial (YAML-parsed; repeatable)")
    parser.add_argument("--cpus-per-trial", type=float, help="CPUs per trial (default: the config's finetune "
                                                             "resources, shared fractionally on small machines)")
    parser.add_argument("--gpus-per-trial", type=float, help="GPUs per trial (default: 1 when Ray has GPUs)")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else the "
                                               "machine's one store; see compat ui)")
    parser.add_argument("--mlflow-experiment", help="MLflow experiment name (default: <scenario>-search)")
    parser.add_argument("--plugin", dest="plugins", action="append", default=[], metavar="MODULE[:FUNC]",
                        help="module or PATH.py imported in every trial (registers extra datasets/methods); "
                             "FUNC is called after import. With --resume, give the search's plugins again: they are "
                             "never read from the search folder")
    parser.add_argument("--address", help="Ray address (default: start a local Ray)")

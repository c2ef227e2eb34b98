"""The ``compat`` command line: one sub-command per module in ``app.commands``, listed in :data:`COMMANDS`.

Each command module defines ``add_arguments(parser)`` and ``run(args) -> int``; its one-line help is in
:data:`COMMANDS`.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Iterable

from cluster.tracking_client import check_tracking_uri, tracking_credentials_from_environment
from pipelines.lease import RunFolderBusyError
from pipelines.store import CorruptArtifactError

# name -> one-line help, in the order ``compat --help`` shows them; the command's code is ``app.commands.<name>``.
# The dispatcher imports only the module of the command being run (every module imports what it needs at its top,
# which for some is Ray, Ray Serve, MLflow or torch): ``compat --help`` and ``compat <command>`` pay for one
# command's imports, never for all of them.
COMMANDS = {
    "demo": "run the glyph demo (ER and d-Simplex-HOC, 7 tasks, replacements at tasks 3 and 5) and print the results",
    "run": "run a scenario (train, replace, extract, evaluate); resumable: completed stages are skipped",
    "plan": "print a scenario's stage graph, resources per stage, feature storage and matrix cost (no compute)",
    "eval": "recompute the matrix and metrics of a finished run under another protocol, from its stored features",
    "report": ("regenerate report.md, matrix.png (heatmap) and aa_tau.png of a finished run and print AC, AA, ACA, "
               "BC, FC"),
    "compare": "compare finished runs: one table (AC, AA, ACA, BC, FC) and one plot (AA_tau curves, metric bars)",
    "ui": "start the MLflow UI on 127.0.0.1 over the machine's compat tracking store and print its URL",
    "theory": "Monte Carlo check of Theorem 1 on hyperspherical caps at d-Simplex vertices (exit 1 if violated).",
    "submit": "submit a scenario to a Ray cluster as a Ray Job (idempotent: the id derives from the config hash)",
    "status": "status of a submitted job (or a table of every compat-* job on the cluster)",
    "logs": "print the logs of a submitted job (--follow: until it ends)",
    "cluster": "start / stop a local Ray head (own temp dir and ports, 127.0.0.1, token auth) for compat submit",
    "tune": "hyper-parameter search over whole pipelines (Ray Tune + Optuna, ASHA), every trial tracked in MLflow",
    "ingest": "convert a registered dataset split into Parquet shards + manifest (local folder or s3://), resumable",
    "gate": "compatibility gate on a registry alias: evaluate, promote only when compatible; history; rollback",
    "calibrate": "Measure (or --show) which arithmetic is fast here: GEMM fp32/bf16/fp16/int8 and autocast per model.",
    "index": "gallery indexes for `compat serve`: build from a pool and a model version, backfill, show",
    "serve": "serve a gallery index to queries embedded by a registry model (Ray Serve; follows the @champion alias)",
}


def available_commands() -> list[str]:
    """Names of the commands whose module is part of this build, in :data:`COMMANDS` order."""
    return [name for name in COMMANDS if importlib.util.find_spec(f"app.commands.{name}") is not None]


def package_version() -> str:
    """The installed distribution's version (``compat-learning``), or 'unknown' when run from a bare checkout."""
    try:
        return version("compat-learning")
    except PackageNotFoundError:
        return "unknown"


def build_parser(load: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The ``compat`` parser: a sub-parser per available command (each sets ``args._run``).

    load: the commands whose module is imported and whose arguments are added (None: every command); the others
    are listed with their help line only."""
    parser = argparse.ArgumentParser(
        prog="compat",
        description="Compatible representation learning: train, replace and evaluate compatible models.",
    )
    parser.add_argument("--version", action="version", version=f"compat {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in available_commands():
        command_parser = sub.add_parser(name, help=COMMANDS[name], description=COMMANDS[name])
        if load is not None and name not in load:
            continue
        module = importlib.import_module(f"app.commands.{name}")
        module.add_arguments(command_parser)
        command_parser.add_argument("--debug", action="store_true",
                                    help="show the full traceback of an error instead of a one-line message")
        command_parser.set_defaults(_run=module.run)
    return parser


def requested_command(argv: list[str]) -> str | None:
    """The command named in ``argv`` (the first argument that is not an option; the top-level options take no
    value), or None."""
    first = next((arg for arg in argv if not arg.startswith("-")), None)
    return first if first in COMMANDS else None


def main(argv: list[str] | None = None) -> int:
    """Run ``compat`` with ``argv`` (None: ``sys.argv[1:]``); returns the command's exit code, 2 without a command.

    Errors print one line (what failed and how to fix it) and exit 1 (2 for bad input); ``--debug`` re-raises them
    with the traceback.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    command = requested_command(argv)
    parser = build_parser(load=[command] if command else [])
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    tracking_credentials_from_environment()  # before any Ray starts: a password never travels inside a URI
    if getattr(args, "tracking_uri", None) not in (None, "none"):
        try:
            args.tracking_uri = check_tracking_uri(args.tracking_uri)
        except ValueError as error:
            print(f"error: --tracking-uri: {error}", file=sys.stderr)
            return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 - every failure becomes a one-line message unless --debug
        if getattr(args, "debug", False):
            raise
        message, code = describe_error(error, args)
        print(f"error: {message}", file=sys.stderr)
        print("(run again with --debug for the traceback)", file=sys.stderr)
        return code


def describe_error(error: BaseException, args) -> tuple[str, int]:
    """(one-line message with the fix where one is known, exit code) for an exception a command raised."""
    if isinstance(error, CorruptArtifactError):
        run_dir = getattr(args, "resume", None) or getattr(args, "output", None) or getattr(args, "run_dir", None) \
            or "RUN_DIR"
        fix = (f"; recompute that stage with: compat run --resume {run_dir} --recompute {error.stage_key[:24]}"
               if error.stage_key else "")
        return f"{error}{fix}", 1
    if isinstance(error, RunFolderBusyError):
        return str(error), 1
    if isinstance(error, (ValueError, KeyError, FileNotFoundError)):
        text = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
        return str(text), 2
    return f"{type(error).__name__}: {error}", 1


if __name__ == "__main__":
    sys.exit(main())

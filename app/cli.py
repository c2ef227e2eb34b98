"""The ``compat`` command line: one sub-command per pair of modules ``app.arguments.<name>`` / ``app.commands.<name>``.

A command's arguments are ``app.arguments.<name>.add_arguments(parser)`` (argparse only) and its code is
``app.commands.<name>.run(args) -> int``, run by :mod:`app.dispatch`. Its one-line help is in :data:`COMMANDS` (which
also orders ``compat --help``) or, for a command not listed there, the ``HELP`` string of its arguments module; such
commands are found by listing ``app/commands`` and follow the listed ones in name order. Parsing, ``--help``
included, imports neither the command's code nor the dispatcher, so it never waits for torch, Ray or MLflow.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import pkgutil
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Iterable

# name -> one-line help, in the order ``compat --help`` shows them; the command's arguments are
# ``app.arguments.<name>`` and its code ``app.commands.<name>``. Only the module of the command being run is imported
# (every module imports what it needs at its top, which for some is Ray, Ray Serve, MLflow or torch), and only once
# its arguments parsed: ``compat <command>`` pays for one command's imports, ``--help`` for none.
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
    "models": "registry housekeeping: `compat models prune` removes per-run aliases of run folders that are gone",
}


def _has_modules(name: str) -> bool:
    return (importlib.util.find_spec(f"app.commands.{name}") is not None
            and importlib.util.find_spec(f"app.arguments.{name}") is not None)


def available_commands() -> list[str]:
    """Names of the commands whose modules are part of this build: :data:`COMMANDS` order, then the other commands of
    ``app/commands`` (with an arguments module) in name order."""
    listed = [name for name in COMMANDS if _has_modules(name)]
    commands = importlib.import_module("app.commands")
    found = sorted(info.name for info in pkgutil.iter_modules(commands.__path__) if not info.ispkg)
    return listed + [name for name in found if name not in COMMANDS and _has_modules(name)]


def command_help(name: str) -> str:
    """The one-line help of command ``name``: its :data:`COMMANDS` entry, else its arguments module's ``HELP``."""
    if name in COMMANDS:
        return COMMANDS[name]
    return str(getattr(importlib.import_module(f"app.arguments.{name}"), "HELP", ""))


def package_version() -> str:
    """The installed distribution's version (``compat-learning``), or 'unknown' when run from a bare checkout."""
    try:
        return version("compat-learning")
    except PackageNotFoundError:
        return "unknown"


def build_parser(load: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The ``compat`` parser: a sub-parser per available command (``args.command`` names the one chosen).

    load: the commands whose arguments are added (None: every command); the others are listed with their help line
    only. Only argument modules are imported, never a command's code."""
    parser = argparse.ArgumentParser(
        prog="compat",
        description="Compatible representation learning: train, replace and evaluate compatible models.",
    )
    parser.add_argument("--version", action="version", version=f"compat {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in available_commands():
        text = command_help(name)
        command_parser = sub.add_parser(name, help=text, description=text)
        if load is not None and name not in load:
            continue
        importlib.import_module(f"app.arguments.{name}").add_arguments(command_parser)
        command_parser.add_argument("--debug", action="store_true",
                                    help="show the full traceback of an error instead of a one-line message")
    return parser


def requested_command(argv: list[str]) -> str | None:
    """The command named in ``argv`` (the first argument that is not an option; the top-level options take no
    value), or None."""
    first = next((arg for arg in argv if not arg.startswith("-")), None)
    return first if first in COMMANDS or (first and first.isidentifier() and _has_modules(first)) else None


def main(argv: list[str] | None = None) -> int:
    """Run ``compat`` with ``argv`` (None: ``sys.argv[1:]``); returns the command's exit code, 2 without a command.

    Arguments are parsed (``--help`` and argument errors end here) before the command's code is imported; then
    :func:`app.dispatch.run_command` runs it. Errors print one line (what failed and how to fix it) and exit 1 (2 for
    bad input); ``--debug`` re-raises them with the traceback.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    command = requested_command(argv)
    parser = build_parser(load=[command] if command else [])
    args = parser.parse_args(argv)
    args.argv = argv  # the command line as given (a run records it with its results)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    return importlib.import_module("app.dispatch").run_command(args)


if __name__ == "__main__":
    sys.exit(main())

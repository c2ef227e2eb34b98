"""The ``compat`` command line: one sub-command per module in ``pipelines.commands``.

Each command module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# Order is the order shown by ``compat --help``.
COMMAND_MODULES = (
    "demo",
    "run",
    "plan",
    "eval",
    "report",
    "compare",
    "theory",
    "submit",
    "status",
    "logs",
    "tune",
    "ingest",
)


def _load_commands() -> dict[str, object]:
    commands = {}
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"pipelines.commands.{name}")
        except ModuleNotFoundError as error:
            # A command whose module is not part of this build is simply not offered.
            if error.name == f"pipelines.commands.{name}":
                continue
            raise
        commands[name] = module
    return commands


def build_parser() -> argparse.ArgumentParser:
    """The ``compat`` parser with one sub-parser per available command module (each sets ``args._run``)."""
    parser = argparse.ArgumentParser(
        prog="compat",
        description="Compatible representation learning: train, replace and evaluate compatible models.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in _load_commands().items():
        command_parser = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(command_parser)
        command_parser.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``compat`` with ``argv`` (None: ``sys.argv[1:]``); returns the command's exit code, 2 without a command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

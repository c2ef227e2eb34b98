"""The ``compat`` command line: one sub-command per module in ``app.commands``.

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
    "ui",
    "theory",
    "submit",
    "status",
    "logs",
    "cluster",
    "tune",
    "ingest",
    "gate",
    "calibrate",
    "index",
    "serve",
)


def _load_commands() -> dict[str, object]:
    commands = {}
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"app.commands.{name}")
        except ModuleNotFoundError as error:
            # A command whose module is not part of this build is simply not offered.
            if error.name == f"app.commands.{name}":
                continue
            raise
        commands[name] = module
    return commands


def package_version() -> str:
    """The installed distribution's version (``compat-learning``), or 'unknown' when run from a bare checkout."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("compat-learning")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The ``compat`` parser with one sub-parser per available command module (each sets ``args._run``)."""
    parser = argparse.ArgumentParser(
        prog="compat",
        description="Compatible representation learning: train, replace and evaluate compatible models.",
    )
    parser.add_argument("--version", action="version", version=f"compat {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in _load_commands().items():
        command_parser = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(command_parser)
        command_parser.add_argument("--debug", action="store_true",
                                    help="show the full traceback of an error instead of a one-line message")
        command_parser.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``compat`` with ``argv`` (None: ``sys.argv[1:]``); returns the command's exit code, 2 without a command.

    Errors print one line (what failed and how to fix it) and exit 1 (2 for bad input); ``--debug`` re-raises them
    with the traceback.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    from cluster.tracking_client import check_tracking_uri, tracking_credentials_from_environment

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
    from pipelines.lease import RunFolderBusyError
    from pipelines.store import CorruptArtifactError

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

"""Running one parsed ``compat`` command (:func:`run_command`): its code module ``app.commands.<name>``, the
tracking target resolved once (``args.tracking``, from ``--tracking-uri``, ``MLFLOW_TRACKING_URI`` or the machine's
store) with credentials moved out of every URI before any Ray starts, and every error turned into one line with its
fix (:func:`describe_error`). ``app.cli`` imports this module only once the arguments parsed."""
from __future__ import annotations

import argparse
import importlib
import sys

from cluster.tracking.client import (
    bound_mlflow_http_retries, tracking_credentials_from_environment, wait_for_tracking_server,
)
from cluster.tracking.store import resolve_tracking
from compat_core.integrity import IntegrityError
from pipelines.store.lease import RunFolderBusyError


def run_command(args: argparse.Namespace) -> int:
    """Import ``app.commands.<args.command>`` and run it with ``args``; returns its exit code (see app.cli.main)."""
    module = importlib.import_module(f"app.commands.{args.command}")
    tracking_credentials_from_environment()  # before any Ray starts: a password never travels inside a URI
    bound_mlflow_http_retries()
    if hasattr(args, "tracking_uri"):  # a command that tracks: its one tracking target, passed down as is
        try:
            args.tracking = resolve_tracking(args.tracking_uri)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        del args.tracking_uri
        try:
            if args.tracking.uri is not None:
                wait_for_tracking_server(args.tracking.uri)
        except ConnectionError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
    try:
        return int(module.run(args) or 0)
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


def task_cause(error: BaseException) -> tuple[BaseException, str | None]:
    """(the exception a Ray task raised, the task's function name) for Ray's wrapper of it (whose text holds the
    remote traceback), else (error, None); nested wrappers are unwrapped too. Ray is not imported."""
    where = None
    while type(error).__name__.startswith("RayTaskError") and isinstance(getattr(error, "cause", None),
                                                                           BaseException):
        where = where or getattr(error, "function_name", None) or ""  # Ray's typed wrappers keep only the cause
        error = error.cause
    return error, where


def describe_error(error: BaseException, args) -> tuple[str, int]:
    """(one-line message with the fix where one is known, exit code) for an exception a command raised; an error
    raised in a Ray task is described by its cause, with the task named."""
    error, task = task_cause(error)
    message, code = _describe(error, args)
    if task is None:
        return message, code
    return f"{message} (raised in {'Ray task ' + task if task else 'a Ray task'})", code


def _describe(error: BaseException, args) -> tuple[str, int]:
    if isinstance(error, IntegrityError):
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


__all__ = ["describe_error", "run_command", "task_cause"]

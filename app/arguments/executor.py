"""The ``--executor`` argument of the commands that run a graph (``compat run``, ``submit``, ``demo``): its choices
and their help come from the executor registry (:data:`pipelines.engine.backends.EXECUTORS`, filled by
:mod:`cluster.executors`), whose cards import no executor code, so parsing stays light."""
from __future__ import annotations

import argparse

from cluster.executors import EXECUTORS


def add_executor_argument(parser: argparse.ArgumentParser, default: str, help: str) -> None:
    """``--executor NAME`` with every registered executor as a choice; ``help`` is followed by each one's summary."""
    names = EXECUTORS.names()
    choices = "; ".join(f"{name}: {EXECUTORS.get(name).summary}" for name in names)
    parser.add_argument("--executor", choices=names, default=default, help=f"{help}. {choices}")

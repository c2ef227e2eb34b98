"""The registry of executors: where ``compat run --executor NAME`` runs a graph's nodes.

An executor is named by an :class:`ExecutorCard`: its name (the ``--executor`` choice), a one-line help, the
``"module:Class"`` of its :class:`pipelines.engine.runner.Executor` (imported only when a run builds one, so the
card of the Ray executor is read without importing Ray, and argument parsing stays light) and whether its nodes run
on a cluster's workers (``--address`` names the cluster, and the device is judged there). The in-process executor is
registered here; the cluster layer registers its own from the modules of ``cluster/executors/``. Every ``--executor``
choice and its validation come from :data:`EXECUTORS`.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from compat_core.registry import Registry

EXECUTORS: Registry = Registry("executor")


@dataclass(frozen=True)
class ExecutorCard:
    """A registered executor. factory: ``"module:Class"`` of the Executor, called with ``emit`` and ``progress``
    and, for a cluster executor, ``address``, ``setup`` and ``num_cpus`` (see :func:`build_executor`). on_cluster:
    nodes run on a cluster's workers (``--address``, ``setup`` in each worker, the device judged by the cluster)."""

    name: str
    summary: str
    factory: str
    on_cluster: bool = False

    def __post_init__(self) -> None:
        module, _, attribute = self.factory.partition(":")
        if not module or not attribute:
            raise ValueError(f"executor {self.name!r}: factory must be 'module:Class', got {self.factory!r}")

    def executor_class(self) -> Callable[..., Any]:
        """The Executor class the card names (imports its module: Ray, for the Ray executor)."""
        module, _, attribute = self.factory.partition(":")
        return getattr(importlib.import_module(module), attribute)


def register_executor(card: ExecutorCard) -> ExecutorCard:
    """Add ``card`` to :data:`EXECUTORS` (ValueError when another card holds its name)."""
    EXECUTORS.register(card.name, card)
    return card


def executor_names() -> list[str]:
    """Every registered executor name, sorted (the ``--executor`` choices)."""
    return EXECUTORS.names()


def address_refusal(name: str, address: str | None) -> str | None:
    """Why ``--address`` cannot go with executor ``name`` (it runs in-process), naming the executors that take one;
    None when it can (or no address is given). KeyError listing the valid names for an unknown executor."""
    if not address or EXECUTORS.get(name).on_cluster:
        return None
    takes = " / ".join(n for n in EXECUTORS.names() if EXECUTORS.get(n).on_cluster) or "(none registered)"
    return f"--address applies to --executor {takes} only"


def build_executor(name: str, emit: Callable[[Any], None] | None = None, progress: bool = True,
                   address: str | None = None, setup: Callable[[], None] | None = None,
                   num_cpus: int | None = None) -> Any:
    """The Executor registered as ``name`` (KeyError listing the valid names). address, setup, num_cpus: options of
    cluster executors (num_cpus: CPUs of an instance the executor starts itself; None: its default); an address
    given to an in-process executor is a ValueError (:func:`address_refusal`)."""
    card = EXECUTORS.get(name)
    refusal = address_refusal(name, address)
    if refusal is not None:
        raise ValueError(refusal)
    options: dict[str, Any] = {"emit": emit, "progress": progress}
    if card.on_cluster:
        options.update(address=address, setup=setup)
        if num_cpus is not None:
            options["num_cpus"] = num_cpus
    return card.executor_class()(**options)


LOCAL = register_executor(ExecutorCard(
    "local", "every node in this process, one after the other, without Ray",
    "pipelines.engine.runner:LocalExecutor"))


__all__ = ["EXECUTORS", "ExecutorCard", "LOCAL", "address_refusal", "build_executor", "executor_names",
           "register_executor"]

"""The memory preflight of a run whose training stages run on a Ray cluster (``--executor ray``, ``compat submit``,
``compat tune``): each training stage's estimate (:func:`pipelines.config.preflight.memory_problems`) against the
memory of the cluster node that will hold the stage, before any stage starts.

What it compares with: the ``memory`` resource Ray reports in a node's totals (``ray start`` sets it from the
memory the node had free when it started, less its object store; ``--memory`` overrides it), the largest such value
among the alive nodes whose totals cover a training stage's CPU / GPU / custom request. Ray reports no GPU memory, so
a training stage that runs on a GPU is not checked here (logged). With an autoscaler (``resources.autoscaling``) a
bigger node may come, so nothing is refused then (logged).
"""
from __future__ import annotations

import logging
from typing import Any, Iterable

from cluster.ray.resource_check import task_options
from pipelines.config.preflight import PreflightError, memory_problems
from pipelines.graph.stage_kind import StageKind

log = logging.getLogger(__name__)

TRAINING_KINDS = tuple(kind for kind in StageKind if kind.trains)


def _alive(nodes: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [node for node in nodes if node.get("Alive", node.get("alive", True))]


def _holds(node: dict[str, Any], request: dict[str, Any]) -> bool:
    """Whether a node's totals cover a Ray request's CPU, GPU and custom resources (memory is what is compared)."""
    totals = dict(node.get("Resources") or {})
    wanted = {"CPU": float(request.get("num_cpus") or 0), "GPU": float(request.get("num_gpus") or 0),
              **{name: float(value) for name, value in (request.get("resources") or {}).items()}}
    return all(totals.get(name, 0.0) >= value for name, value in wanted.items() if value > 0)


def node_memory_room(nodes: Iterable[dict[str, Any]], requests: list[dict[str, Any]]) -> tuple[int, str, str] | None:
    """(bytes, what, who) of the largest ``memory`` total among alive nodes that can hold one of ``requests`` (Ray
    option dicts: num_cpus, num_gpus, resources), or None when no such node reports memory."""
    candidates = [node for node in _alive(nodes) if any(_holds(node, request) for request in requests)]
    sized = [(float((node.get("Resources") or {}).get("memory") or 0), node) for node in candidates]
    sized = [(value, node) for value, node in sized if value > 0]
    if not sized:
        return None
    value, node = max(sized, key=lambda pair: pair[0])
    address = node.get("NodeManagerAddress") or node.get("node_ip") or "?"
    return (int(value), "the `memory` resource Ray reports for it",
            f"the largest Ray node that can hold the stage ({address}, of {len(candidates)})")


def check_cluster_memory(config, nodes: Iterable[dict[str, Any]], requests: list[dict[str, Any]],
                         autoscaling: bool = False) -> None:
    """Raise PreflightError when a training stage of ``config`` needs more memory than the node of the cluster that
    can hold it (see the module docstring); ``requests``: the Ray options each training stage runs with."""
    if any(float(request.get("num_gpus") or 0) > 0 for request in requests):
        log.info("memory preflight: training stages run on GPUs, whose memory Ray does not report; not checked")
        return
    room = node_memory_room(list(nodes), requests)
    if room is None:
        log.info("memory preflight: no Ray node that can hold a training stage reports its memory; not checked")
        return
    problems = memory_problems(config, room=room)
    if not problems:
        return
    if autoscaling:
        for _key, problem in problems:
            log.warning("%s (resources.autoscaling: a bigger node may be added)", problem)
        return
    raise PreflightError(problems)


def training_requests(config, nodes: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Ray options every kind of training stage of ``config`` runs with on a cluster of ``nodes``."""
    has_gpus = any(float((node.get("Resources") or {}).get("GPU") or 0) > 0 for node in _alive(nodes))
    return [task_options(config.resources.for_stage(kind), str(config.device), has_gpus) for kind in TRAINING_KINDS]


def check_job_memory(config, address: str) -> None:
    """:func:`check_cluster_memory` of a scenario about to be submitted as a Ray Job to the cluster whose job server
    is ``address``; its nodes are read through Ray's state API (bounded by 10 s)."""
    nodes = state_api_nodes(address)
    check_cluster_memory(config, nodes, training_requests(config, nodes), config.resources.autoscaling)


def state_api_nodes(address: str) -> list[dict[str, Any]]:
    """The nodes of the cluster whose dashboard / job server is ``address`` (http(s)://HOST:8265), through Ray's
    state API, in the shape of ``ray.nodes()`` (Alive, Resources, NodeManagerAddress)."""
    from ray.util.state import list_nodes

    return [{"Alive": str(node.state).upper().endswith("ALIVE"), "Resources": dict(node.resources_total or {}),
             "NodeManagerAddress": node.node_ip}
            for node in list_nodes(address=address, timeout=10, raise_on_missing_output=False)]


__all__ = ["TRAINING_KINDS", "check_cluster_memory", "check_job_memory", "node_memory_room", "state_api_nodes",
           "training_requests"]

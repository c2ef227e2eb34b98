"""Fail fast on a stage that no node of the cluster can ever hold, instead of a task pending forever.

A request is satisfiable when one alive node's *total* resources cover it (what is free now does not matter: Ray
queues until it is). With an autoscaler the cluster may still grow, so nothing is refused then; the stage waits
and the log says for what. :func:`task_options` turns a stage's ``resources.<kind>`` into the Ray options it runs with.
"""
from __future__ import annotations

from typing import Any, Iterable

GIB = 1024 ** 3


class UnsatisfiableResourcesError(RuntimeError):
    """A stage asks for more than the largest node has (message: stage, resource, largest node, the fix)."""


def _describe(name: str, value: float) -> str:
    return f"{value / GIB:.1f} GiB" if name == "memory" else f"{value:g}"


def task_options(resources: Any, device: str, cluster_has_gpus: bool) -> dict:
    """Ray options of a node: num_cpus, num_gpus (None: 0 with ``device: cpu``, 1 with ``cuda[:N]``, and with
    ``auto`` 1 when the cluster has GPUs), memory (bytes), custom resources."""
    gpus = resources.num_gpus
    if gpus is None:
        gpus = 0.0 if device == "cpu" else 1.0 if device.startswith("cuda") else float(cluster_has_gpus)
    options: dict[str, Any] = {"num_cpus": float(resources.num_cpus), "num_gpus": float(gpus)}
    if resources.memory:
        options["memory"] = int(resources.memory)
    if getattr(resources, "custom", None):
        options["resources"] = {name: float(value) for name, value in resources.custom.items()}
    return options


def check_satisfiable(label: str, config_key: str, request: dict[str, float], nodes: Iterable[dict[str, Any]],
                      autoscaling: bool) -> str | None:
    """None when some alive node's totals cover ``request`` (Ray option names: num_cpus, num_gpus, memory,
    resources = custom resources). With
    ``autoscaling`` returns a line saying what the stage waits for; otherwise raises UnsatisfiableResourcesError."""
    wanted = {"CPU": float(request.get("num_cpus") or 0), "GPU": float(request.get("num_gpus") or 0),
              "memory": float(request.get("memory") or 0),
              **{name: float(value) for name, value in (request.get("resources") or {}).items()}}  # custom
    alive = [dict(node.get("Resources") or {}) for node in nodes if node.get("Alive", node.get("alive", True))]
    if any(all(node.get(name, 0.0) >= value for name, value in wanted.items() if value > 0) for node in alive):
        return None
    short = [name for name, value in wanted.items() if value > 0
             and max((node.get(name, 0.0) for node in alive), default=0.0) < value]
    parts = [f"{name}={_describe(name, wanted[name])} (largest node: "
             f"{_describe(name, max((node.get(name, 0.0) for node in alive), default=0.0))})" for name in short]
    if autoscaling:
        return f"stage {label} waits for a node with {', '.join(parts)}: the autoscaler may add one"
    raise UnsatisfiableResourcesError(
        f"stage {label} asks for {', '.join(parts) or 'resources no single node has'}, more than any node of the "
        f"cluster has; lower {config_key} or add a bigger node (with an autoscaler, set resources.autoscaling: true "
        f"and the stage waits for one)")


__all__ = ["UnsatisfiableResourcesError", "check_satisfiable", "task_options"]

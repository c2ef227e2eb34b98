"""The Ray executor: every node of the graph is one Ray task on a cluster (``cluster.ray.task_backend``, imported only
when a run builds it)."""
from __future__ import annotations

from pipelines.engine.backends import ExecutorCard, register_executor

RAY = register_executor(ExecutorCard(
    "ray", "every node a Ray task on the cluster --address names, else on an embedded local Ray instance",
    "cluster.ray.task_backend:RayExecutor", on_cluster=True))

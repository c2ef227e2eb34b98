"""Ray backend of the engine: every node of the graph (stage or matrix entry) is one Ray task.

- :func:`pipelines.engine.runner.run_graph` (the same loop as in-process runs) submits a node as soon as its parents are
  committed; this backend turns it into a Ray task with the node's ``resources.<kind>`` (``num_cpus``,
  ``num_gpus``, ``memory`` in bytes) and lets Ray place and queue it. Ray reuses its worker processes between
  extractions, entries and evaluations, so Python and torch start once per worker (each node gives its freed memory
  back to the OS when it ends); a training node that asks for a GPU, or whose ``resources.<kind>.own_process`` is
  true, runs in a worker process of its own that exits after it (:func:`runs_in_own_process`). torch is limited to
  ``floor(num_cpus)`` threads per task.
- ``num_gpus`` None: 0 with ``device: cpu``, 1 with ``device: cuda[:N]`` (Ray queues the task until a GPU node
  exists, e.g. one an autoscaler adds), and with ``device: auto`` 1 when the cluster lists GPUs when the run starts.
- Matrix entries are tasks too; a worker process keeps the last feature sets it read
  (:func:`pipelines.stages.execute.cached_features`), so entries of one row read their query once per worker.
- ``resources.<stage>.num_workers`` > 1 (pretrain, finetune): the node is a Ray Train run of that many workers,
  each with the stage's resources (:mod:`cluster.ray.train_stage`); rank 0 commits the stage.
- Tasks retry ``max_retries`` times after a worker or node failure; a node found committed when its (retried) task
  starts is not recomputed. Only keys and per-epoch training summaries travel through Ray; models and features move
  through the run store (local folder or s3://) by URI, so a multi-node cluster needs a store every node reaches.
- Workers write only under the driver's run-folder lease (:mod:`cluster.ray.worker`): a worker whose driver lost it
  (paused past the stale time and taken over by another driver) commits nothing.

``--address http(s)://HOST:8265`` (a dashboard / job server) runs the pipeline as a Ray Job instead
(:func:`cluster.ray.jobs.submit_pipeline`) and waits for it.
"""
from __future__ import annotations

import collections
import json
import logging
import math
import os
from typing import Any, Callable, Iterable

import ray

from cluster.ray.auth import prepare_client_auth, token_for_embedded_ray
from cluster.ray.embedded import start_embedded
from cluster.ray.jobs import submit_pipeline
from cluster.ray.loopback import prepare_loopback
from cluster.ray.memory_check import check_cluster_memory
from cluster.ray.reach import local_address_towards, require_answering, require_reachable
from cluster.ray.resource_check import check_satisfiable, task_options
from cluster.ray.train_stage import run_data_parallel_node
from cluster.ray.worker import NodeResult, run_stage_in_worker
from cluster.storage.s3 import installed_access
from pipelines.config.load import config_to_dict
from pipelines.config.schema import StageResources
from pipelines.engine.runner import Backend, Executor, Invocation, close_emit, read_invocations, run_graph
from pipelines.engine.progress import ProgressReporter
from pipelines.graph.compile import Stage, StageGraph
from pipelines.graph.stage_kind import StageKind
from pipelines.records.stage_records import CommittedStage
from pipelines.stages.inputs import RunSettings
from pipelines.results.assemble import read_result
from pipelines.store.lease import LeaseFence, lease_fence
from pipelines.store.run_store import RunStore

log = logging.getLogger(__name__)

EMBEDDED_OBJECT_STORE_BYTES = 200 * 1024 * 1024  # results are small records: a small object store is enough
LOOPBACK = "127.0.0.1"


# ---- connection -----------------------------------------------------------------------------------------------
def connect(address: str | None = None, num_cpus: int | None = None, num_gpus: int | None = None,
            object_store_memory: int = EMBEDDED_OBJECT_STORE_BYTES) -> bool:
    """Connect this process to Ray; returns True when this call started (and so owns) a new local instance.

    address None: the cluster named by ``RAY_ADDRESS`` when set, else an embedded local instance bound to
    127.0.0.1, no dashboard, ``object_store_memory`` bytes.
    ``auto`` / ``HOST:PORT`` / ``ray://HOST:10001``: an existing cluster (token auth comes from the standard
    ``RAY_AUTH_MODE`` / ``RAY_AUTH_TOKEN`` / ``RAY_AUTH_TOKEN_PATH`` variables; see docs/cluster.md).
    Reuses an already initialised Ray in this process (and then returns False).
    """
    if ray.is_initialized():
        return False
    if address is not None and address.startswith(("http://", "https://")):
        raise ValueError(f"--address {address}: an http(s) address is a job server; use cluster.ray.jobs "
                         f"(compat submit) or RayExecutor(address=...), which submits a Ray Job")
    if address is None and os.environ.get("RAY_ADDRESS"):
        # inside a Ray Job (or a shell pointed at a cluster): join that cluster, do not start another
        ray.init(configure_logging=False)
    elif address is None:
        prepare_loopback()  # every port on 127.0.0.1, none on the machine's other interfaces
        token_for_embedded_ray()  # Ray itself would write a missing token file readable by every user
        # address "local": always a new instance; without it ray.init joins the latest cluster another process
        # started on this machine (/tmp/ray/ray_current_cluster) and then refuses num_cpus
        start_embedded(num_cpus=num_cpus, num_gpus=num_gpus, object_store_memory=object_store_memory)
    else:
        options: dict = {}
        if address != "auto":
            port = 10001 if address.startswith("ray://") else 6379
            require_reachable(address, "Ray cluster", port)
            require_answering(address, "Ray cluster", port)  # a port that never answers would hang ray.init
            if not address.startswith("ray://"):
                # the driver's node address is the one on the route to the head (127.0.0.1 for a loopback head),
                # never a guess: a head bound to 127.0.0.1 cannot reach the machine's other address
                options["_node_ip_address"] = local_address_towards(address, 6379)
                if options["_node_ip_address"] == LOOPBACK:
                    prepare_loopback()

        prepare_client_auth()  # a token in Ray's standard places authenticates to a token-protected head
        ray.init(address=address, configure_logging=False, **options)
    return True


# ---- the backend ------------------------------------------------------------------------------------------------
OWN_PROCESS_RUNTIME_ENV = {"env_vars": {"COMPAT_NODE_PROCESS": "own"}}  # merged into the job's runtime env
DEFAULT_MAX_RETRIES = 3  # a transient failure (a node lost, an OOM kill): a few attempts, then the error surfaces


def run_node(store_root: str, stage: Stage, settings: RunSettings, code_version: str, num_threads: int,
             setup: Callable[[], None] | None = None, storage_access: Any = None,
             fence: LeaseFence | None = None) -> NodeResult:
    """Body of a plain node's Ray task: torch limited to ``num_threads`` threads, then the one worker body
    (:func:`cluster.ray.worker.run_stage_in_worker`) executes and commits ``stage`` under the driver's ``fence``."""
    import torch

    torch.set_num_threads(max(1, int(num_threads)))
    return run_stage_in_worker(store_root, stage, settings, code_version, setup=setup, storage_access=storage_access,
                               fence=fence)


def run_node_in_own_process(store_root: str, stage: Stage, settings: RunSettings, code_version: str, num_threads: int,
                            setup: Callable[[], None] | None = None, storage_access: Any = None,
                            fence: LeaseFence | None = None) -> NodeResult:
    """:func:`run_node` for a node that :func:`runs_in_own_process`: submitted with ``max_calls=1``, so the Ray worker
    process exits after it and hands every byte the training held (optimiser state, the old model, allocator free
    lists, input workers) back to the OS; a later node starts in a fresh process, not on this one's high-water mark."""
    return run_node(store_root, stage, settings, code_version, num_threads, setup, storage_access, fence)


def runs_in_own_process(kind: StageKind, resources: StageResources, options: dict) -> bool:
    """Whether a node runs in a worker process of its own (``max_calls=1``): ``resources.own_process`` where set;
    else a training node that asks for a GPU, the rule Ray applies to ``@ray.remote(num_gpus=...)`` functions but not
    to GPUs requested through ``.options()``. Extractions and entries always reuse workers."""
    if not StageKind(kind).trains:
        return False
    if resources.own_process is not None:
        return resources.own_process
    return float(options.get("num_gpus") or 0) > 0


class NodeFailed(RuntimeError):
    """A node's task failed (after its retries); ``stage_key`` names the node."""

    def __init__(self, stage_key: str, error: BaseException) -> None:
        super().__init__(f"node {stage_key} failed: {error}")
        self.stage_key = stage_key


class RayBackend(Backend):
    """One Ray task per node (see the module docstring); ``wait`` returns the first node to finish."""

    def __init__(self, max_retries: int = DEFAULT_MAX_RETRIES, setup: Callable[[], None] | None = None,
                 max_entries: int | None = None) -> None:
        self.max_retries = max_retries
        self.setup = setup
        self.max_entries = max_entries
        self.cluster_has_gpus = float(ray.cluster_resources().get("GPU", 0.0)) > 0
        self.nodes = ray.nodes()  # what each node has in total: a request none can hold never starts
        self.checked: set[tuple] = set()
        self.remote = ray.remote(run_node)
        # nodes that runs_in_own_process: max_calls=1 ends the worker after the node, and a runtime env of their own
        # (Ray keys worker pools by runtime env) keeps Ray from handing them an idle worker that ran other nodes
        self.remote_own_process = ray.remote(max_calls=1, runtime_env=OWN_PROCESS_RUNTIME_ENV)(
            run_node_in_own_process)
        self.remote_data_parallel = ray.remote(run_data_parallel_node)
        self.running: dict[Any, Stage] = {}
        self.running_entries = 0
        self.deferred: collections.deque = collections.deque()
        self.stats = {"tasks": 0, "computed": 0, "largest_result_bytes": 0, "pids": set()}
        self.placements: dict[str, str] = {}  # node key -> Ray node id that committed (or found) it

    def submit(self, stage: Stage, graph: StageGraph, store: RunStore) -> None:
        if stage.kind == StageKind.ENTRY and self.max_entries is not None:
            if self.running_entries >= self.max_entries:  # resources.evaluation_actors: a cap, not a placement
                self.deferred.append((stage, graph, store))
                return
            self.running_entries += 1
        options = task_options(stage.resources, graph.config.device, self.cluster_has_gpus)
        self._check(stage, options, graph.config.resources.autoscaling)
        root = store.root if not store.is_local else store.base  # absolute: workers do not share the driver's cwd
        fence = lease_fence(store.root)  # the driver's run-folder lease: workers commit only while it holds it
        # tasks are named after their stage: `ray list tasks` and the dashboard show finetune[t=3], entry[...]
        if stage.resources.num_workers > 1:
            # a Ray Train run of num_workers workers, each with `options`; the task that fits it holds nothing
            ref = self.remote_data_parallel.options(num_cpus=0, num_gpus=0, max_retries=self.max_retries,
                                                    name=stage.label).remote(
                root, stage, graph.settings, graph.code_version, options, self.max_retries, self.setup,
                installed_access(), fence)
        else:
            remote = (self.remote_own_process if runs_in_own_process(stage.kind, stage.resources, options)
                      else self.remote)
            ref = remote.options(**options, max_retries=self.max_retries, name=stage.label).remote(
                root, stage, graph.settings, graph.code_version, max(1, int(math.floor(options["num_cpus"]))),
                self.setup, installed_access(), fence)
        self.running[ref] = stage
        self.stats["tasks"] += 1

    def check_all(self, graph: StageGraph) -> None:
        """Every stage's request against the cluster, before the first one starts (a stage no node can hold is
        refused now, not after the stages before it have trained); ``device: cuda`` on a cluster without GPUs; the
        memory a training stage needs against the largest node that can hold it (cluster.ray.memory_check)."""
        if str(graph.config.device).startswith("cuda") and not self.cluster_has_gpus:
            raise ValueError(f"device: {graph.config.device!r} but the Ray cluster has no GPU; use auto or cpu")
        training = []
        for stage in graph:
            options = task_options(stage.resources, graph.config.device, self.cluster_has_gpus)
            self._check(stage, options, graph.config.resources.autoscaling)
            if StageKind(stage.kind).trains:
                training.append(options)
        if training:  # the training stages' memory estimate against the node that can hold them
            check_cluster_memory(graph.config, self.nodes, training, graph.config.resources.autoscaling)

    def _check(self, stage: Stage, options: dict, autoscaling: bool) -> None:
        """Refuse (or, with an autoscaler, log) a request no alive node can hold, once per distinct request."""
        request = (stage.kind, json.dumps(options, sort_keys=True))
        if request in self.checked:
            return
        self.checked.add(request)
        kind = stage.kind.config_section
        line = check_satisfiable(stage.label, f"resources.{kind}", options, self.nodes, autoscaling)
        if line:
            log.warning(line)

    def wait(self, timeout: float | None = None) -> tuple[str, list, CommittedStage] | None:
        finished, _ = ray.wait(list(self.running), num_returns=1, timeout=timeout)
        if not finished:
            return None
        stage = self.running.pop(finished[0])
        key = stage.key
        if stage.kind == StageKind.ENTRY and self.max_entries is not None:
            self.running_entries -= 1
            if self.deferred:
                self.submit(*self.deferred.popleft())
        try:
            result = ray.get(finished[0])
        except Exception as error:
            raise NodeFailed(key, error) from error
        self.stats["computed"] += int(result.computed)
        self.placements[key] = result.node_id
        log.info("node %s ran on Ray node %s (worker pid %s, peak resident %s MB)", key, result.node_id, result.pid,
                 "?" if result.peak_rss_bytes is None else f"{result.peak_rss_bytes / 1e6:.0f}")
        self.stats["pids"].add(result.pid)
        self.stats["largest_result_bytes"] = max(self.stats["largest_result_bytes"],
                                                 len(ray.cloudpickle.dumps(result)))
        return key, result.records, result.committed

    def close(self) -> None:
        for ref in self.running:
            ray.cancel(ref)
        self.running.clear()


class RayExecutor(Executor):
    """The engine on Ray (see the module docstring).

    address: None (embedded local instance), ``auto``, ``HOST:PORT``, ``ray://HOST:10001`` or ``http(s)://HOST:8265``
    (submit as a Ray Job and wait). emit: callback for stage events and training summaries (default: progress
    bars). num_cpus: CPUs of the embedded instance (None: all). setup: callable run in a worker before each node
    (registers datasets that live outside the package...; must be picklable and idempotent).
    """

    def __init__(self, address: str | None = None, emit: Callable[[Any], None] | None = None, progress: bool = True,
                 num_cpus: int | None = None, object_store_memory: int = EMBEDDED_OBJECT_STORE_BYTES,
                 max_retries: int = DEFAULT_MAX_RETRIES, setup: Callable[[], None] | None = None) -> None:
        self.address = address
        self.emit = emit if emit is not None else ProgressReporter(enabled=progress)
        self.num_cpus = num_cpus
        self.object_store_memory = object_store_memory
        self.max_retries = max_retries
        self.setup = setup
        self.last_stats: dict[str, Any] = {}

    def run(self, graph: StageGraph, store: RunStore, until: Iterable[str] | None = None) -> Invocation:
        if self.address is not None and self.address.startswith(("http://", "https://")):
            return self._run_as_job(graph, store)
        owns_ray = connect(self.address, self.num_cpus, object_store_memory=self.object_store_memory)
        ray_address = ray.get_runtime_context().gcs_address
        try:
            backend = RayBackend(self.max_retries, self.setup, graph.config.resources.evaluation_actors)
            backend.check_all(graph)
            try:
                return run_graph(graph, store, backend, self.emit, until)
            finally:
                self.last_stats = dict(backend.stats, pids=sorted(backend.stats["pids"]),
                                       nodes=dict(backend.placements), ray_address=ray_address)
        finally:
            close_emit(self.emit)
            if owns_ray:
                ray.shutdown()

    def _run_as_job(self, graph: StageGraph, store: RunStore) -> Invocation:
        """Submit the pipeline as a Ray Job writing to ``store`` and wait; the job's results are read back from the
        store once and emitted as the run's RunResult (the job's engine ran elsewhere)."""
        outcome = submit_pipeline(graph.config, self.address, output=store.root, wait=True, follow=True,
                                  origin=graph.origin)
        if outcome.status != "SUCCEEDED":
            raise RuntimeError(f"Ray job {outcome.submission_id} ended {outcome.status}; "
                               f"see `compat logs {outcome.submission_id} --address {self.address}`")
        summary = Invocation(run_id=outcome.submission_id)
        invocations = read_invocations(store)
        if invocations:
            summary.executed = list(invocations[-1]["executed"])
            summary.skipped = list(invocations[-1]["skipped"])
            summary.seconds = dict(invocations[-1]["seconds"])
        try:
            summary.result = read_result(store, config=config_to_dict(graph.config))
        except FileNotFoundError:
            log.warning("job %s succeeded but %s has no matrix.json reachable from here (a store local to the "
                        "cluster?)", outcome.submission_id, store.root)
            return summary
        self.emit(summary.result)
        return summary


__all__ = ["RayExecutor", "RayBackend", "run_node", "task_options", "connect", "EMBEDDED_OBJECT_STORE_BYTES"]

"""Ray executor: the stage graph run by Ray actors, with the same stage functions as the local executor.

- Every pretrain / finetune / replace / extract stage runs in a stage actor that reserves the stage's resources from
  the config (``resources.<kind>``: ``num_cpus``, ``num_gpus`` - None means 1 when the cluster has GPUs, else 0 -
  and ``memory`` in bytes) and limits torch to ``floor(num_cpus)`` threads. Idle actors with the same resource shape
  are reused (a fresh process per stage would pay Python + torch start-up every time); idle actors of another shape
  are killed when their resources are needed.
- Stages are submitted as soon as all their parents are committed and waited on with ``ray.wait``, so independent
  stages (third-party pre-training, extraction of model t while task t+1 trains, matrix entries) run concurrently.
- Evaluate stages are split into matrix entries computed by evaluation actors (:mod:`cluster.eval_actors`), each
  entry committed on its own; the row record (the same ``MatrixRow`` the local executor writes) is committed by the
  driver when every entry of the row is stored.
- Stages already committed in the store are skipped; actors set ``max_restarts`` / ``max_task_retries`` and restore
  from storage, and a stage found committed when its (retried) call starts is not recomputed.
- Only keys, small records and per-epoch training summaries travel through Ray; models and features move through
  the run store (local folder or s3://) by URI. With a multi-node cluster the store must be reachable by every node
  (s3://, or a shared filesystem path).

``--address http(s)://HOST:8265`` (a dashboard / job server) runs the pipeline as a Ray Job instead
(:func:`cluster.jobs.submit_pipeline`) and waits for it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import ray

from cluster.eval_actors import (DEFAULT_MAX_RESTARTS, DEFAULT_MAX_TASK_RETRIES, EntrySpec, EvaluationWorker,
                                 default_pool_size, entries_of_row)
from pipelines.executor import Executor, RunSummary, finalize_run, prepare_run, read_invocations, record_invocation
from pipelines.graph import Stage, StageGraph
from pipelines.progress import ProgressReporter, ProgressUpdate, StageEvent, StageRecord
from pipelines.store import RunStore

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
        raise ValueError(f"--address {address}: an http(s) address is a job server; use cluster.jobs "
                         f"(compat submit) or RayExecutor(address=...), which submits a Ray Job")
    if address is None and os.environ.get("RAY_ADDRESS"):
        # inside a Ray Job (or a shell pointed at a cluster): join that cluster, do not start another
        ray.init(configure_logging=False)
    elif address is None:
        from cluster.ray_loopback import prepare_loopback

        prepare_loopback()  # every port on 127.0.0.1, none on the machine's other interfaces
        ray.init(num_cpus=num_cpus, num_gpus=num_gpus, object_store_memory=object_store_memory,
                 include_dashboard=False, _node_ip_address=LOOPBACK, configure_logging=False)
    else:
        if address != "auto":
            from cluster.reach import require_reachable

            require_reachable(address, "Ray cluster", 10001 if address.startswith("ray://") else 6379)
        ray.init(address=address, configure_logging=False)
    return True


# ---- actors -----------------------------------------------------------------------------------------------------
class StageWorker:
    """Body of a stage actor: runs one stage at a time with :func:`pipelines.stages.execute_stage`.

    store_root: run directory (absolute local path or s3:// URI). num_threads: torch threads (the CPU share).
    setup: optional callable run when the actor starts (register datasets that live outside the package...).
    """

    def __init__(self, store_root: str, num_threads: int = 1, setup: Callable[[], None] | None = None) -> None:
        import torch

        torch.set_num_threads(max(1, int(num_threads)))
        if setup is not None:
            setup()
        self.store = RunStore(store_root)

    def run(self, stage: Stage, config: Any, code_version: str | None) -> dict:
        """Execute and commit ``stage``; returns {"key", "seconds", "records", "pid", "computed"}.

        records: the stage's non-progress records (per-epoch training summaries), replayed by the driver to its
        emit callback. computed: False when the stage was already committed (a retried call after a restart).
        """
        from pipelines.stages import execute_stage

        started = time.perf_counter()
        if self.store.has(stage.key):
            return {"key": stage.key, "seconds": 0.0, "records": [], "pid": os.getpid(), "computed": False}
        records: list[Any] = []

        def emit(record: Any) -> None:
            # per-step progress stays in the actor: only summaries are worth the trip to the driver
            if not isinstance(record, ProgressUpdate):
                records.append(record)

        execute_stage(stage, config, self.store, emit, code_version=code_version)
        return {"key": stage.key, "seconds": time.perf_counter() - started, "records": records, "pid": os.getpid(),
                "computed": True}

    def pid(self) -> int:
        return os.getpid()


@dataclass(frozen=True)
class Shape:
    """Resources one actor reserves: CPUs, GPUs, memory in bytes (None: no reservation)."""

    num_cpus: float
    num_gpus: float
    memory: int | None = None

    def options(self) -> dict:
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory:
            options["memory"] = int(self.memory)
        return options


@dataclass
class _Worker:
    kind: str  # "stage" | "entry"
    shape: Shape
    handle: Any
    busy: bool = False


@dataclass
class _Job:
    kind: str  # "stage" | "entry"
    stage: Stage | None = None
    entry: EntrySpec | None = None
    started: float = 0.0


class _ActorScheduler:
    """Places jobs on actors: reuse an idle actor of the same kind and shape, else create one when the cluster's
    CPUs/GPUs (as counted by this executor) allow, killing idle actors of other shapes to make room."""

    def __init__(self, capacity_cpus: float, capacity_gpus: float, store_root: str, config: Any,
                 max_restarts: int, max_task_retries: int, setup: Callable[[], None] | None) -> None:
        self.capacity_cpus = capacity_cpus
        self.capacity_gpus = capacity_gpus
        self.store_root = store_root
        self.config = config
        self.max_restarts = max_restarts
        self.max_task_retries = max_task_retries
        self.setup = setup
        self.workers: list[_Worker] = []
        self.created = {"stage": 0, "entry": 0}
        self._stage_class = ray.remote(StageWorker)
        self._entry_class = ray.remote(EvaluationWorker)

    def _held(self) -> tuple[float, float]:
        return (sum(w.shape.num_cpus for w in self.workers), sum(w.shape.num_gpus for w in self.workers))

    def _fits(self, shape: Shape) -> bool:
        cpus, gpus = self._held()
        return cpus + shape.num_cpus <= self.capacity_cpus + 1e-9 and gpus + shape.num_gpus <= self.capacity_gpus + 1e-9

    def place(self, kind: str, shape: Shape, limit: int | None = None) -> _Worker | None:
        """An idle actor for a job of ``kind`` and ``shape`` (marked busy), or None when none can be had now."""
        for worker in self.workers:
            if not worker.busy and worker.kind == kind and worker.shape == shape:
                worker.busy = True
                return worker
        if limit is not None and sum(w.kind == kind for w in self.workers) >= limit:
            return None
        alone_too_big = shape.num_cpus > self.capacity_cpus or shape.num_gpus > self.capacity_gpus
        while not self._fits(shape):
            idle = [w for w in self.workers if not w.busy]
            if not idle:
                if alone_too_big and not self.workers:
                    break  # larger than the cluster now: let Ray queue it (an autoscaler may add a node)
                return None
            self.kill(idle[0])
            if alone_too_big and not self.workers:
                break
        worker = _Worker(kind, shape, self._create(kind, shape), busy=True)
        self.workers.append(worker)
        self.created[kind] += 1
        return worker

    def _create(self, kind: str, shape: Shape):
        options = {**shape.options(), "max_restarts": self.max_restarts, "max_task_retries": self.max_task_retries}
        threads = max(1, int(math.floor(shape.num_cpus)))
        if kind == "stage":
            return self._stage_class.options(**options).remote(self.store_root, threads, self.setup)
        return self._entry_class.options(**options).remote(self.store_root, self.config, threads, 4, self.setup)

    def kill(self, worker: _Worker) -> None:
        ray.kill(worker.handle, no_restart=True)
        self.workers.remove(worker)

    def shutdown(self) -> None:
        for worker in list(self.workers):
            self.kill(worker)


# ---- executor ---------------------------------------------------------------------------------------------------
@dataclass
class _RowState:
    stage: Stage
    specs: list[EntrySpec]
    started: float
    values: dict[int, float] = field(default_factory=dict)
    computed: int = 0


class RayExecutor(Executor):
    """Runs a stage graph on Ray (see the module docstring).

    address: None (embedded local instance), ``auto``, ``HOST:PORT``, ``ray://HOST:10001`` or ``http(s)://HOST:8265``
    (submit as a Ray Job and wait). emit: callback for stage events and training summaries (default: progress
    bars). num_cpus: CPUs of the embedded instance (None: all). evaluation_actors: overrides
    ``resources.evaluation_actors``. setup: callable run in every actor when it starts (must be picklable).
    """

    def __init__(self, address: str | None = None, emit: Callable[[Any], None] | None = None, progress: bool = True,
                 num_cpus: int | None = None, object_store_memory: int = EMBEDDED_OBJECT_STORE_BYTES,
                 evaluation_actors: int | None = None, max_restarts: int = DEFAULT_MAX_RESTARTS,
                 max_task_retries: int = DEFAULT_MAX_TASK_RETRIES, setup: Callable[[], None] | None = None) -> None:
        if evaluation_actors is not None and evaluation_actors < 1:
            raise ValueError(f"evaluation_actors: expected >= 1 or None, got {evaluation_actors}")
        self.address = address
        self.emit = emit if emit is not None else ProgressReporter(enabled=progress)
        self.num_cpus = num_cpus
        self.object_store_memory = object_store_memory
        self.evaluation_actors = evaluation_actors
        self.max_restarts = max_restarts
        self.max_task_retries = max_task_retries
        self.setup = setup
        self.last_stats: dict[str, Any] = {}

    # -- public -------------------------------------------------------------------------------------------------
    def run(self, graph: StageGraph, store: RunStore) -> RunSummary:
        if self.address is not None and self.address.startswith(("http://", "https://")):
            return self._run_as_job(graph, store)
        prepare_run(graph.config, store)
        owns_ray = connect(self.address, self.num_cpus, object_store_memory=self.object_store_memory)
        try:
            summary = self._run_graph(graph, store)
        finally:
            close = getattr(self.emit, "close", None)
            if callable(close):
                close()
            if owns_ray:
                ray.shutdown()
        return summary

    # -- internals ----------------------------------------------------------------------------------------------
    def _shape(self, resources: Any, cluster_gpus: float) -> Shape:
        gpus = resources.num_gpus if resources.num_gpus is not None else (1.0 if cluster_gpus > 0 else 0.0)
        return Shape(float(resources.num_cpus), float(gpus), resources.memory)

    def _run_graph(self, graph: StageGraph, store: RunStore) -> RunSummary:
        config = graph.config
        summary = RunSummary(run_id=uuid.uuid4().hex[:12])
        index_of = {stage.key: index for index, stage in enumerate(graph)}
        total = len(graph)
        done: set[str] = set()
        pending: list[Stage] = []
        for stage in graph:
            if store.has(stage.key):
                done.add(stage.key)
                summary.skipped.append(stage.key)
                self.emit(StageEvent(stage.key, stage.label, stage.kind, "skipped", index_of[stage.key], total))
            else:
                pending.append(stage)

        resources = ray.cluster_resources()
        capacity_cpus, capacity_gpus = float(resources.get("CPU", 0.0)), float(resources.get("GPU", 0.0))
        root = store.root if not store.is_local else store.base  # absolute: actors do not share the driver's cwd
        scheduler = _ActorScheduler(capacity_cpus, capacity_gpus, root, config, self.max_restarts,
                                    self.max_task_retries, self.setup)
        entry_shape = self._shape(config.resources.evaluate, capacity_gpus)
        total_entries = sum(int(graph[key].task) + 1 for key in graph.evaluate_stages)
        if self.evaluation_actors is not None:
            pool_limit = self.evaluation_actors
        else:
            pool_limit = default_pool_size(config, total_entries, capacity_cpus, entry_shape.num_cpus)
        rows: dict[str, _RowState] = {}
        entry_queue: list[tuple[str, EntrySpec]] = []
        running: dict[Any, tuple[_Worker, _Job]] = {}
        largest_result = 0
        try:
            while pending or entry_queue or running:
                # 1. stages whose parents are all committed: training/extraction first (the critical path)
                for stage in [s for s in pending if all(p in done for p in s.parents)]:
                    if stage.kind == "evaluate":
                        pending.remove(stage)
                        state = _RowState(stage, entries_of_row(stage, store), time.perf_counter())
                        rows[stage.key] = state
                        entry_queue.extend((stage.key, spec) for spec in state.specs)
                        self.emit(StageEvent(stage.key, stage.label, stage.kind, "started", index_of[stage.key],
                                             total))
                        continue
                    worker = scheduler.place("stage", self._shape(config.resources.for_stage(stage.kind),
                                                                  capacity_gpus))
                    if worker is None:
                        continue
                    pending.remove(stage)
                    ref = worker.handle.run.remote(stage, config, graph.code_version)
                    running[ref] = (worker, _Job("stage", stage=stage, started=time.perf_counter()))
                    self.emit(StageEvent(stage.key, stage.label, stage.kind, "started", index_of[stage.key], total))
                # 2. matrix entries on evaluation actors
                while entry_queue:
                    worker = scheduler.place("entry", entry_shape, limit=pool_limit)
                    if worker is None:
                        break
                    row_key, spec = entry_queue.pop(0)
                    ref = worker.handle.compute.remote(spec)
                    running[ref] = (worker, _Job("entry", stage=rows[row_key].stage, entry=spec,
                                                 started=time.perf_counter()))
                if not running:
                    waiting = ", ".join(s.label for s in pending[:5])
                    raise RuntimeError(f"no stage can be placed on the cluster (CPU {capacity_cpus:g}, GPU "
                                       f"{capacity_gpus:g}); waiting: {waiting}; check the config's resources")
                finished, _ = ray.wait(list(running), num_returns=1)
                ref = finished[0]
                worker, job = running.pop(ref)
                try:
                    result = ray.get(ref)
                except BaseException:
                    stage = job.stage
                    self.emit(StageEvent(stage.key, stage.label, stage.kind, "failed", index_of[stage.key], total))
                    raise
                worker.busy = False
                largest_result = max(largest_result, len(ray.cloudpickle.dumps(result)))
                if job.kind == "stage":
                    stage = job.stage
                    for record in result["records"]:
                        self.emit(StageRecord(stage.key, record))
                    seconds = time.perf_counter() - job.started
                    done.add(stage.key)
                    summary.executed.append(stage.key)
                    summary.seconds[stage.key] = seconds
                    self.emit(StageEvent(stage.key, stage.label, stage.kind, "done", index_of[stage.key], total,
                                         seconds))
                else:
                    state = rows[job.stage.key]
                    state.values[job.entry.column] = float(result["value"])
                    state.computed += int(bool(result["computed"]))
                    if len(state.values) == len(state.specs):
                        self._commit_row(state, store, graph.code_version)
                        key = state.stage.key
                        done.add(key)
                        summary.executed.append(key)
                        summary.seconds[key] = time.perf_counter() - state.started
                        self.emit(StageEvent(key, state.stage.label, state.stage.kind, "done", index_of[key], total,
                                             summary.seconds[key]))
        finally:
            self.last_stats = {"stage_actors_created": scheduler.created["stage"],
                               "evaluation_actors_created": scheduler.created["entry"],
                               "evaluation_actor_limit": pool_limit, "largest_result_bytes": largest_result}
            scheduler.shutdown()
        record_invocation(store, summary)
        if all(store.has(stage.key) for stage in graph):
            summary.matrix, summary.metrics = finalize_run(graph, store)
        return summary

    @staticmethod
    def _commit_row(state: _RowState, store: RunStore, code_version: str) -> None:
        """Commit the row record exactly as the local executor's evaluate stage would (entries computed here)."""
        from pipelines.stages import MatrixRow

        stage = state.stage
        protocol = stage.params["protocol"]
        values = [state.values[column] for column in range(len(state.specs))]
        record = dataclasses.asdict(MatrixRow("matrix_row", stage.key, int(stage.task), values,
                                              [spec.key for spec in state.specs], protocol["metric"], protocol,
                                              state.computed, len(state.specs) - state.computed))
        record["kind"] = stage.kind
        record["label"] = stage.label
        store.commit(stage.key, record, {}, code_version=code_version)

    def _run_as_job(self, graph: StageGraph, store: RunStore) -> RunSummary:
        """Submit the pipeline as a Ray Job writing to ``store`` and wait; results are read back from the store."""
        from cluster.jobs import submit_pipeline

        outcome = submit_pipeline(graph.config, self.address, output=store.root, wait=True, follow=True)
        if outcome.status != "SUCCEEDED":
            raise RuntimeError(f"Ray job {outcome.submission_id} ended {outcome.status}; "
                               f"see `compat logs {outcome.submission_id} --address {self.address}`")
        summary = RunSummary(run_id=outcome.submission_id)
        invocations = read_invocations(store)
        if invocations:
            summary.executed = list(invocations[-1]["executed"])
            summary.skipped = list(invocations[-1]["skipped"])
            summary.seconds = dict(invocations[-1]["seconds"])
        try:
            summary.matrix = json.loads(store.read_text("matrix.json"))
            summary.metrics = json.loads(store.read_text("metrics.json"))
        except FileNotFoundError:
            log.warning("job %s succeeded but %s has no matrix.json reachable from here (a store local to the "
                        "cluster?)", outcome.submission_id, store.root)
        return summary


__all__ = ["RayExecutor", "StageWorker", "Shape", "connect", "EMBEDDED_OBJECT_STORE_BYTES"]

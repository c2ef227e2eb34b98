"""The one body of every Ray process that runs a stage (a plain node's Ray task and each Ray Train worker of a
data-parallel stage), and the typed result (:class:`NodeResult`) it hands back to the driver.

The body installs the driver's S3 settings and the worker setup, skips a stage found committed (a retried task),
runs :func:`pipelines.stages.execute.execute_stage` (which commits the stage) and returns what the driver needs, all under
the run folder's fence: the driver's lease (:func:`pipelines.store.lease.lease_fence`) travels with the task, and every
write of the worker's RunStore first checks that the driver still holds it, so a worker whose driver lost the lease
(paused past the stale time and taken over by another driver) commits nothing and fails with LeaseLostError naming
the run folder.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any, Callable

import ray

from cluster.storage.s3 import configure_object_storage
from pipelines.engine.events import ProgressUpdate, StageEvent
from pipelines.engine.process_memory import peak_resident_bytes, release_freed_memory, reset_peak
from pipelines.engine.progress import ProgressReporter
from pipelines.graph.compile import Stage
from pipelines.records.stage_records import CommittedStage, read_committed
from pipelines.stages.execute import execute_stage
from pipelines.stages.inputs import RunSettings
from pipelines.store.lease import LeaseFence, hold_fence
from pipelines.store.run_store import RunStore

# seconds between a stage worker's progress lines in the driver's log
WORKER_LINE_INTERVAL_S = 20.0


@dataclass(frozen=True)
class NodeResult:
    """What a node's Ray task returns: its stage key, the non-progress records (per-epoch training summaries, which
    the driver replays to its emit callback), the worker's pid and Ray node id, whether it computed the stage
    (False: found committed, e.g. by a retried task), what is committed (typed record, node keys, blob table; None
    from Ray Train ranks other than 0), which the driver hands on to its emit callback, and the worker's peak
    resident bytes while it ran the node (None where the OS does not say)."""

    key: str
    pid: int
    node_id: str
    computed: bool
    records: list = field(default_factory=list)
    committed: CommittedStage | None = None
    peak_rss_bytes: int | None = None


def run_stage_in_worker(store_root: str, stage: Stage, settings: RunSettings, code_version: str, *,
                        setup: Callable[[], None] | None = None, storage_access: Any = None,
                        fence: LeaseFence | None = None, keep_records: bool = True,
                        placement: dict | None = None) -> NodeResult:
    """Execute and commit ``stage`` in this Ray worker under the driver's ``fence``; returns its NodeResult.

    settings: how the run's stages run (``StageGraph.settings``: device, checkpoint cadence, input workers).
    storage_access: the driver's S3 settings (an S3Access travels without secrets and resolves credentials from
    this worker's own AWS chain). keep_records: False for Ray Train ranks other than 0 (only rank 0's records reach
    the driver). placement: extra manifest placement fields (e.g. the worker group size).
    """
    if storage_access is not None:
        configure_object_storage(storage_access)
    if setup is not None:
        setup()
    store = RunStore(store_root)
    node_id = ray.get_runtime_context().get_node_id()
    records: list[Any] = []
    # Ray reuses this process for later nodes: the peak covers this node only, and what it freed goes back to the
    # OS when it ends (else the next node, an extraction or an entry, starts with this one's high-water mark)
    reset_peak()
    try:
        computed, committed = _execute(store, stage, settings, code_version, node_id, records, keep_records,
                                       placement, fence, store_root)
    finally:
        peak = peak_resident_bytes()
        release_freed_memory()
    return NodeResult(key=stage.key, pid=os.getpid(), node_id=node_id, computed=computed, records=records,
                      committed=committed, peak_rss_bytes=peak)


def _execute(store: RunStore, stage: Stage, settings: RunSettings, code_version: str, node_id: str, records: list,
             keep_records: bool, placement: dict | None, fence: LeaseFence | None,
             store_root: str) -> tuple[bool, CommittedStage | None]:
    """Execute and commit ``stage`` under the fence unless it is committed already; whether it computed, and what
    is committed (None where records are not kept)."""
    with hold_fence(store_root, fence):  # a driver that already lost its lease gets no work done either
        computed = not store.has(stage.key)
        if computed:
            # per-step progress stays in the worker, shown as its own periodic lines (Ray forwards a worker's output
            # to the driver's log); only summaries are worth the trip to the driver
            lines = ProgressReporter(enabled=False, line_interval_s=WORKER_LINE_INTERVAL_S)
            lines.follow(StageEvent(stage.key, stage.label, stage.kind, "started", 0, 0))

            def emit(record: Any) -> None:
                if isinstance(record, ProgressUpdate):
                    lines(record)
                elif keep_records:
                    records.append(record)

            # where the node ran goes into its manifest (a lost node's stage shows the survivor that redid it)
            where = {"node_id": node_id, "host": socket.gethostname(), "pid": os.getpid(), **(placement or {})}
            committed = execute_stage(stage, settings, store, emit, code_version=code_version, placement=where)
        else:
            committed = read_committed(store, stage.key) if keep_records else None
    return computed, committed


__all__ = ["NodeResult", "run_stage_in_worker"]

"""The engine: one scheduling loop (:func:`run_graph`) runs a graph of stage and matrix-entry nodes on a backend.

Backends: :class:`InProcessBackend` (``LocalExecutor``, ``compat run``, Tune trials, ``compat eval``) and the Ray
backend in :mod:`cluster.ray.task_backend` (one Ray task per node). Both run every node with
:func:`pipelines.stages.execute.execute_stage`. Nodes whose manifest is already committed are skipped, so a killed run
started again resumes where it stopped; after the last node :func:`finalize_run` writes the run's result files
(config.yaml is written first, then matrix.json, metrics.json) and the engine returns the typed result; the reports
(report.md, matrix.png, ...) are the caller's (:func:`pipelines.reports.run_report.write_store_reports`).
"""
from __future__ import annotations

import collections
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import yaml

from compat_core import io as cio
from pipelines.config.load import config_to_dict, dump_config, validate_config
from pipelines.config.local_paths import absolute_location
from pipelines.config.run_origin import RunOrigin, config_header
from pipelines.config.schema import ScenarioConfig
from pipelines.engine.events import StageEvent, StageRecord
from pipelines.engine.growth import growth_header, judge_growth, record_growth
from pipelines.engine.progress import ProgressReporter
from pipelines.graph.compile import Stage, StageGraph
from pipelines.graph.stage_kind import StageKind
from pipelines.records.stage_records import CommittedStage, read_committed
from pipelines.results.assemble import RunResult, assemble_matrix, write_result
from pipelines.stages.execute import execute_stage
from pipelines.stages.adapt import adapter_summaries
from pipelines.store.run_store import RunStore
from pipelines.store.shared_store import SharedStore
from pipelines.training.checkpoints import collect_committed
from pipelines.training.settings import precision_name

log = logging.getLogger(__name__)

SHARED_POLL_S = 2.0  # how often a run waiting for another run's third-party model looks for it (seconds)


@dataclass
class Invocation:
    """What one engine invocation did: node keys executed and skipped (already committed), seconds per node, and the
    run's :class:`RunResult` once the graph is complete (the record the tracker, reports and compare read)."""

    run_id: str
    executed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # includes the adopted ones
    adopted: list[str] = field(default_factory=list)  # copied from output.shared_store instead of computed
    published: list[str] = field(default_factory=list)  # computed here and published to output.shared_store
    seconds: dict[str, float] = field(default_factory=dict)
    result: RunResult | None = None  # what the engine emits to the tracker once every node is committed

    @property
    def matrix(self) -> dict | None:
        """The result's matrix as plain data (matrix.json's content), None until the graph is complete."""
        return None if self.result is None else self.result.matrix.to_dict()

    @property
    def metrics(self) -> dict | None:
        """The result's metrics.json document, None until the graph is complete."""
        return None if self.result is None else self.result.metrics


class Backend:
    """Where the engine's nodes run. ``submit`` starts one node (its parents are committed); ``wait`` blocks until
    one submitted node is committed and returns ``(key, records, committed)`` (records to replay to the emit
    callback; the node's CommittedStage, which the engine hands on with the "done" event), raising
    that node's error; with ``timeout`` (seconds) it may return None when none finished by then (backends that run
    nodes synchronously ignore it). ``close`` releases what the backend holds. ``slots``: nodes it runs at once
    (None: as many as are ready; Ray queues and places them)."""

    slots: int | None = None

    def submit(self, stage: Stage, graph: StageGraph, store: RunStore) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> tuple[str, list, CommittedStage] | None:  # pragma: no cover
        raise NotImplementedError

    def close(self) -> None:
        pass


class InProcessBackend(Backend):
    """Runs nodes one at a time in this process, in the graph's order (records go straight to ``emit``)."""

    slots = 1

    def __init__(self, emit: Callable[[Any], None]) -> None:
        self.emit = emit
        self.queue: collections.deque = collections.deque()

    def submit(self, stage: Stage, graph: StageGraph, store: RunStore) -> None:
        refuse_data_parallel([stage])
        self.queue.append((stage, graph, store))

    def wait(self, timeout: float | None = None) -> tuple[str, list, CommittedStage]:
        stage, graph, store = self.queue.popleft()
        return stage.key, [], execute_stage(stage, graph.settings, store, self.emit, code_version=graph.code_version)


def refuse_data_parallel(stages: Iterable[Stage]) -> None:
    """ValueError naming ``resources.<stage>.num_workers`` when a stage asks for more than one training worker."""
    for stage in stages:
        workers = stage.resources.num_workers
        if workers > 1:
            kind = stage.kind.config_section
            raise ValueError(f"resources.{kind}.num_workers = {workers}: data-parallel training runs on the Ray "
                             f"backend (compat run --executor ray); the in-process backend trains with one "
                             f"worker (set it to 1)")


def run_graph(graph: StageGraph, store: RunStore, backend: Backend, emit: Callable[[Any], None],
              until: Iterable[str] | None = None, stop_after: int | None = None) -> Invocation:
    """The one scheduling loop: submit every node whose parents are committed to ``backend``, wait for one, repeat.

    until: node keys; only they and their ancestors run (Tune trials stop at a row, ``compat eval`` runs only the
    entry nodes of another protocol). stop_after: submit at most this many nodes, then return (partial runs).
    Committed nodes are skipped (a killed run resumes). When every node of the graph is committed, the run's result
    files are written (:func:`finalize_run`), the RunResult is emitted and returned in ``Invocation.result``; the
    caller then writes the reports (:func:`pipelines.reports.run_report.write_store_reports`).
    """
    prepare_run(graph, store)
    schedule = _Schedule(graph, store, backend, emit, stop_after)
    schedule.scan(graph.ancestors(until) if until is not None else None)
    try:
        schedule.run()
    finally:
        backend.close()
        if schedule.shared is not None:
            schedule.shared.close()
    summary = schedule.summary
    if summary.executed:
        record_invocation(store, summary, graph)
        collect_committed(store)  # checkpoints of stages committed by a process that died before cleaning up
    if all(store.has(stage.key) for stage in graph):
        summary.result = finalize_run(graph, store)
        emit(summary.result)  # the tracker logs the run's results from it
    return summary


class _Schedule:
    """The state of one :func:`run_graph` call: nodes done, pending and started, and the shared store of
    third-party models (``output.shared_store``) that nodes may be adopted from or published to."""

    def __init__(self, graph: StageGraph, store: RunStore, backend: Backend, emit: Callable[[Any], None],
                 stop_after: int | None) -> None:
        self.graph, self.store, self.backend, self.emit, self.stop_after = graph, store, backend, emit, stop_after
        self.summary = Invocation(run_id=uuid.uuid4().hex[:12])
        self.index_of = {stage.key: index for index, stage in enumerate(graph)}
        self.total = len(graph)
        self.done: set[str] = set()
        self.pending: list[Stage] = []
        self.started: dict[str, float] = {}  # submitted node -> perf_counter at submission
        self.shared_root = graph.config.output.shared_store
        self.shared = SharedStore(self.shared_root) if self.shared_root else None

    def _event(self, stage: Stage, status: str, seconds: float | None = None,
               committed: CommittedStage | None = None) -> None:
        self.emit(StageEvent(stage.key, stage.label, stage.kind, status, self.index_of[stage.key], self.total,
                             seconds, committed))

    def _skip(self, stage: Stage) -> None:
        self.done.add(stage.key)
        self.summary.skipped.append(stage.key)
        # committed before this invocation: read once here, handed on like a "done" stage's record
        self._event(stage, "skipped", committed=read_committed(self.store, stage.key))

    def _adopted(self, stage: Stage) -> bool:
        if self.shared is None or not self.shared.covers(stage.kind) or not self.shared.adopt(stage.key, self.store):
            return False
        self.summary.adopted.append(stage.key)
        return True

    def scan(self, needed: set[str] | None) -> None:
        """Skip the committed (or adopted) nodes among ``needed`` (None: all), queue the others in graph order."""
        for stage in self.graph:
            if needed is not None and stage.key not in needed:
                continue
            if self.store.has(stage.key) or self._adopted(stage):
                self._skip(stage)
            else:
                self.pending.append(stage)

    def run(self) -> None:
        """Submit ready nodes and wait for one at a time until none is pending or ``stop_after`` is reached."""
        while self.pending or self.started:
            progressed, waiting_elsewhere = self._submit_ready()
            if not self.started:
                if waiting_elsewhere:
                    time.sleep(SHARED_POLL_S)
                if waiting_elsewhere or progressed:
                    continue
                break  # stop_after reached
            # while another run trains a model this run needs, look for it every SHARED_POLL_S seconds
            # instead of only when one of this run's own nodes finishes
            outcome = self._wait(timeout=SHARED_POLL_S if waiting_elsewhere else None)
            if outcome is not None:
                self._complete(*outcome)

    def _submit_ready(self) -> tuple[bool, bool]:
        """Submit the nodes whose parents are done (``first`` nodes first, graph order otherwise) as far as
        ``stop_after`` and the backend's slots allow. Returns (a node was adopted from the shared store, a node
        waits for another run that claimed it)."""
        progressed = waiting_elsewhere = False
        ready = [s for s in self.pending if all(p in self.done for p in s.parents)]
        for stage in sorted(ready, key=lambda s: not s.first):  # stable: graph order otherwise
            if self.stop_after is not None and len(self.summary.executed) + len(self.started) >= self.stop_after:
                break
            if self.backend.slots is not None and len(self.started) >= self.backend.slots:
                break
            if self.shared is not None and self.shared.covers(stage.kind):
                if self._adopted(stage):  # another run published it since the scan
                    self.pending.remove(stage)
                    self._skip(stage)
                    progressed = True
                    continue
                if not self.shared.claim(stage.key):  # another run is training it: adopt it when published
                    waiting_elsewhere = True
                    continue
            self.pending.remove(stage)
            self._event(stage, "started")
            self.started[stage.key] = time.perf_counter()
            self.backend.submit(stage, self.graph, self.store)
        return progressed, waiting_elsewhere

    def _wait(self, timeout: float | None) -> tuple[str, list, CommittedStage] | None:
        """The backend's next finished node (None at ``timeout``); a node's error is emitted as "failed", raised."""
        try:
            return self.backend.wait(timeout=timeout)
        except BaseException as error:
            failed = self.graph[getattr(error, "stage_key", None) or next(iter(self.started))]
            self._event(failed, "failed")
            raise

    def _complete(self, key: str, records: list, committed: CommittedStage) -> None:
        """Hand on a finished node's records and "done" event; publish it when the shared store covers it."""
        for record in records:
            self.emit(StageRecord(key, record))
        seconds = time.perf_counter() - self.started.pop(key)
        self.done.add(key)
        self.summary.executed.append(key)
        self.summary.seconds[key] = seconds
        stage = self.graph[key]
        self._event(stage, "done", seconds, committed)
        if self.shared is not None and self.shared.covers(stage.kind):
            try:
                if self.shared.publish(key, self.store):
                    self.summary.published.append(key)
            except Exception as error:  # the run keeps its own copy; another run then trains it itself
                log.warning("stage %s could not be published to the shared store %s: %s", key, self.shared_root,
                            error)


class Executor:
    """Runs every node of ``graph`` whose manifest is missing from ``store``; returns an Invocation."""

    def run(self, graph: StageGraph, store: RunStore, until: Iterable[str] | None = None) -> Invocation:
        raise NotImplementedError  # pragma: no cover - interface


class LocalExecutor(Executor):
    """The engine with the in-process backend: one node at a time in this process, with progress bars.

    emit: callback receiving every record (stage events, training records, progress); defaults to a tqdm
    ProgressReporter. stop_after: execute at most this many nodes, then return (tests, partial runs).
    """

    def __init__(self, emit: Callable[[Any], None] | None = None, progress: bool = True,
                 stop_after: int | None = None) -> None:
        self.emit = emit if emit is not None else ProgressReporter(enabled=progress)
        self.stop_after = stop_after

    def run(self, graph: StageGraph, store: RunStore, until: Iterable[str] | None = None) -> Invocation:
        try:
            refuse_data_parallel(graph)  # before any node computes
            return run_graph(graph, store, InProcessBackend(self.emit), self.emit, until, self.stop_after)
        finally:
            close_emit(self.emit)


def close_emit(emit: Any) -> None:
    close = getattr(emit, "close", None)
    if callable(close):
        close()


def recorded_config(config: ScenarioConfig, store: RunStore) -> ScenarioConfig:
    """``config`` as it runs in ``store``: ``output.dir`` is the run folder itself (absolute when local), whatever
    ``--output`` or the config's own ``output.dir`` said."""
    return config.model_copy(update={"output": config.output.model_copy(
        update={"dir": absolute_location(store.root)})})


def prepare_run(graph: StageGraph, store: RunStore) -> None:
    """Write config.yaml (:func:`recorded_config` under the header of :func:`config_header`); refuse a run folder
    that holds a different scenario. A folder whose config.yaml records this very run (same config, code version
    and precision) keeps it, so the header names the command that started the run. A config that grows the recorded
    run (appended tasks or replacements, every computed stage keeping its key: :func:`judge_growth`) is recorded
    under extensions/ and becomes the run's config.yaml; any other change is refused with the keys that differ."""
    config = recorded_config(graph.config, store)
    try:
        existing = store.read_text("config.yaml")
    except FileNotFoundError:
        existing = None
    if existing is not None:
        try:
            previous = validate_config(yaml.safe_load(existing), "config.yaml")
        except ValueError as error:
            raise ValueError(f"run directory {store.root}: its config.yaml no longer validates ({error}); use a new "
                             f"--output") from None
        growth = judge_growth(previous, config, graph.code_version, store.root)
        if growth is not None:
            record_growth(store, growth, graph.origin, graph.code_version)
    text = config_header(graph.origin, graph.code_version, precision_name(config.training.autocast),
                         config.output.dir) + growth_header(store) + dump_config(config)
    if existing is not None and _without_origin(existing) == _without_origin(text):
        return
    store.write_text("config.yaml", text)


def _without_origin(text: str) -> str:
    """config.yaml without its command and overrides lines (what differs between a run and its resumption)."""
    return "".join(line for line in text.splitlines(keepends=True)
                   if not line.startswith(("# command:", "# overrides:")))


def record_invocation(store: RunStore, summary: Invocation, graph: StageGraph) -> None:
    """One JSON file per executor invocation under executions/ (object stores cannot append to a log): the nodes it
    ran and skipped, seconds per node, its code version, precision, command line and overrides."""
    store.write_text(f"executions/{time.strftime('%Y%m%dT%H%M%S')}-{summary.run_id}.json", json.dumps({
        "run_id": summary.run_id, "executed": summary.executed, "skipped": summary.skipped,
        "seconds": summary.seconds, "code_version": graph.code_version,
        "precision": precision_name(graph.config.training.autocast), "compile": graph.config.training.compile,
        "channels_last": graph.config.training.channels_last,
        **(graph.origin or RunOrigin()).as_json()}, indent=1))


def read_invocations(store: RunStore) -> list[dict]:
    """Every invocation record of a run directory, oldest first."""
    folder = store.uri("executions")
    if not cio.is_dir(folder):
        return []
    return [json.loads(store.read_text(f"executions/{name}")) for name in cio.list_dir(folder)]


def finalize_run(graph: StageGraph, store: RunStore) -> RunResult:
    """Write the run's result files (matrix.json, metrics.json, adapters.json at replacements with adapters);
    returns them as a RunResult (the reports are the caller's: they render it)."""
    result = RunResult.of(assemble_matrix(graph, store), graph.config.evaluation.strict,
                          config_to_dict(recorded_config(graph.config, store)))
    write_result(store, result)
    if getattr(graph, "adapt_stages", None):  # adapters at replacements: report input
        store.write_text("adapters.json", json.dumps(adapter_summaries(graph, store), indent=2, allow_nan=False))
    return result

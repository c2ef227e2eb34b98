"""Evaluation actors: a pool of Ray actors computing compatibility-matrix entries from stored features.

Each entry ``C[row, column]`` (query features of model ``row`` against gallery features of model ``column``) is a
unit of work: the actor reads both feature sets from the run store by key, computes the value with the same
function the local executor uses (:func:`pipelines.stages.compute_entry`) and commits it under its own manifest
(``manifests/entry-rRRR-cCCC-<hash>.json``) before answering. So

- a killed actor loses nothing committed; Ray restarts it (``max_restarts``) and re-sends the unanswered calls
  (``max_task_retries``); the restarted actor restores its state from storage (it re-reads features by key);
- an entry found committed is answered from its manifest and never recomputed.

Only small dicts (key, value, seconds, pid) travel back to the driver; feature arrays never enter the Ray object
store or the driver.
"""
from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import ray

from pipelines.graph import Stage, StageGraph, entry_key
from pipelines.store import RunStore

# Defaults chosen for a transient failure (a node lost, an OOM kill): a few attempts, then the error surfaces.
DEFAULT_MAX_RESTARTS = 3
DEFAULT_MAX_TASK_RETRIES = 3


@dataclass(frozen=True)
class EntrySpec:
    """One matrix entry to compute. row/column: 0-based model indices (query model, gallery model).

    query_key / gallery_key: keys of the extract stages holding the features. query_classes / gallery_classes:
    active classes of the two models (used by training-free methods; 0 otherwise). protocol: evaluation protocol
    slice (metric, gallery, label_level, far, verification_pairs). row_gallery_keys: the gallery extract keys of
    columns 0..row, from which FAN adapters of tasks column+1..row are found (same as the local evaluate stage).
    """

    key: str
    row: int
    column: int
    query_key: str
    gallery_key: str
    protocol: dict
    query_classes: int = 0
    gallery_classes: int = 0
    row_gallery_keys: tuple[str, ...] = ()


def entries_of_row(stage: Stage, store: RunStore) -> list[EntrySpec]:
    """Entry specs ``C[t, 0..t]`` of an evaluate stage (row t), in column order; its parents must be committed."""
    if stage.kind != "evaluate":
        raise ValueError(f"stage {stage.label}: expected an evaluate stage, got kind {stage.kind!r}")
    row = int(stage.task)
    protocol = stage.params["protocol"]
    query_key, gallery_keys = stage.parents[0], stage.parents[1:]
    query_classes = int(store.load_record(query_key).get("num_classes_model") or 0)
    specs = []
    for column, gallery_key in enumerate(gallery_keys):
        gallery_classes = int(store.load_record(gallery_key).get("num_classes_model") or 0)
        specs.append(EntrySpec(entry_key(query_key, gallery_key, protocol, row, column), row, column, query_key,
                               gallery_key, protocol, query_classes, gallery_classes, tuple(gallery_keys)))
    return specs


def matrix_entries(graph: StageGraph, store: RunStore) -> list[EntrySpec]:
    """Every entry of the graph's matrix (T(T+1)/2 specs, row-major); every extract stage must be committed."""
    return [spec for key in graph.evaluate_stages for spec in entries_of_row(graph[key], store)]


class EvaluationWorker:
    """Body of an evaluation actor (wrapped with ``ray.remote`` by :class:`EvaluationPool`).

    store_root: run directory (absolute local path or s3:// URI). config: the ScenarioConfig (metric settings,
    method for training-free projections, seed). num_threads: torch threads, the actor's CPU share.
    cache_items: feature sets kept in memory between calls (a row's query is reused across its columns).
    setup: optional callable run once when the actor starts (and again after a restart).
    """

    def __init__(self, store_root: str, config: Any, num_threads: int = 1, cache_items: int = 4,
                 setup: Callable[[], None] | None = None) -> None:
        import torch

        torch.set_num_threads(max(1, int(num_threads)))
        if setup is not None:
            setup()
        self.store = RunStore(store_root)
        self.config = config
        self.cache_items = max(1, int(cache_items))
        self._cache: collections.OrderedDict[str, tuple] = collections.OrderedDict()
        self.started = time.time()

    def _features(self, stage_key: str) -> tuple:
        from pipelines.store import read_features

        if stage_key in self._cache:
            self._cache.move_to_end(stage_key)
            return self._cache[stage_key]
        features = read_features(self.store, stage_key)
        self._cache[stage_key] = features
        while len(self._cache) > self.cache_items:
            self._cache.popitem(last=False)
        return features

    def compute(self, spec: EntrySpec) -> dict:
        """Compute, commit and return ``{"key", "row", "column", "value", "computed", "seconds", "pid"}``.

        value: the entry as a fraction in [0, 1]; computed: False when the entry was already committed.
        """
        from pipelines.stages import compute_entry, entry_adapters

        started = time.perf_counter()
        if self.store.has(spec.key):
            value = float(self.store.load_record(spec.key)["value"])
            return {"key": spec.key, "row": spec.row, "column": spec.column, "value": value, "computed": False,
                    "seconds": time.perf_counter() - started, "pid": os.getpid()}
        query = self._features(spec.query_key)
        gallery = self._features(spec.gallery_key)
        adapters = entry_adapters(self.store, [self.store.load_record(key) for key in spec.row_gallery_keys],
                                  spec.row, spec.column) if spec.row_gallery_keys else None
        value = compute_entry(query, gallery, spec.protocol, self.config, spec.query_classes, spec.gallery_classes,
                              adapters=adapters)
        # the same record the local executor's evaluate stage commits, so both executors share entries
        self.store.commit(spec.key, {"type": "entry", "row": spec.row, "column": spec.column, "value": value,
                                     "query": spec.query_key, "gallery": spec.gallery_key,
                                     "protocol": spec.protocol})
        return {"key": spec.key, "row": spec.row, "column": spec.column, "value": float(value), "computed": True,
                "seconds": time.perf_counter() - started, "pid": os.getpid()}

    def pid(self) -> int:
        return os.getpid()


class EvaluationPool:
    """A fixed number of evaluation actors; entries are dispatched to the least busy actor.

    size: number of actors (>= 1). num_cpus / num_gpus / memory (bytes): what each actor reserves; torch threads =
    floor(num_cpus) (at least 1). max_in_flight: calls queued per actor (2 keeps an actor busy while the driver
    handles an answer). The pool does its own dispatch (instead of ``ray.util.ActorPool``) so that the Ray executor
    can wait on entries and stage results with one ``ray.wait``.
    """

    def __init__(self, store_root: str, config: Any, size: int, num_cpus: float = 1.0, num_gpus: float = 0.0,
                 memory: int | None = None, max_restarts: int = DEFAULT_MAX_RESTARTS,
                 max_task_retries: int = DEFAULT_MAX_TASK_RETRIES, max_in_flight: int = 2,
                 setup: Callable[[], None] | None = None) -> None:
        if int(size) < 1:
            raise ValueError(f"evaluation pool size: expected >= 1 actors, got {size}")
        if num_cpus <= 0:
            raise ValueError(f"evaluation actor num_cpus: expected > 0, got {num_cpus}")
        options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_restarts": max_restarts,
                                   "max_task_retries": max_task_retries}
        if memory:
            options["memory"] = int(memory)
        remote_class = ray.remote(EvaluationWorker)
        threads = max(1, int(num_cpus))
        self.actors = [remote_class.options(**options).remote(store_root, config, threads, 4, setup)
                       for _ in range(int(size))]
        self.max_in_flight = max(1, int(max_in_flight))
        self._queue: collections.deque[EntrySpec] = collections.deque()
        self._in_flight: dict[ray.ObjectRef, tuple[int, EntrySpec]] = {}
        self._load = [0] * len(self.actors)

    @property
    def size(self) -> int:
        return len(self.actors)

    def submit(self, specs: Iterable[EntrySpec]) -> None:
        """Queue entries; they are sent to actors as capacity frees up (see :meth:`pending_refs`)."""
        self._queue.extend(specs)
        self._dispatch()

    def _dispatch(self) -> None:
        while self._queue:
            index = min(range(len(self.actors)), key=self._load.__getitem__)
            if self._load[index] >= self.max_in_flight:
                return
            spec = self._queue.popleft()
            ref = self.actors[index].compute.remote(spec)
            self._in_flight[ref] = (index, spec)
            self._load[index] += 1

    def pending_refs(self) -> list[ray.ObjectRef]:
        """Object refs of the calls in flight (to pass to ``ray.wait``)."""
        return list(self._in_flight)

    def owns(self, ref: ray.ObjectRef) -> bool:
        return ref in self._in_flight

    def complete(self, ref: ray.ObjectRef) -> dict:
        """Result of a finished call (raises the actor's error after its retries), then refill the actors."""
        index, spec = self._in_flight.pop(ref)
        self._load[index] -= 1
        try:
            return ray.get(ref)
        finally:
            self._dispatch()

    @property
    def busy(self) -> bool:
        return bool(self._queue or self._in_flight)

    def compute_all(self, specs: Iterable[EntrySpec], on_result: Callable[[dict], None] | None = None) -> list[dict]:
        """Compute every spec (in parallel over the actors); results in completion order."""
        self.submit(specs)
        results = []
        while self._in_flight:
            ready, _ = ray.wait(self.pending_refs(), num_returns=1)
            result = self.complete(ready[0])
            results.append(result)
            if on_result is not None:
                on_result(result)
        return results

    def shutdown(self) -> None:
        """Kill the actors (their committed entries stay in the store)."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []


def default_pool_size(config: Any, num_entries: int, cluster_cpus: float, cpus_per_actor: float) -> int:
    """``resources.evaluation_actors`` when set, else as many actors as the cluster's CPUs allow (>= 1), never more
    than there are entries to compute."""
    configured = getattr(config.resources, "evaluation_actors", None)
    if configured:
        return max(1, min(int(configured), max(num_entries, 1)))
    fit = int(cluster_cpus // max(cpus_per_actor, 1e-9))
    return max(1, min(fit, max(num_entries, 1)))


__all__ = ["EntrySpec", "EvaluationWorker", "EvaluationPool", "entries_of_row", "matrix_entries",
           "default_pool_size", "DEFAULT_MAX_RESTARTS", "DEFAULT_MAX_TASK_RETRIES"]

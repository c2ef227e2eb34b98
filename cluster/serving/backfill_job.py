"""``compat index backfill``: re-embed a served gallery with a new model version in the background.

Items embedded by other versions are re-embedded in chunks (order: ``compat_core.upgrades.backfill_order.backfill_order``) by Ray
tasks (the pipeline's extraction, ``pipelines.stages.execute.extract_pool_features``, on the chunk's images with the
indexed pool's normalisation); the driver writes each chunk as a new shard and commits a manifest listing it, one
HEAD swap per chunk, so the service (which polls HEAD) flips that chunk's items to the new version at once. After
every chunk a probe, the config's evaluation query set embedded by the new version, is searched exactly as the
service searches (``compat_core.retrieval.mixed_gallery``, with the adapter the gate installed) and its Recall@1 is logged
to MLflow (experiment ``compat-backfill``) against the fraction re-embedded (step = per mille).

An index with an approximate structure (``--kind ivf | hnsw | ivfpq``) gets a second structure of the same kind
over the rows the new version holds, rebuilt with each chunk and committed in the same manifest as the chunk's
rows (its search effort chosen by the same Recall@1-of-exact rule, target and sample size as the first one, on
the config's evaluation query set embedded by the new version): the old structure keeps serving the rows not
yet re-embedded (the others masked in it), the new one the re-embedded rows. When no row of the old structure's
version is left, the new structure becomes the index's "search" entry and the old one is dropped from the manifest.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from cluster.model_registry.versions import MlflowModelResolver
from cluster.serving.index_build import AnnSettings, build_search_entry, evaluation_labels, pool_of
from cluster.serving.index_store import (commit_manifest, load_index, read_manifest, search_entry, shard_table,
                                         write_shard)
from cluster.serving.models import DEFAULT_ALIAS, installed_adapter, load_served_model, resolve_model_ref
from cluster.serving.ray_join import connect_ray
from cluster.serving.state import build_state
from cluster.tracking.client import ensure_experiment
from compat_core.data.source import ArraySource
from compat_core.retrieval.mixed_gallery import search_groups
from compat_core.upgrades.backfill_order import backfill_order
from pipelines.config.model_uri import ModelUri, parse_model_uri
from pipelines.config.schema import PoolSpec
from pipelines.stages.extraction import extract_pool_features
from pipelines.stages.pools import load_pool

EXPERIMENT = "compat-backfill"


__all__ = ["run_backfill", "probe_recall_at_1", "EXPERIMENT"]


def _embed_chunk(model_uri: ModelUri, tracking_uri: str, cache_dir: str | None, config: Any, images: np.ndarray,
                 mean: list, std: list) -> np.ndarray:
    """Ray task body: features of ``images`` by ``model_uri`` (a pinned models:/NAME/VERSION)."""
    import torch

    resolver = MlflowModelResolver(tracking_uri, cache_dir=cache_dir)
    model = load_served_model(resolver, model_uri, "cpu")
    source = ArraySource("backfill-chunk", images, np.zeros(len(images), dtype=np.int64), ["item"],
                         mean=tuple(mean), std=tuple(std), hflip=False)
    torch.set_num_threads(1)
    return extract_pool_features(model, source, config, torch.device("cpu"))


def probe_recall_at_1(index, query: np.ndarray, query_labels: np.ndarray, served_version: str,
                      adapter: tuple | None, precision: str = "auto") -> float:
    """Recall@1 (fraction) of ``query`` (embedded by ``served_version``) on ``index`` searched like the service."""
    if index.labels is None:
        raise ValueError("probe: the index has no labels; build it from a labelled pool")
    state = build_state(ModelUri("probe", served_version), None, index, adapter, precision)
    positions, _, _ = search_groups(query, state.groups, 1)
    return float(np.mean(index.labels[positions[:, 0]] == np.asarray(query_labels)))


def run_backfill(root: str, config: Any, model_uri: str, tracking_uri: str, chunk_rows: int = 256,
                 order: str = "random", seed: int = 0, probe: bool = True, ray_address: str | None = None,
                 cache_dir: str | None = None, in_flight: int = 2, log: Callable[[str], None] = print,
                 ray_token_file: str | None = None) -> dict:
    """Re-embed every item of ``root`` not embedded by the version behind ``model_uri``; returns a summary
    (fractions, probe Recall@1 per chunk, MLflow run id, done)."""
    import ray

    if chunk_rows < 1:
        raise ValueError(f"--chunk-rows: expected a positive number of items, got {chunk_rows}")
    if order != "random":
        raise ValueError(f"--order {order!r}: the backfill supports 'random' (seeded)")
    connect_ray(ray_address, ray_token_file)  # before anything is recorded: a cluster out of reach leaves no run
    log(f"backfill: chunks re-embedded as Ray tasks on Ray cluster {ray.get_runtime_context().gcs_address}")
    resolver = MlflowModelResolver(tracking_uri, cache_dir=cache_dir)
    client = resolver.client
    requested = parse_model_uri(model_uri, "--model")
    ref = resolve_model_ref(client, requested)
    head, manifest, index, pool = _open_index(root)
    permutation = backfill_order(index.size, order, seed)
    todo = permutation[index.versions[permutation] != ref.version]
    chunks = [np.sort(todo[start:start + chunk_rows]) for start in range(0, todo.size, chunk_rows)]
    adapter = installed_adapter(client, ref, requested.alias or DEFAULT_ALIAS)
    approximate = search_entry(manifest)["kind"] != "flat"
    queries = _probe_queries(resolver, ref, config) if probe or approximate else None
    probe_set = (*queries, adapter) if probe else None
    structure = _BackfillStructure(root, search_entry(manifest), queries[0].numpy(), ref.version, log) \
        if approximate else None
    run = client.create_run(ensure_experiment(client, EXPERIMENT), run_name=f"backfill-{ref.name}-v{ref.version}",
                            tags={"run_role": "backfill", "registered_model": ref.name, "target_version": ref.version,
                                  "index_root": root, "order": order, "start_manifest": head})
    summary = {"run_id": run.info.run_id, "target_version": ref.version, "items": index.size,
               "to_re_embed": int(todo.size), "chunks": len(chunks), "fraction": [], "probe_recall_at_1": [],
               "done": False}
    record = _ProgressLog(client, run.info.run_id, ref.version, summary, log, probe_set)
    record(index, 0)
    task = ray.remote(num_cpus=1, max_retries=2)(_embed_chunk)
    image = manifest["image"]

    def embed(positions: np.ndarray):
        return task.remote(ref, tracking_uri, cache_dir, config, pool.read(positions), image["mean"], image["std"])

    try:
        head = _re_embed_chunks(root, head, index, chunks, embed, record, ref.version, run.info.run_id,
                                int(todo.size), in_flight, structure)
        summary["done"] = True
        summary["manifest"] = head
    finally:
        client.set_terminated(run.info.run_id, "FINISHED" if summary["done"] else "FAILED")
    return summary


def _open_index(root: str):
    """(HEAD, its manifest, the index, the pool its items were embedded from) of a served gallery."""
    head, manifest = read_manifest(root)
    index = load_index(root, head)
    if not manifest.get("pool"):
        raise ValueError(f"{root}: the manifest names no pool to re-embed from")
    pool = load_pool(PoolSpec(**manifest["pool"]), "index manifest pool")
    if len(pool) != index.size:
        raise ValueError(f"{root}: the manifest's pool has {len(pool)} images, the index {index.size} items")
    return head, manifest, index, pool


def _probe_queries(resolver: MlflowModelResolver, ref: ModelUri, config: Any) -> tuple[Any, np.ndarray]:
    """The config's evaluation query set embedded by the target version, and its labels (the probe)."""
    import torch

    _, query_pool = pool_of(config, "query")
    model = load_served_model(resolver, ref, "cpu")
    query = torch.from_numpy(extract_pool_features(model, query_pool, config, torch.device("cpu")))
    return query, evaluation_labels(config, query_pool)


class _ProgressLog:
    """After each chunk: the fraction of items embedded by the target version (and the probe's Recall@1, when a
    probe set ``(query, labels, adapter)`` is given) to MLflow (step = per mille), the summary and ``log``."""

    def __init__(self, client: Any, run_id: str, version: str, summary: dict, log: Callable[[str], None],
                 probe_set: tuple | None) -> None:
        self.client, self.run_id, self.version, self.summary, self.log = client, run_id, version, summary, log
        self.probe_set = probe_set

    def __call__(self, current_index, done_items: int) -> None:
        from mlflow.entities import Metric

        fraction = float(np.mean(current_index.versions == self.version))
        metrics = [Metric("backfill/fraction", fraction, int(time.time() * 1000), int(round(1000 * fraction))),
                   Metric("backfill/items_done", float(done_items), int(time.time() * 1000),
                          int(round(1000 * fraction)))]
        self.summary["fraction"].append(fraction)
        if self.probe_set is not None:
            query, query_labels, adapter = self.probe_set
            value = probe_recall_at_1(current_index, query, query_labels, self.version, adapter)
            self.summary["probe_recall_at_1"].append(value)
            metrics.append(Metric("probe/recall_at_1", value, int(time.time() * 1000), int(round(1000 * fraction))))
        self.client.log_batch(self.run_id, metrics=metrics, synchronous=True)
        self.log(f"backfill: {fraction:.1%} embedded by v{self.version}"
                 + (f", probe Recall@1 {self.summary['probe_recall_at_1'][-1]:.4f}" if self.probe_set else ""))


class _BackfillStructure:
    """The manifest's search entries after a chunk: a structure of the old one's kind over the rows the target
    version holds then ("search_backfill"), or, once it holds every row, that structure as "search" (the old
    one retired). held_out: (Nq, D) query rows embedded by the target version, for the effort's recall rule."""

    def __init__(self, root: str, old_entry: dict, held_out: np.ndarray, version: str,
                 log: Callable[[str], None]) -> None:
        sample = old_entry.get("sample") or {}
        self.settings = AnnSettings(old_entry["kind"], float(old_entry.get("recall_target", 0.99)),
                                    int(sample.get("size", 1000)), int(sample.get("seed", 0)))
        self.root, self.held_out, self.version, self.log = root, held_out, version, log

    def entries(self, embeddings: np.ndarray, versions: np.ndarray) -> dict:
        """{"search": ..., "search_backfill": ... or None} for the gallery ``embeddings`` (N, D) / ``versions``."""
        rows = np.flatnonzero(versions == self.version)
        entry = build_search_entry(self.root, embeddings[rows], self.held_out, self.settings, self.version,
                                   "query", self.log)
        if rows.size == versions.size:
            return {"search": entry, "search_backfill": None}
        return {"search_backfill": entry}


def _chunk_manifest(current: dict, parent: str, shard: dict, searches: dict, backfill: dict) -> dict:
    """The manifest that flips one chunk: ``current`` (the manifest at HEAD ``parent``) listing the chunk's
    ``shard`` last, with the search entries of :meth:`_BackfillStructure.entries` ("search_backfill": None drops
    it) and the backfill's progress."""
    updated = {**current, **searches, "shards": current["shards"] + [shard], "parent": parent,
               "created_unix": time.time(), "backfill": backfill}
    return {key: value for key, value in updated.items() if not (key == "search_backfill" and value is None)}


def _re_embed_chunks(root: str, head: str, index, chunks: list[np.ndarray], embed: Callable[[np.ndarray], Any],
                     record: _ProgressLog, version: str, run_id: str, total: int, in_flight: int,
                     structure: _BackfillStructure | None = None) -> str:
    """Re-embed ``chunks`` (``embed(positions)`` starts a Ray task; at most ``in_flight`` run at once) and commit
    each finished one as a new shard, one HEAD swap per chunk (with the new version's structure when
    ``structure`` is given); returns the last HEAD."""
    import ray

    pending: dict[Any, np.ndarray] = {}
    next_chunk, done_items = 0, 0
    while next_chunk < len(chunks) or pending:
        while next_chunk < len(chunks) and len(pending) < in_flight:
            positions = chunks[next_chunk]
            pending[embed(positions)] = positions
            next_chunk += 1
        ready, _ = ray.wait(list(pending), num_returns=1)
        positions = pending.pop(ready[0])
        features = ray.get(ready[0])
        entry = write_shard(root, shard_table(positions, index.item_ids[positions], features, version,
                                              index.payload_uris[positions],
                                              index.labels[positions] if index.labels is not None else None))
        searches = {}
        if structure is not None:
            embeddings, versions = index.embeddings.copy(), index.versions.copy()
            embeddings[positions], versions[positions] = features, version
            searches = structure.entries(embeddings, versions)
        head_now, current = read_manifest(root)
        done_items += positions.size
        updated = _chunk_manifest(current, head_now, entry, searches,
                                  {"target_version": version, "run_id": run_id, "done": done_items, "total": total})
        head = commit_manifest(root, updated, expected_head=head_now)   # the chunk's atomic flip
        index = load_index(root, head)
        record(index, done_items)
    return head

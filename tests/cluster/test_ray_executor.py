"""Ray executor and evaluation actors on the shared local Ray instance (fixture ``ray_local``), tiny scenario."""
from __future__ import annotations

import json
import pickle
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))
import tiny_scenario_helpers as tiny  # noqa: E402

from pipelines.config import validate_config  # noqa: E402
from pipelines.executor import LocalExecutor  # noqa: E402
from pipelines.graph import compile_scenario  # noqa: E402
from pipelines.store import RunStore, feature_blobs  # noqa: E402


def _slow_entries_setup():
    """Actor setup for the kill test: every entry takes >= 0.4 s, so a kill lands while entries are in flight."""
    import time as _time

    import pipelines.stages as stages

    tiny.register()
    original = stages.compute_entry
    if getattr(original, "_slowed", False):
        return

    def slowed(*args, **kwargs):
        _time.sleep(0.4)
        return original(*args, **kwargs)

    slowed._slowed = True
    stages.compute_entry = slowed


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory, ray_local):
    """The tiny scenario run by the LocalExecutor (1 torch thread) and by the RayExecutor (1-CPU actors)."""
    import ray

    from cluster.ray_executor import RayExecutor

    tiny.register()
    # the helper module lives outside the package: ship it to the actors by value
    ray.cloudpickle.register_pickle_by_value(tiny)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # for _slow_entries_setup
    torch.set_num_threads(1)
    local_dir = tmp_path_factory.mktemp("local")
    config = validate_config(tiny.scenario("dsimplex-hoc", output=str(local_dir)))
    graph = compile_scenario(config)
    LocalExecutor(progress=False).run(graph, RunStore(local_dir))
    ray_dir = tmp_path_factory.mktemp("ray")
    events = []
    executor = RayExecutor(emit=events.append, setup=tiny.register)
    summary = executor.run(graph, RunStore(ray_dir))
    return {"graph": graph, "config": config, "local": local_dir, "ray": ray_dir, "summary": summary,
            "executor": executor, "events": events}


def test_ray_executor_matches_local_executor(tiny_runs):
    local, remote, graph = tiny_runs["local"], tiny_runs["ray"], tiny_runs["graph"]
    for name in ("matrix.json", "metrics.json"):
        assert json.loads((remote / name).read_text()) == json.loads((local / name).read_text()), name
    store = RunStore(remote)
    assert all(store.has(stage.key) for stage in graph)
    assert sorted(tiny_runs["summary"].executed) == sorted(stage.key for stage in graph)
    # T = 3: rows hold 1, 2, 3 entries, all computed by evaluation actors in this run
    rows = [store.load_record(key) for key in graph.evaluate_stages]
    assert [r["computed_entries"] for r in rows] == [1, 2, 3]
    assert [r["reused_entries"] for r in rows] == [0, 0, 0]
    assert sum(k.startswith("entry-") for k in store.stage_keys()) == 6
    statuses = [e.status for e in tiny_runs["events"] if hasattr(e, "status")]
    assert statuses.count("done") == len(graph) and statuses.count("started") == len(graph)


def test_results_crossing_ray_are_small(tiny_runs):
    stats = tiny_runs["executor"].last_stats
    # every object a stage or entry returned to the driver (keys, per-epoch summaries), pickled: a few KB at most,
    # while one model of this scenario is larger (cnn4 width 4 + K-1 = 9 junction) and features are never returned
    assert 0 < stats["largest_result_bytes"] < 8 * 1024
    assert stats["evaluation_actors_created"] >= 1
    assert stats["stage_actors_created"] >= 1


def test_rerun_skips_every_committed_stage(tiny_runs):
    from cluster.ray_executor import RayExecutor

    executor = RayExecutor(progress=False, setup=tiny.register)
    again = executor.run(tiny_runs["graph"], RunStore(tiny_runs["ray"]))
    assert again.executed == [] and len(again.skipped) == len(tiny_runs["graph"])
    assert executor.last_stats["stage_actors_created"] == 0 and executor.last_stats["evaluation_actors_created"] == 0


def test_killed_evaluation_actor_loses_nothing_committed(tiny_runs, ray_local):
    import ray

    from cluster.eval_actors import EvaluationPool, matrix_entries

    graph, run_dir = tiny_runs["graph"], tiny_runs["ray"]
    store = RunStore(run_dir)
    reference = json.loads((tiny_runs["local"] / "matrix.json").read_text())["values"]
    specs = matrix_entries(graph, store)
    assert len(specs) == 6
    manifests = run_dir / "manifests"
    # keep C[0,0], C[1,0], C[1,1] committed; C[2,0..2] must be recomputed
    missing = {spec.key for spec in specs if spec.row == 2}
    for key in missing:
        (manifests / f"{key}.json").unlink()
    kept_mtimes = {spec.key: (manifests / f"{spec.key}.json").stat().st_mtime_ns
                   for spec in specs if spec.key not in missing}

    pool = EvaluationPool(store.base, tiny_runs["config"], size=1, max_in_flight=6, setup=_slow_entries_setup)
    try:
        first_pid = ray.get(pool.actors[0].pid.remote())
        pool.submit(specs)
        results, killed, committed_at_kill = [], False, {}
        while pool.busy:
            ready, _ = ray.wait(pool.pending_refs(), num_returns=1)
            result = pool.complete(ready[0])
            results.append(result)
            if result["computed"] and not killed:
                # the first entry computed in this pass: kill the actor while the others are queued or running
                committed_at_kill = {k: (manifests / f"{k}.json").stat().st_mtime_ns
                                     for k in missing if (manifests / f"{k}.json").exists()}
                ray.kill(pool.actors[0], no_restart=False)
                killed = True
        second_pid = ray.get(pool.actors[0].pid.remote())
    finally:
        pool.shutdown()

    assert second_pid != first_pid  # the actor really died and was restarted by Ray
    assert killed
    assert len(committed_at_kill) < len(missing)  # the kill landed before row 2 was complete
    by_key = {r["key"]: r for r in results}
    assert set(by_key) == {spec.key for spec in specs}
    for key, mtime in kept_mtimes.items():
        assert not by_key[key]["computed"]
        assert (manifests / f"{key}.json").stat().st_mtime_ns == mtime  # not rewritten
    for key, mtime in committed_at_kill.items():
        assert (manifests / f"{key}.json").stat().st_mtime_ns == mtime  # committed before the kill: not recomputed
    assert all((manifests / f"{key}.json").exists() for key in missing)
    assert {r["pid"] for r in results if r["key"] in missing and r["key"] not in committed_at_kill} == {second_pid}
    for spec in specs:
        assert by_key[spec.key]["value"] == pytest.approx(reference[spec.row][spec.column], abs=1e-12)


def _synthetic_store(root: Path, T: int, rows: int, dim: int, seed: int):
    """T models' query/gallery features (fp16, as extract stages store them) committed under fake extract keys."""
    from cluster.eval_actors import EntrySpec
    from pipelines.graph import entry_key

    rng = np.random.default_rng(seed)
    store = RunStore(root)
    labels = np.repeat(np.arange(rows // 10), 10)
    arrays = {}
    for t in range(T):
        for split in ("query", "gallery"):
            key = f"extract-t{t:03d}-{split}-{seed:016d}"
            centres = np.random.default_rng(100 + t).normal(size=(rows // 10, dim))
            features = (centres[labels] + rng.normal(scale=1.5, size=(rows, dim))).astype(np.float16)
            blobs, layout = feature_blobs(features, labels)
            store.commit(key, {"type": "features", "layout": layout, "num_classes_model": 0}, blobs)
            arrays[(t, split)] = features
    protocol = {"metric": "recall_at_1", "gallery": "instances", "label_level": "fine", "far": 0.001,
                "verification_pairs": 1000}
    specs = []
    for row in range(T):
        for column in range(row + 1):
            q, g = f"extract-t{row:03d}-query-{seed:016d}", f"extract-t{column:03d}-gallery-{seed:016d}"
            specs.append(EntrySpec(entry_key(q, g, protocol, row, column), row, column, q, g, protocol))
    feature_bytes = sum(a.nbytes for a in arrays.values())
    return store, specs, arrays, labels, feature_bytes


def test_driver_memory_stays_flat_as_T_grows(tmp_path, ray_local, monkeypatch):
    """What is measured: the driver's Python heap peak (tracemalloc, which tracks numpy buffers) while the pool
    evaluates T=2 and T=6 matrices whose stored features are 1.5 MB and 4.6 MB, plus the pickled size of every
    result; and the driver is forbidden to read features at all (read_features raises in this process only)."""
    import pipelines.store as store_module
    from cluster.eval_actors import EvaluationPool

    config = validate_config(tiny.scenario("dsimplex-hoc", output=str(tmp_path)))

    def forbidden(*args, **kwargs):
        raise AssertionError("the driver must not read feature arrays")

    peaks, largest, sizes = {}, {}, {}
    for T in (2, 6):
        store, specs, arrays, labels, feature_bytes = _synthetic_store(tmp_path / f"t{T}", T, 2000, 95, seed=T)
        monkeypatch.setattr(store_module, "read_features", forbidden)
        pool = EvaluationPool(store.base, config, size=2)
        try:
            tracemalloc.start()
            results = pool.compute_all(specs)
            peaks[T] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        finally:
            pool.shutdown()
            monkeypatch.undo()
        largest[T] = max(len(pickle.dumps(r)) for r in results)
        assert len(results) == T * (T + 1) // 2
        # values against an fp64 brute force (cosine, argmax over the gallery; ties impossible with noise)
        for result in results:
            q = arrays[(result["row"], "query")].astype(np.float64)
            g = arrays[(result["column"], "gallery")].astype(np.float64)
            q /= np.linalg.norm(q, axis=1, keepdims=True)
            g /= np.linalg.norm(g, axis=1, keepdims=True)
            expected = float(np.mean(labels[np.argmax(q @ g.T, axis=1)] == labels))
            assert result["value"] == pytest.approx(expected, abs=1e-12)
        assert feature_bytes == 2 * T * 2000 * 95 * 2  # fp16: 1.5 MB at T=2, 4.6 MB at T=6
        sizes[T] = feature_bytes
    assert largest[2] < 1024 and largest[6] < 1024
    # the stored features triple from T=2 to T=6 (+3 MB); the driver's peak (about 1 MB of Ray client
    # bookkeeping, measured) must not follow them
    assert sizes[6] - sizes[2] > 3_000_000
    assert peaks[6] < 2 * 1024 * 1024, peaks
    assert peaks[6] - peaks[2] < 256 * 1024, peaks


def test_fan_entries_on_ray_apply_the_stored_adapters_like_the_local_executor(tmp_path, ray_local):
    """FAN maps older gallery features through the adapters of later tasks; evaluation actors must do the same."""
    import ray

    from cluster.ray_executor import RayExecutor

    tiny.register()
    ray.cloudpickle.register_pickle_by_value(tiny)
    torch.set_num_threads(1)
    config = validate_config(tiny.scenario("fan", output=str(tmp_path / "local")))
    graph = compile_scenario(config)
    LocalExecutor(progress=False).run(graph, RunStore(tmp_path / "local"))
    RayExecutor(progress=False, setup=tiny.register).run(graph, RunStore(tmp_path / "ray"))
    local = json.loads((tmp_path / "local" / "matrix.json").read_text())
    remote = json.loads((tmp_path / "ray" / "matrix.json").read_text())
    assert remote == local
    # the adapters really were used: at least one model carries one, so cross-tests go through it
    assert any(RunStore(tmp_path / "ray").load_record(key).get("adapter_blob") for key in graph.extract_stages.values())

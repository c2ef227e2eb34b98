"""The engine's Ray backend (one task per node) on the shared local Ray instance (fixture ``ray_local``), tiny scenario."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))
import tiny_scenario_helpers as tiny  # noqa: E402

from pipelines.config.load import validate_config  # noqa: E402
from pipelines.engine.runner import LocalExecutor  # noqa: E402
from pipelines.graph.compile import compile_scenario  # noqa: E402
from pipelines.methods import METHODS  # noqa: E402
from pipelines.store.run_store import RunStore  # noqa: E402


def _crash_once_setup(marker: str):
    """Worker setup for the failure test: the first entry computed anywhere kills its worker process (os._exit),
    once; Ray must retry that task on another worker."""
    def setup():
        import os as _os

        import pipelines.stages.bridge_features as bridge_features

        tiny.register()
        original = bridge_features.entry_metric
        if getattr(original, "_crashing", False):
            return

        def crashing(*args, **kwargs):
            if not _os.path.exists(marker):
                open(marker, "w").close()
                _os._exit(1)
            return original(*args, **kwargs)

        crashing._crashing = True
        bridge_features.entry_metric = crashing
    return setup


def _naming_setup(folder: str):
    """Worker setup that records the name Ray gives the running task (one file per task; issue 12, item 12)."""
    def setup():
        import uuid

        import ray

        tiny.register()
        Path(folder, uuid.uuid4().hex).write_text(ray.get_runtime_context().get_task_name() or "")

    return setup


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory, ray_local):
    """The tiny scenario run by the LocalExecutor (1 torch thread) and by the RayExecutor (1-CPU actors)."""
    import ray

    from cluster.ray.task_backend import RayExecutor

    tiny.register()
    # the helper module lives outside the package: ship it to the workers by value
    ray.cloudpickle.register_pickle_by_value(tiny)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # for _crash_once_setup
    torch.set_num_threads(1)
    local_dir = tmp_path_factory.mktemp("local")
    document = tiny.scenario("dsimplex-hoc", output=str(local_dir))
    # training nodes in worker processes of their own (the knob a large CPU job sets; GPU nodes get it by default)
    document["resources"] = {"pretrain": {"own_process": True}, "finetune": {"own_process": True}}
    config = validate_config(document)
    graph = compile_scenario(config)
    LocalExecutor(progress=False).run(graph, RunStore(local_dir))
    ray_dir = tmp_path_factory.mktemp("ray")
    events = []
    task_names = tmp_path_factory.mktemp("task-names")
    executor = RayExecutor(emit=events.append, setup=_naming_setup(str(task_names)))
    summary = executor.run(graph, RunStore(ray_dir))
    return {"graph": graph, "config": config, "local": local_dir, "ray": ray_dir, "summary": summary,
            "executor": executor, "events": events, "task_names": task_names}


def test_ray_tasks_are_named_after_their_stages(tiny_runs):
    # what `ray list tasks` and the dashboard show: finetune[t=1], extract[t=0,query], entry[2,1], ...
    names = sorted(path.read_text() for path in tiny_runs["task_names"].iterdir())
    assert names == sorted(stage.label for stage in tiny_runs["graph"])


def test_ray_executor_matches_local_executor(tiny_runs):
    local, remote, graph = tiny_runs["local"], tiny_runs["ray"], tiny_runs["graph"]
    for name in ("matrix.json", "metrics.json"):
        assert json.loads((remote / name).read_text()) == json.loads((local / name).read_text()), name
    store = RunStore(remote)
    assert all(store.has(stage.key) for stage in graph)
    assert sorted(tiny_runs["summary"].executed) == sorted(stage.key for stage in graph)
    # T = 3: rows hold 1, 2, 3 entries, each a Ray task of this run
    rows = [store.load_record(key) for key in graph.evaluate_stages]
    assert [len(r["entry_keys"]) for r in rows] == [1, 2, 3]
    assert sum(k.startswith("entry-") for k in store.stage_keys()) == 6
    statuses = [e.status for e in tiny_runs["events"] if hasattr(e, "status")]
    assert statuses.count("done") == len(graph) and statuses.count("started") == len(graph)


def test_results_crossing_ray_are_small(tiny_runs):
    stats = tiny_runs["executor"].last_stats
    # every object a node returned to the driver (keys, per-epoch summaries), pickled: a few KB at most, while one
    # model of this scenario is larger (cnn4 width 4 + K-1 = 9 junction) and features are never returned
    assert 0 < stats["largest_result_bytes"] < 8 * 1024
    assert stats["tasks"] == stats["computed"] == len(tiny_runs["graph"])


def test_own_process_policy_follows_the_config_then_rays_gpu_rule():
    from cluster.ray.task_backend import runs_in_own_process
    from pipelines.config.schema import StageResources

    cpu, gpu = {"num_cpus": 1.0, "num_gpus": 0.0}, {"num_cpus": 1.0, "num_gpus": 1.0}
    default, forced, refused = StageResources(), StageResources(own_process=True), StageResources(own_process=False)
    for kind in ("pretrain", "finetune", "replace"):
        assert runs_in_own_process(kind, default, gpu) and not runs_in_own_process(kind, default, cpu)
        assert runs_in_own_process(kind, forced, cpu) and not runs_in_own_process(kind, refused, gpu)
    for kind in ("extract", "entry", "evaluate"):  # never: they reuse workers and their cached features
        assert not runs_in_own_process(kind, forced, gpu)


def test_training_nodes_run_in_worker_processes_of_their_own(tiny_runs):
    # own_process: a training node starts in a worker process of its own (a runtime env no other node uses) and the
    # worker exits after it (max_calls=1), so it never starts on another node's memory and no later node on its own
    store, trains = RunStore(tiny_runs["ray"]), {"pretrain", "finetune", "replace"}
    kinds_by_pid: dict[int, list[str]] = {}
    for stage in tiny_runs["graph"]:
        kinds_by_pid.setdefault(store.load_record(stage.key)["placement"]["pid"], []).append(stage.kind)
    trained = [kinds for kinds in kinds_by_pid.values() if trains & set(kinds)]
    assert trained and all(len(kinds) == 1 for kinds in trained), trained
    assert len(trained) == sum(stage.kind in trains for stage in tiny_runs["graph"])
    # the other nodes share reused workers (Python and torch start once per worker)
    assert any(len(kinds) > 1 for kinds in kinds_by_pid.values())


def test_rerun_skips_every_committed_stage(tiny_runs):
    from cluster.ray.task_backend import RayExecutor

    executor = RayExecutor(progress=False, setup=tiny.register)
    again = executor.run(tiny_runs["graph"], RunStore(tiny_runs["ray"]))
    assert again.executed == [] and len(again.skipped) == len(tiny_runs["graph"])
    assert executor.last_stats["tasks"] == 0


def test_killed_worker_is_retried_and_loses_nothing_committed(tiny_runs, tmp_path, monkeypatch):
    """Row 2's entries are removed; the first entry task kills its worker process. Ray retries it, the run ends
    with the reference matrix, committed entries are not rewritten, and the driver never reads a feature array."""
    import pipelines.stages.feature_store as feature_store
    from cluster.ray.task_backend import RayExecutor

    graph, run_dir = tiny_runs["graph"], tiny_runs["ray"]
    reference = json.loads((tiny_runs["local"] / "matrix.json").read_text())
    manifests = run_dir / "manifests"
    entries = [key for key in graph.ancestors(graph.evaluate_stages) if key.startswith("entry-")]
    missing = {key for key in entries if graph[key].task == 2} | {graph.evaluate_stages[2]}
    for key in missing:
        (manifests / f"{key}.json").unlink()
    kept = {key: (manifests / f"{key}.json").stat().st_mtime_ns for key in entries if key not in missing}

    def forbidden(*args, **kwargs):
        raise AssertionError("the driver must not read feature arrays")

    monkeypatch.setattr(feature_store, "read_features", forbidden)
    marker = tmp_path / "crashed"
    executor = RayExecutor(progress=False, setup=_crash_once_setup(str(marker)))
    summary = executor.run(graph, RunStore(run_dir))
    assert marker.exists()  # a worker really died mid-entry
    assert sorted(summary.executed) == sorted(missing)
    assert json.loads((run_dir / "matrix.json").read_text()) == reference
    for key, mtime in kept.items():
        assert (manifests / f"{key}.json").stat().st_mtime_ns == mtime
    assert executor.last_stats["largest_result_bytes"] < 1024  # entries return a key, never features


@pytest.mark.parametrize("method", sorted(METHODS.names()))
def test_every_method_gives_bit_identical_matrices_on_every_backend_and_in_compat_eval(tmp_path, ray_local, method):
    """The same graph through the in-process backend, the Ray backend and a Tune trial (the engine run row by row
    with ``until=``): identical matrix.json, for every registered method. ``compat eval`` then recomputes the Ray
    run's entries (their manifests removed) through its own path: the same matrix again; and another protocol
    (class-mean galleries) evaluated on each backend's run gives one matrix. FAN maps older galleries through the
    adapters of later tasks; PSP/LSP project stored logits into the gallery model's class space."""
    import ray

    from cluster.ray.task_backend import RayExecutor
    from cluster.tune.spec import SearchSpec
    from cluster.tune.trial import run_trial_pipeline
    from pipelines.config.load import config_to_dict
    from pipelines.results.variants import evaluate_variant

    tiny.register()
    ray.cloudpickle.register_pickle_by_value(tiny)
    torch.set_num_threads(1)
    config = validate_config(tiny.method_scenario(method, tmp_path / "local"))
    graph = compile_scenario(config)
    LocalExecutor(progress=False).run(graph, RunStore(tmp_path / "local"))
    RayExecutor(progress=False, setup=tiny.register).run(graph, RunStore(tmp_path / "ray"))
    spec = SearchSpec(name="same", base_config=config_to_dict(config), space={}, storage=str(tmp_path / "tune"))
    reports = []
    run_trial_pipeline(spec, {}, "trial0", lambda metrics, completed: reports.append(completed))
    runs = {"local": tmp_path / "local", "ray": tmp_path / "ray", "tune": Path(spec.run_dir("trial0"))}
    local = json.loads((runs["local"] / "matrix.json").read_text())
    assert json.loads((runs["ray"] / "matrix.json").read_text()) == local
    assert json.loads((runs["tune"] / "matrix.json").read_text()) == local
    assert reports == [1, 2, 3][-len(reports):] and reports[-1] == config.num_tasks

    ray_store = RunStore(runs["ray"])
    recomputed = [stage.key for stage in graph if stage.kind in ("entry", "evaluate")]
    for key in recomputed:
        assert ray_store.forget(key)
    matrix, _, folder = evaluate_variant(str(runs["ray"]), {})
    assert folder == "" and all(ray_store.has(key) for key in recomputed)
    assert matrix["values"] == local["values"]
    variants = [evaluate_variant(str(run), {"gallery": "class_means"})[0]["values"] for run in runs.values()]
    assert variants[0] == variants[1] == variants[2]
    if method == "fan":  # the adapters really were used: at least one model carries one
        assert any(ray_store.load_record(key).get("adapter_blob") for key in graph.extract_stages.values())

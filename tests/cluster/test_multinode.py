"""A Ray cluster of a head (no CPUs: it runs nothing) and two worker nodes started by the test, each with its own
temp dir and the custom resource ``stage_worker`` that every stage asks for; the run store on the real SeaweedFS
server (``s3://``) is the only thing the nodes share. The tiny scenario runs to the matrix of the in-process
backend, also when a worker node is removed in the middle of a fine-tuning stage (resumed from its epoch
checkpoint on the surviving node) or of a matrix entry."""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))
import tiny_scenario_helpers as tiny  # noqa: E402

from pipelines.config.load import validate_config  # noqa: E402
from pipelines.engine.runner import LocalExecutor  # noqa: E402
from pipelines.graph.compile import compile_scenario  # noqa: E402
from pipelines.store.run_store import RunStore  # noqa: E402

pytestmark = pytest.mark.multinode

OBJECT_STORE = 100 * 1024 * 1024
WORKER_RESOURCE = "stage_worker"
EPOCHS = 4


def _document(output: str) -> dict:
    document = tiny.scenario("dsimplex-hoc", output=output)
    document["training"].update(epochs=EPOCHS, checkpoint_every_epochs=1)
    custom = {"custom": {WORKER_RESOURCE: 1}}
    document["resources"] = {kind: dict(custom) for kind in ("pretrain", "finetune", "extract")}
    document["resources"]["evaluate"] = {"num_gpus": 0, **custom}
    return document


class Nodes:
    """The test cluster: ``cluster`` (ray.cluster_utils.Cluster), ``workers`` (alive worker Node objects)."""

    def __init__(self, root: Path) -> None:
        from ray.cluster_utils import Cluster

        self.root = root
        self.count = 0
        self.folders: dict[str, str] = {}
        self.cluster = Cluster(initialize_head=True, head_node_args=self._args("head", num_cpus=0))
        self.workers = [self.add_worker() for _ in range(2)]

    def _args(self, name: str, **extra) -> dict:
        folder = self.root / name
        folder.mkdir(parents=True, exist_ok=True)
        return dict(node_ip_address="127.0.0.1", object_store_memory=OBJECT_STORE, include_dashboard=False,
                    temp_dir=str(folder), **extra)

    def add_worker(self):
        self.count += 1
        name = f"worker{self.count}"
        node = self.cluster.add_node(**self._args(name, num_cpus=1, resources={WORKER_RESOURCE: 1}))
        self.cluster.wait_for_nodes()
        self.folders[node.node_id] = str(self.root / name)
        return node

    def processes_of(self, node) -> list[int]:
        """Every process of a node: those whose command line names the node's own temp dir (raylet, object
        store, workers: their arguments hold the node's socket paths)."""
        folder, pids = self.folders[node.node_id], []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if folder.encode() in (entry / "cmdline").read_bytes():
                        pids.append(int(entry.name))
                except OSError:
                    continue
        return pids

    def ensure_two_workers(self) -> None:
        while len(self.workers) < 2:
            self.workers.append(self.add_worker())

    def remove(self, node) -> None:
        """The whole node dies at once (a preempted machine): SIGKILL to each of its processes, worker processes
        included (ray.cluster_utils kills the node's services; its workers would otherwise finish their task)."""
        pids = self.processes_of(node)
        assert pids, "no process of the node found"
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.cluster.remove_node(node, allow_graceful=False)
        self.workers.remove(node)

    def node_of(self, node_id: str):
        return next(node for node in self.workers if node.node_id == node_id)


@pytest.fixture(scope="module")
def nodes(s3_server, tmp_path_factory):
    import ray

    from cluster.ray.loopback import prepare_loopback

    was_initialized = ray.is_initialized()  # the session's shared local Ray (ray_local) gives way, then returns
    if was_initialized:
        ray.shutdown()
    with pytest.MonkeyPatch.context() as patch:
        for name, value in s3_server.environment().items():  # the nodes' processes inherit the S3 settings
            patch.setenv(name, value)
        patch.delenv("AWS_PROFILE", raising=False)
        prepare_loopback()
        # short: Ray's socket paths under a node's temp dir must stay below 108 bytes
        root = Path(tempfile.mkdtemp(prefix="rn-", dir="/tmp"))
        cluster = Nodes(root)
        ray.init(address=cluster.cluster.address, configure_logging=False, log_to_driver=False)
        tiny.register()
        ray.cloudpickle.register_pickle_by_value(tiny)
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        try:
            yield cluster
        finally:
            ray.shutdown()
            cluster.cluster.shutdown()
            shutil.rmtree(root, ignore_errors=True)
    if was_initialized:
        ray.init(address="local", num_cpus=2, object_store_memory=200 * 1024 * 1024, include_dashboard=False,
                 _node_ip_address="127.0.0.1", configure_logging=False, log_to_driver=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same graph on the in-process backend, local folder (the stage keys do not depend on the store)."""
    tiny.register()
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("reference")
    graph = compile_scenario(validate_config(_document(str(folder))))
    LocalExecutor(progress=False).run(graph, RunStore(folder))
    return graph, json.loads((folder / "matrix.json").read_text()), json.loads((folder / "metrics.json").read_text())


def _placements(store: RunStore, graph) -> dict[str, str]:
    return {stage.key: store.load_record(stage.key)["placement"]["node_id"] for stage in graph}


def test_two_worker_nodes_with_only_s3_shared_give_the_local_matrix(nodes, reference, s3_bucket):
    import ray

    from cluster.ray.task_backend import RayExecutor

    graph, matrix, metrics = reference
    store = RunStore(f"s3://{s3_bucket}/run")
    executor = RayExecutor(progress=False, setup=tiny.register)
    executor.run(graph, store)
    assert json.loads(store.read_text("matrix.json")) == matrix
    assert json.loads(store.read_text("metrics.json")) == metrics
    workers = {node.node_id for node in nodes.workers}
    head = nodes.cluster.head_node.node_id
    placed = _placements(store, graph)
    assert set(placed.values()) <= workers and head not in placed.values()
    assert executor.last_stats["nodes"] == placed  # the engine's record and the manifests agree
    alive = [n for n in ray.nodes() if n["Alive"]]
    assert len(alive) == 3
    print("\nnodes:", {n["NodeID"][:8]: n["Resources"] for n in alive})
    print("stage -> node:", {graph[key].label: node[:8] for key, node in placed.items()})
    assert store.list_dirs("checkpoints") == []  # every checkpoint collected after its stage committed


def _slow_and_reporting_setup(marker_dir: str, finetune_key: str, entry_key: str):
    """Worker setup of the node-loss test. The fine-tuning stage ``finetune_key`` reports each finished epoch
    (``trained-<epochs>-<node>``); the first attempt to write its epoch-3 checkpoint hangs (slow storage), so the
    test removes its node after the epoch-2 checkpoint and before the epoch-3 one, however loaded the machine is.
    The entry ``entry_key`` reports its node; its first attempt hangs until the test removes that node. Retries do
    not wait. Neither changes what is computed."""
    def setup():
        import os as _os
        import time as _time

        import ray as _ray

        import pipelines.stages.execute as stages
        import pipelines.stages.entries as entries
        import pipelines.training.checkpoints as checkpoints

        tiny.register()
        if getattr(checkpoints.StoreCheckpointSink.save, "_reporting", False):
            return
        node = _ray.get_runtime_context().get_node_id()
        original_save, original_entry = checkpoints.StoreCheckpointSink.save, entries.entry_stage

        def first_attempt(prefix: str) -> bool:
            return not any(name.startswith(prefix) for name in _os.listdir(marker_dir))

        def hang() -> None:  # the test kills this process; bounded so that a broken test cannot hang forever
            _time.sleep(300)

        def save(self, checkpoint):
            if self.stage_key == finetune_key:
                prefix = f"trained-{checkpoint.epochs_done}-"
                first = first_attempt(prefix)
                open(_os.path.join(marker_dir, f"{prefix}{node}"), "w").close()
                if checkpoint.epochs_done == 3 and first:
                    hang()
            original_save(self, checkpoint)

        def entry(ctx):
            if ctx.stage.key == entry_key:
                first = first_attempt("entry-")
                open(_os.path.join(marker_dir, f"entry-{node}"), "w").close()
                if first:
                    hang()
            return original_entry(ctx)

        save._reporting = True
        checkpoints.StoreCheckpointSink.save = save
        entries.entry_stage = entry
        stages.STAGE_FUNCTIONS["entry"] = entry
    return setup


def _wait_for(predicate, what: str, timeout: float = 120.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_worker_node_lost_mid_finetune_and_mid_entry_still_gives_the_local_matrix(nodes, reference, s3_bucket,
                                                                                    tmp_path):
    """The node running finetune[t=2] (1-based) is removed after its epoch-2 checkpoint; Ray retries the stage on
    the surviving node, which resumes from that checkpoint. A replacement node joins (as an autoscaler would add
    one), then the node running entry C[3, 1] (1-based) is removed mid-entry; Ray retries it on the other node. The
    run ends with the matrix of the in-process backend."""
    import threading

    from cluster.ray.task_backend import RayExecutor

    graph, matrix, metrics = reference
    nodes.ensure_two_workers()
    target = next(stage for stage in graph if stage.kind == "finetune" and stage.task == 1)
    entry = next(stage for stage in graph if stage.kind == "entry" and stage.label == "entry[2,0]")
    store = RunStore(f"s3://{s3_bucket}/run")
    executor = RayExecutor(progress=False, setup=_slow_and_reporting_setup(str(tmp_path), target.key, entry.key))
    outcome: dict = {}
    runner = threading.Thread(target=lambda: outcome.update(summary=executor.run(graph, store)), daemon=True)
    runner.start()

    def marker(prefix: str) -> str | None:
        found = [p.name for p in tmp_path.iterdir() if p.name.startswith(prefix)]
        return found[0] if found else None

    first_node = _wait_for(lambda: marker("trained-3-"), "the epoch-3 checkpoint to start").split("-", 2)[2]
    assert "epoch-00002.json" in store.list_files(f"checkpoints/{target.key}")
    nodes.remove(nodes.node_of(first_node))
    trained_before_loss = max(int(p.name.split("-")[1]) for p in tmp_path.iterdir()
                              if p.name.startswith("trained-") and p.name.endswith(first_node))
    nodes.ensure_two_workers()
    entry_node = _wait_for(lambda: marker("entry-"), "the hanging entry").split("-", 1)[1]
    nodes.remove(nodes.node_of(entry_node))
    runner.join(timeout=240)
    assert not runner.is_alive() and "summary" in outcome
    assert json.loads(store.read_text("matrix.json")) == matrix
    assert json.loads(store.read_text("metrics.json")) == metrics
    record = store.load_record(target.key)
    assert record["placement"]["node_id"] != first_node
    assert record["training"]["resumed_from_epoch"] == 2
    assert store.load_record(entry.key)["placement"]["node_id"] != entry_node
    assert store.list_dirs("checkpoints") == []
    recomputed = trained_before_loss - record["training"]["resumed_from_epoch"]
    print(f"\nfinetune[t=1] lost on node {first_node[:8]} after {trained_before_loss} epoch(s) trained, resumed "
          f"on {record['placement']['node_id'][:8]} from the epoch-2 checkpoint: {recomputed} full epoch(s) recomputed "
          f"of {EPOCHS} (plus the part of the epoch in progress); entry[2,0] lost on {entry_node[:8]}, redone on "
          f"{store.load_record(entry.key)['placement']['node_id'][:8]}")


def test_a_gpu_stage_waits_for_a_gpu_node_and_says_so(nodes, reference, s3_bucket, caplog):
    """resources.pretrain.num_gpus: 1 on a cluster without GPUs, resources.autoscaling: true: the stage is neither
    refused nor resized to 0 GPUs; the log says what it waits for; once a node with a GPU joins (what an autoscaler
    would add) it runs there and the run ends with the in-process matrix (resources are not part of stage keys)."""
    import logging
    import threading

    from cluster.ray.task_backend import RayExecutor

    graph, matrix, _ = reference
    document = _document(graph.config.output.dir)
    document["resources"]["pretrain"]["num_gpus"] = 1
    document["resources"]["autoscaling"] = True
    gpu_graph = compile_scenario(validate_config(document))
    assert [s.key for s in gpu_graph] == [s.key for s in graph]
    nodes.ensure_two_workers()
    store = RunStore(f"s3://{s3_bucket}/run")
    caplog.set_level(logging.WARNING, logger="cluster.ray.task_backend")
    outcome: dict = {}
    runner = threading.Thread(target=lambda: outcome.update(summary=RayExecutor(progress=False, setup=tiny.register)
                                                            .run(gpu_graph, store)), daemon=True)
    runner.start()
    line = _wait_for(lambda: next((r.getMessage() for r in caplog.records if "waits for a node" in r.getMessage()),
                                  None), "the waiting log line", timeout=60)
    assert line == "stage pretrain[p1] waits for a node with GPU=1 (largest node: 0): the autoscaler may add one"
    time.sleep(2)
    assert not store.has(graph.pretrain_stages["p1"])  # still waiting: no node has a GPU
    gpu_node = nodes.cluster.add_node(**nodes._args("gpu", num_cpus=1, num_gpus=1, resources={WORKER_RESOURCE: 1}))
    nodes.cluster.wait_for_nodes()
    try:
        runner.join(timeout=240)
        assert not runner.is_alive() and "summary" in outcome
        assert store.load_record(graph.pretrain_stages["p1"])["placement"]["node_id"] == gpu_node.node_id
        assert json.loads(store.read_text("matrix.json")) == matrix
    finally:
        nodes.cluster.remove_node(gpu_node)

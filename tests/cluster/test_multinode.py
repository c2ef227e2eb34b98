"""A Ray cluster of a head (no CPUs: it runs nothing) and two worker nodes started by the test, each with its own
temp dir and the custom resource ``stage_worker`` that every stage asks for; the run store on the real SeaweedFS
server (``s3://``) is the only thing the nodes share. The tiny scenario runs to the matrix of the in-process
backend, also when a worker node is removed in the middle of a fine-tuning stage (resumed from its epoch
checkpoint on the surviving node) or of a matrix entry."""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))
import tiny_scenario_helpers as tiny  # noqa: E402

from pipelines.config import validate_config  # noqa: E402
from pipelines.executor import LocalExecutor  # noqa: E402
from pipelines.graph import compile_scenario  # noqa: E402
from pipelines.store import RunStore  # noqa: E402

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
        self.cluster = Cluster(initialize_head=True, head_node_args=self._args("head", num_cpus=0))
        self.workers = [self.add_worker() for _ in range(2)]

    def _args(self, name: str, **extra) -> dict:
        folder = self.root / name
        folder.mkdir(parents=True, exist_ok=True)
        return dict(node_ip_address="127.0.0.1", object_store_memory=OBJECT_STORE, include_dashboard=False,
                    temp_dir=str(folder), **extra)

    def add_worker(self):
        self.count += 1
        node = self.cluster.add_node(**self._args(f"worker{self.count}", num_cpus=1,
                                                  resources={WORKER_RESOURCE: 1}))
        self.cluster.wait_for_nodes()
        return node

    def ensure_two_workers(self) -> None:
        while len(self.workers) < 2:
            self.workers.append(self.add_worker())

    def remove(self, node) -> None:
        self.cluster.remove_node(node, allow_graceful=False)
        self.workers.remove(node)

    def node_of(self, node_id: str):
        return next(node for node in self.workers if node.node_id == node_id)


@pytest.fixture(scope="module")
def nodes(s3_server, tmp_path_factory):
    import ray

    from cluster.ray_loopback import prepare_loopback

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
        ray.init(num_cpus=2, object_store_memory=200 * 1024 * 1024, include_dashboard=False,
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

    from cluster.ray_executor import RayExecutor

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

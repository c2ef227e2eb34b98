"""Unsatisfiable stage requests are refused naming the stage and the resource (unless an autoscaler may add a
node); checked against node tables shaped like ray.nodes() and against the real local Ray instance."""
from __future__ import annotations

import pytest

from cluster.ray.resource_check import UnsatisfiableResourcesError, check_satisfiable

NODES = [{"Alive": True, "Resources": {"CPU": 2.0, "memory": 20 * 1024 ** 3}},
         {"Alive": True, "Resources": {"CPU": 8.0, "GPU": 1.0, "memory": 60 * 1024 ** 3}},
         {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0, "memory": 500 * 1024 ** 3}}]


def test_request_covered_by_one_node_passes():
    assert check_satisfiable("finetune[t=0]", "resources.finetune", {"num_cpus": 4, "num_gpus": 1,
                                                                      "memory": 50 * 1024 ** 3}, NODES, False) is None


def test_request_no_node_covers_is_refused_with_stage_and_resource():
    request = {"num_cpus": 1, "memory": 100 * 1000 ** 3}
    with pytest.raises(UnsatisfiableResourcesError,
                       match=r"stage finetune\[t=0\] asks for memory=93\.1 GiB \(largest node: 60\.0 GiB\).*lower "
                             r"resources\.finetune"):
        check_satisfiable("finetune[t=0]", "resources.finetune", request, NODES, False)
    # GPUs and CPUs on different nodes do not add up: one node must hold the whole request
    with pytest.raises(UnsatisfiableResourcesError, match="CPU=9"):
        check_satisfiable("pretrain[p1]", "resources.pretrain", {"num_cpus": 9, "num_gpus": 1}, NODES, False)


def test_custom_resources_are_checked_and_named():
    """resources.<kind>.custom (Ray custom resources) must be on the same node as the rest of the request."""
    nodes = NODES + [{"Alive": True, "Resources": {"CPU": 1.0, "spot": 1.0}}]
    from cluster.ray.task_backend import task_options
    from pipelines.config.schema import StageResources

    options = task_options(StageResources(num_cpus=1, custom={"spot": 0.5}), "cpu", False)
    assert options["resources"] == {"spot": 0.5}
    assert check_satisfiable("finetune[t=0]", "resources.finetune", options, nodes, False) is None
    # 2 CPUs and the spot resource exist, but on different nodes
    with pytest.raises(UnsatisfiableResourcesError, match="asks for resources no single node has"):
        check_satisfiable("finetune[t=0]", "resources.finetune", {"num_cpus": 2, "resources": {"spot": 1}}, nodes,
                          False)
    line = check_satisfiable("finetune[t=0]", "resources.finetune", {"num_cpus": 1, "resources": {"a100": 1}},
                             nodes, True)
    assert line == "stage finetune[t=0] waits for a node with a100=1 (largest node: 0): the autoscaler may add one"


def test_with_an_autoscaler_the_stage_waits_and_says_for_what():
    line = check_satisfiable("finetune[t=0]", "resources.finetune", {"num_gpus": 2}, NODES, True)
    assert line == "stage finetune[t=0] waits for a node with GPU=2 (largest node: 1): the autoscaler may add one"


def test_against_the_real_local_ray(ray_local):
    nodes = ray_local.nodes()
    assert check_satisfiable("extract[t=0,query]", "resources.extract", {"num_cpus": 1}, nodes, False) is None
    with pytest.raises(UnsatisfiableResourcesError, match="GPU=1 \\(largest node: 0\\)"):
        check_satisfiable("finetune[t=0]", "resources.finetune", {"num_cpus": 1, "num_gpus": 1}, nodes, False)


def test_the_ray_engine_refuses_an_unsatisfiable_stage_before_it_hangs(ray_local, tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))
    import tiny_scenario_helpers as tiny

    from cluster.ray.task_backend import RayExecutor
    from pipelines.config.load import validate_config
    from pipelines.graph.compile import compile_scenario
    from pipelines.store.run_store import RunStore

    tiny.register()
    document = tiny.scenario("er", output=str(tmp_path / "run"))
    document["resources"] = {"finetune": {"memory": 10 ** 15}}
    graph = compile_scenario(validate_config(document))
    with pytest.raises(UnsatisfiableResourcesError, match=r"stage finetune\[t=0\] asks for memory=931322\.6 GiB"):
        RayExecutor(progress=False, setup=tiny.register).run(graph, RunStore(str(tmp_path / "run")))
    # every stage is checked before the first starts: the pre-training (which fits) never ran
    manifests = tmp_path / "run" / "manifests"
    assert not manifests.exists() or not list(manifests.iterdir())
    document["resources"] = {"finetune": {"num_cpus": 64}}
    with pytest.raises(UnsatisfiableResourcesError, match=r"stage finetune\[t=0\] asks for CPU=64"):
        RayExecutor(progress=False, setup=tiny.register).run(compile_scenario(validate_config(document)),
                                                             RunStore(str(tmp_path / "run")))
    assert not manifests.exists() or not list(manifests.iterdir())


def test_the_memory_preflight_compares_with_the_largest_node_that_can_hold_the_stage():
    """A bigger node that lacks the stage's GPU does not count; a dead node does not count; the chosen node's
    `memory` total and address are what the refusal names."""
    from cluster.ray.memory_check import node_memory_room

    gib = 1 << 30
    nodes = [{"Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 8, "memory": 64 * gib}},
             {"Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 8, "GPU": 1, "memory": 16 * gib}},
             {"Alive": False, "NodeManagerAddress": "10.0.0.3",
              "Resources": {"CPU": 8, "GPU": 1, "memory": 128 * gib}}]
    room, what, holder = node_memory_room(nodes, [{"num_cpus": 1, "num_gpus": 1}])
    assert room == 16 * gib and "10.0.0.2, of 1" in holder and "`memory` resource" in what
    room, _, holder = node_memory_room(nodes, [{"num_cpus": 1, "num_gpus": 0}])
    assert room == 64 * gib and "10.0.0.1, of 2" in holder
    assert node_memory_room(nodes, [{"num_cpus": 16}]) is None  # no node holds it (the resource check says so)

"""The executor registry (pipelines.engine.backends): names, the options each kind of executor receives, the
refusal of --address for an in-process executor, and an executor added by registering one card, run end to end."""
from __future__ import annotations

import pytest
import tiny_scenario_helpers as tiny
import torch

from pipelines.config.load import validate_config
from pipelines.engine import backends
from pipelines.engine.backends import EXECUTORS, ExecutorCard, address_refusal, build_executor
from pipelines.engine.runner import Executor, InProcessBackend, LocalExecutor, run_graph
from pipelines.graph.compile import compile_scenario
from pipelines.store.run_store import RunStore


class CountingBackend(InProcessBackend):
    """The in-process backend, counting the nodes submitted to it."""

    def __init__(self, emit) -> None:
        super().__init__(emit)
        self.submitted: list[str] = []

    def submit(self, stage, graph, store) -> None:
        self.submitted.append(stage.key)
        super().submit(stage, graph, store)


class CountingExecutor(Executor):
    """A toy cluster executor: records the options it was built with and runs the engine on CountingBackend."""

    built: list[dict] = []

    def __init__(self, emit=None, progress=True, address=None, setup=None, num_cpus=None) -> None:
        self.emit = emit if emit is not None else (lambda record: None)
        type(self).built.append({"progress": progress, "address": address, "setup": setup, "num_cpus": num_cpus})
        self.backend = CountingBackend(self.emit)

    def run(self, graph, store, until=None):
        return run_graph(graph, store, self.backend, self.emit, until)


@pytest.fixture
def counting_card(monkeypatch):
    card = ExecutorCard("counting", "test executor", f"{__name__}:CountingExecutor", on_cluster=True)
    monkeypatch.setitem(EXECUTORS._entries, card.name, card)  # registered for this test only
    CountingExecutor.built.clear()
    return card


def test_the_in_process_executor_is_registered_and_built_by_name():
    assert "local" in backends.executor_names()
    events = []
    executor = build_executor("local", emit=events.append, progress=False)
    assert isinstance(executor, LocalExecutor) and executor.emit == events.append


def test_unknown_executor_lists_the_valid_names():
    with pytest.raises(KeyError, match="unknown executor 'dask'; valid executor names: .*local"):
        build_executor("dask")


def test_an_address_is_refused_for_an_in_process_executor(counting_card):
    assert address_refusal("local", None) is None
    assert address_refusal("counting", "10.0.0.1:6379") is None
    message = address_refusal("local", "auto")
    assert message.startswith("--address applies to --executor ") and "counting" in message
    with pytest.raises(ValueError, match="--address applies to --executor"):
        build_executor("local", address="auto")


def test_a_cluster_executor_receives_address_setup_and_cpus(counting_card):
    setup = print
    build_executor("counting", progress=False, address="auto", setup=setup, num_cpus=3)
    build_executor("counting")
    assert CountingExecutor.built == [{"progress": False, "address": "auto", "setup": setup, "num_cpus": 3},
                                      {"progress": True, "address": None, "setup": None, "num_cpus": None}]


def test_a_registered_executor_runs_every_node_once(counting_card, tmp_path):
    tiny.register()
    torch.set_num_threads(1)
    config = validate_config(tiny.scenario("er", output=str(tmp_path)))
    graph = compile_scenario(config)
    executor = build_executor("counting", progress=False)
    summary = executor.run(graph, RunStore(tmp_path))
    # the tiny scenario, counted by hand: 1 pretrain, 3 task models (2 finetune + 1 replace), 2 extracts per model,
    # T(T+1)/2 = 6 entries and 3 rows: 19 nodes, each submitted exactly once, none skipped in a fresh folder
    assert len(graph) == 19
    assert sorted(executor.backend.submitted) == sorted(summary.executed) == sorted(stage.key for stage in graph)
    assert summary.skipped == [] and summary.matrix is not None and len(summary.matrix["values"]) == 3

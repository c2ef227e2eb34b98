"""The replay memory is appended per task: each stage's shard holds only the exemplars its task adds, the record
lists the parts of the memory, and the parts read back as the memory the next task trains with."""
import numpy as np
import pytest
import tiny_scenario_helpers as tiny
import torch

from compat_core.integrity import IntegrityError
from pipelines.config.load import validate_config
from pipelines.engine.runner import LocalExecutor
from pipelines.graph.compile import compile_scenario
from pipelines.stages.replay_store import memory_parts, read_memory_shard
from pipelines.store.run_store import RunStore


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tiny.register()
    torch.set_num_threads(1)
    run_dir = tmp_path_factory.mktemp("append")
    graph = compile_scenario(validate_config(tiny.scenario("dsimplex-hoc", output=str(run_dir))))
    LocalExecutor(progress=False).run(graph, RunStore(run_dir))
    return graph, RunStore(run_dir), run_dir


def test_each_stage_stores_only_its_new_exemplars(run):
    graph, store, run_dir = run
    stored_rows, rewrite_rows = 0, 0
    for task, key in enumerate(graph.model_stages):
        record = store.load_record(key)["memory"]
        tasks = store.read_array(key, record["tasks_blob"])
        indices = store.read_array(key, record["indices_blob"])
        shard = record["shard"]
        # this stage's own shard: the task's exemplars only (2 classes x per_class 3 = 6 rows)
        assert shard["stage_key"] == key and shard["rows"] == int((tasks == task).sum()) == 6
        parts = memory_parts(shard)
        assert [p.stage_key for p in parts] == graph.model_stages[: task + 1]
        memory, images = read_memory_shard(store, shard)
        assert np.array_equal(memory.indices, indices) and np.array_equal(memory.source_task, tasks)
        assert images.shape[0] == indices.size == 6 * (task + 1)
        stored_rows += shard["rows"]
        rewrite_rows += indices.size
    # storage grows with the new exemplars only: 6 + 6 + 6 rows instead of 6 + 12 + 18 when rewritten per task
    files = sorted(run_dir.glob("replay/*/shards/replay/*.parquet"))
    assert len(files) == 3 and (stored_rows, rewrite_rows) == (18, 36)


def test_a_corrupt_older_part_names_the_stage_that_wrote_it(run):
    graph, store, run_dir = run
    first, last = graph.model_stages[0], graph.model_stages[-1]
    parquet = run_dir / "replay" / first / "shards" / "replay" / "task-000.parquet"
    original = parquet.read_bytes()
    try:
        damaged = bytearray(original)
        damaged[len(damaged) // 2] ^= 0xFF
        parquet.write_bytes(bytes(damaged))
        with pytest.raises(IntegrityError, match="sha256") as error:
            read_memory_shard(store, store.load_record(last)["memory"]["shard"])
        assert error.value.stage_key == first and str(parquet) in str(error.value)
    finally:
        parquet.write_bytes(original)


def test_a_record_without_parts_is_one_whole_memory_shard(run):
    graph, store, _ = run
    shard = dict(store.load_record(graph.model_stages[0])["memory"]["shard"])
    shard.pop("parts")
    memory, _ = read_memory_shard(store, shard)
    assert memory.indices.size == shard["rows"]

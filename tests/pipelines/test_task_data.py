"""pipelines.training.task_data: the batch order the loop steps through (sizes, the dropped one-sample batch,
steps_per_epoch, half memory / half task) and the held-out selection split, on hand-counted examples."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from compat_core.data.source import ArraySource
from pipelines.training.settings import TrainConfig
from pipelines.training.task_data import SelectionSplit, TaskData, _steps_per_epoch, epoch_batches, selection_split


@dataclass
class Sampling:
    uses_replay: bool


def _source(labels) -> ArraySource:
    labels = np.asarray(labels)
    return ArraySource("toy", np.zeros((labels.size, 2, 2, 1), np.uint8), labels,
                       [str(c) for c in range(int(labels.max()) + 1)])


def _data(task: int, memory: int = 0) -> TaskData:
    source = _source(np.arange(task + memory) % 3)
    memory_indices = np.arange(task, task + memory) if memory else None
    return TaskData(source, 0, np.arange(task), np.zeros(task, np.int64), 0, 3,
                    memory_indices, None if memory_indices is None else np.zeros(memory, np.int64))


def test_task_batches_of_an_epoch():
    config = TrainConfig(batch_size=4)
    # 10 samples in batches of 4: 4 + 4 + 2, every position once
    batches = list(epoch_batches(_data(10), Sampling(False), config, 0))
    assert [b.size for b in batches] == [4, 4, 2] and sorted(np.concatenate(batches).tolist()) == list(range(10))
    # 9 samples: 4 + 4 + 1, and a batch of one sample is dropped (batch norm needs two)
    assert [b.size for b in epoch_batches(_data(9), Sampling(False), config, 0)] == [4, 4]
    assert _steps_per_epoch(_data(9), Sampling(False), config) == 2
    assert _steps_per_epoch(_data(10), Sampling(False), TrainConfig(batch_size=4, steps_per_epoch=1)) == 1


def test_the_order_is_seeded_per_epoch():
    config = TrainConfig(batch_size=4, seed=3)
    first = np.concatenate(list(epoch_batches(_data(10), Sampling(False), config, 0)))
    again = np.concatenate(list(epoch_batches(_data(10), Sampling(False), config, 0)))
    second = np.concatenate(list(epoch_batches(_data(10), Sampling(False), config, 1)))
    assert first.tolist() == again.tolist() and first.tolist() != second.tolist()


def test_replay_batches_are_half_memory_half_task():
    # 8 task samples (positions 0..7), 6 memory samples (8..13), batch 4, epoch = one pass over the task data:
    # 8 / (4 // 2) = 4 batches, each 2 memory + 2 task positions
    batches = list(epoch_batches(_data(8, memory=6), Sampling(True), TrainConfig(batch_size=4), 0))
    assert len(batches) == 4
    assert all((b >= 8).sum() == 2 and (b < 8).sum() == 2 for b in batches)
    assert sorted(np.concatenate([b[b < 8] for b in batches]).tolist()) == list(range(8))
    # a method without replay ignores the memory
    assert [b.size for b in epoch_batches(_data(8, memory=6), Sampling(False), TrainConfig(batch_size=4), 0)] == [4, 4]


def test_selection_split_holds_out_a_share_of_each_class():
    # class 0: 6 samples -> round(0.5 * 6) = 3 held (1 query, 2 gallery); class 1: 4 -> 2 held (1 + 1);
    # class 2: 2 samples -> max(2, 1) = 2 >= 2: the whole class would go, so none is held
    labels = np.array([0] * 6 + [1] * 4 + [2] * 2)
    pool = _source(labels)
    indices = np.arange(labels.size)
    remaining, split = selection_split(0.5, pool, indices, seed=0)
    assert isinstance(split, SelectionSplit)
    assert split.query_indices.size == 2 and split.gallery_indices.size == 3
    assert sorted(labels[split.query_indices].tolist()) == [0, 1]
    assert sorted(labels[split.gallery_indices].tolist()) == [0, 0, 1]
    held = np.concatenate([split.query_indices, split.gallery_indices])
    assert sorted(np.concatenate([remaining, held]).tolist()) == list(range(12))
    with pytest.raises(ValueError, match="selection_holdout: no class has enough samples"):
        selection_split(0.5, pool, np.array([10, 11]), seed=0)

"""Replay memory: quotas, determinism, iCaRL herding against a brute force, the half/half sampler."""
from __future__ import annotations

import json

import numpy as np
import pytest

from compat_core.data.replay import ReplayMemory, half_and_half_batches, half_and_half_num_batches, update_memory


def _task_data():
    labels = np.concatenate([np.full(30, 4), np.full(5, 9), np.full(25, 2)])
    indices = 1000 + np.arange(labels.size)  # sample keys differ from row positions on purpose
    slots = labels + 100
    return indices, labels, slots


def test_random_quota_per_class():
    indices, labels, slots = _task_data()
    memory = update_memory(None, indices, labels, slots, task=0, per_class=20, seed=0)
    assert memory.per_class_counts() == {2: 20, 4: 20, 9: 5}
    key_to_label = dict(zip(indices.tolist(), labels.tolist()))
    assert all(key_to_label[k] == l for k, l in zip(memory.indices.tolist(), memory.labels.tolist()))
    np.testing.assert_array_equal(memory.slots, memory.labels + 100)
    assert set(memory.source_task.tolist()) == {0}
    assert np.unique(memory.indices).size == len(memory) == 45


def test_random_selection_is_seeded():
    indices, labels, slots = _task_data()
    a = update_memory(None, indices, labels, slots, task=0, per_class=10, seed=3)
    b = update_memory(None, indices, labels, slots, task=0, per_class=10, seed=3)
    c = update_memory(None, indices, labels, slots, task=0, per_class=10, seed=4)
    np.testing.assert_array_equal(a.indices, b.indices)
    assert not np.array_equal(a.indices, c.indices)


def test_tasks_accumulate_and_classes_never_repeat():
    indices, labels, slots = _task_data()
    first = update_memory(None, indices, labels, slots, task=0, per_class=10)
    second = update_memory(first, np.arange(8), np.array([7] * 8), np.array([3] * 8), task=1, per_class=10)
    assert len(second) == len(first) + 8
    np.testing.assert_array_equal(second.indices[: len(first)], first.indices)
    assert second.per_class_counts()[7] == 8 and set(second.source_task[len(first):].tolist()) == {1}
    with pytest.raises(ValueError, match=r"classes \[4\] already have exemplars"):
        update_memory(second, np.arange(3), np.array([4, 4, 4]), np.array([0, 0, 0]), task=2, per_class=10)


def test_record_round_trip_is_plain():
    indices, labels, slots = _task_data()
    memory = update_memory(None, indices, labels, slots, task=2, per_class=3)
    record = json.loads(json.dumps(memory.to_dict()))
    again = ReplayMemory.from_dict(record)
    for name in ("indices", "labels", "slots", "source_task"):
        np.testing.assert_array_equal(getattr(again, name), getattr(memory, name))
        assert getattr(again, name).dtype == np.int64
    with pytest.raises(KeyError, match="slots"):
        ReplayMemory.from_dict({"indices": [1], "labels": [1], "source_task": [0]})
    with pytest.raises(ValueError, match="equal lengths"):
        ReplayMemory(np.arange(3), np.arange(2), np.arange(3), np.arange(3))


def test_herding_hand_worked_one_dimensional():
    # Features 0, 9, 4, 6: class mean 4.75. k=1: |4 - 4.75| = 0.75 -> row 2. k=2: (4+6)/2 = 5 is 0.25 away
    # -> row 3. k=3: (10+0)/3 = 3.33 is 1.42 away, (10+9)/3 = 6.33 is 1.58 away -> row 0. k=4: row 1.
    features = np.array([[0.0], [9.0], [4.0], [6.0]])
    memory = update_memory(None, np.array([10, 11, 12, 13]), np.zeros(4, dtype=int), np.zeros(4, dtype=int),
                           task=0, per_class=4, strategy="herding", features=features, normalize_features=False)
    assert memory.indices.tolist() == [12, 13, 10, 11]


def _brute_force_herding(features: np.ndarray, count: int) -> list[int]:
    """iCaRL Alg. 4 written out with Python loops over fp64 L2-normalised features."""
    rows = [f / np.sqrt(sum(v * v for v in f)) for f in features.astype(np.float64)]
    mean = sum(rows) / len(rows)
    picked: list[int] = []
    for k in range(1, count + 1):
        best, best_distance = None, None
        for i, row in enumerate(rows):
            if i in picked:
                continue
            candidate = (sum((rows[j] for j in picked), np.zeros_like(mean)) + row) / k
            distance = np.sqrt(sum((m - c) ** 2 for m, c in zip(mean, candidate)))
            if best_distance is None or distance < best_distance:
                best, best_distance = i, distance
        picked.append(best)
    return picked


def test_herding_matches_brute_force_icarl():
    rng = np.random.default_rng(11)
    labels = np.repeat([3, 8], 12)
    features = rng.normal(size=(24, 5)) + labels[:, None] * 0.3
    indices = 500 + np.arange(24)
    memory = update_memory(None, indices, labels, labels, task=0, per_class=6, strategy="herding",
                           features=features, seed=0)
    for label in (3, 8):
        rows = np.flatnonzero(labels == label)
        expected = indices[rows[_brute_force_herding(features[rows], 6)]]
        assert memory.indices[memory.labels == label].tolist() == expected.tolist()


def test_update_memory_errors():
    indices, labels, slots = _task_data()
    with pytest.raises(ValueError, match="needs features"):
        update_memory(None, indices, labels, slots, task=0, per_class=5, strategy="herding")
    with pytest.raises(ValueError, match=r"features must have shape \(60, D\)"):
        update_memory(None, indices, labels, slots, task=0, per_class=5, strategy="herding", features=np.ones((3, 2)))
    with pytest.raises(ValueError, match="strategy"):
        update_memory(None, indices, labels, slots, task=0, per_class=5, strategy="greedy")
    with pytest.raises(ValueError, match="per_class"):
        update_memory(None, indices, labels, slots, task=0, per_class=0)
    with pytest.raises(ValueError, match="equal lengths"):
        update_memory(None, indices, labels[:-1], slots, task=0, per_class=5)


TASK = np.arange(100)
MEMORY = 1000 + np.arange(30)


def test_every_batch_is_half_memory_half_task():
    batches = list(half_and_half_batches(TASK, MEMORY, batch_size=16, seed=0, drop_last=False))
    # 100 task samples, 8 per batch: 12 full batches + one of 4 task + 4 memory samples.
    assert len(batches) == 13 == half_and_half_num_batches(100, 30, 16, drop_last=False)
    for batch in batches:
        half = batch.size // 2
        assert np.isin(batch[:half], MEMORY).all() and np.isin(batch[half:], TASK).all()
    assert [b.size for b in batches] == [16] * 12 + [8]
    task_seen = np.concatenate([b[b.size // 2:] for b in batches])
    np.testing.assert_array_equal(np.sort(task_seen), TASK)  # one epoch = one pass over the task data
    memory_seen = np.concatenate([b[: b.size // 2] for b in batches])
    counts = np.bincount(memory_seen - 1000, minlength=30)
    assert counts.sum() == 100 and counts.max() - counts.min() <= 1  # 100 draws over 30 samples: 3 or 4 each


def test_drop_last_and_empty_memory():
    dropped = list(half_and_half_batches(TASK, MEMORY, batch_size=16, seed=0))
    assert len(dropped) == 12 and all(b.size == 16 for b in dropped)
    plain = list(half_and_half_batches(TASK, [], batch_size=16, seed=0))
    assert len(plain) == 6 and all(b.size == 16 for b in plain)  # 100 // 16
    assert np.unique(np.concatenate(plain)).size == 96
    tiny = list(half_and_half_batches(np.arange(5), MEMORY, batch_size=16, seed=0))
    assert len(tiny) == 1 and tiny[0].size == 10  # the only batch is kept, still half/half


def test_batches_are_seeded_per_epoch_so_resuming_repeats_them():
    two = list(half_and_half_batches(TASK, MEMORY, 16, seed=4, epochs=2))
    first = list(half_and_half_batches(TASK, MEMORY, 16, seed=4, epochs=1))
    resumed = list(half_and_half_batches(TASK, MEMORY, 16, seed=4, epochs=1, first_epoch=1))
    assert len(two) == 24
    assert all(np.array_equal(a, b) for a, b in zip(two, first + resumed))
    assert not np.array_equal(two[0], two[12])
    other = list(half_and_half_batches(TASK, MEMORY, 16, seed=5))
    assert not np.array_equal(other[0], first[0])


def test_reference_epoch_length():
    batches = list(half_and_half_batches(TASK, MEMORY, 16, seed=0, epoch_length="reference"))
    assert len(batches) == (100 + 30) // 16 == 8
    for batch in batches:
        assert np.isin(batch[:8], MEMORY).all() and np.isin(batch[8:], TASK).all()
        assert np.unique(batch[:8]).size == 8 and np.unique(batch[8:]).size == 8


def test_reference_small_sides_follow_the_public_sampler():
    """The public BalancedBatchSampler's rule worked by hand: (task + memory) // batch batches (one when that is
    0, then (task + memory) // 2 per side); a side holding <= the samples it gives is drawn with replacement."""
    task, memory = np.arange(10), 100 + np.arange(3)
    # batch 8: (10 + 3) // 8 = 1 batch of 4 + 4; memory holds 3 <= 4 -> with replacement (a repeat is forced),
    # task holds 10 > 4 -> without replacement
    batches = list(half_and_half_batches(task, memory, 8, seed=0, epochs=3, epoch_length="reference"))
    assert len(batches) == 3 and half_and_half_num_batches(10, 3, 8, "reference") == 1
    for batch in batches:
        assert batch.size == 8 and np.isin(batch[:4], memory).all() and np.isin(batch[4:], task).all()
        assert np.unique(batch[:4]).size <= 3 and np.unique(batch[4:]).size == 4
    # batch 16: 13 // 16 = 0 -> one batch of 13 // 2 = 6 per side; memory 3 <= 6 and task 10 > 6
    tiny = list(half_and_half_batches(task, memory, 16, seed=0, epoch_length="reference"))
    assert len(tiny) == 1 == half_and_half_num_batches(10, 3, 16, "reference")
    assert tiny[0].size == 12 and np.isin(tiny[0][:6], memory).all() and np.unique(tiny[0][6:]).size == 6
    # a side holding exactly batch / 2 samples is drawn with replacement too (the public rule is <=): over 20
    # batches of 4 draws from 4 samples, some batch repeats one (all-distinct has probability 4!/4^4 each)
    equal = list(half_and_half_batches(np.arange(40), 100 + np.arange(4), 8, seed=1, epoch_length="reference",
                                       epochs=4))
    assert len(equal) == 4 * (44 // 8) == 20
    assert any(np.unique(batch[:4]).size < 4 for batch in equal)
    assert all(np.unique(batch[4:]).size == 4 for batch in equal)


def test_sampler_errors():
    with pytest.raises(ValueError, match="even integer"):
        list(half_and_half_batches(TASK, MEMORY, 15))
    with pytest.raises(ValueError, match="task_indices is empty"):
        list(half_and_half_batches([], MEMORY, 16))
    with pytest.raises(ValueError, match="epoch_length"):
        list(half_and_half_batches(TASK, MEMORY, 16, epoch_length="memory"))

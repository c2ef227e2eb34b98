"""Task sequences: the increments grammar, seeded orders, the open-set guard, task sample selection."""
from __future__ import annotations

import numpy as np
import pytest

from compat_core.data.tasks import build_task_sequence, check_open_set, parse_increments, select_class_samples


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("10+6x15", [10, 15, 15, 15, 15, 15, 15]),
        ("16x512", [512] * 16),
        ("10+1x90", [10, 90]),
        (" 10 + 6 x 15 ", [10, 15, 15, 15, 15, 15, 15]),
        ("50", [50]),
        ("60+2x10+5", [60, 10, 10, 5]),
    ],
)
def test_parse_increments(spec, expected):
    assert parse_increments(spec) == expected


def test_parse_thirty_one_tasks():
    sizes = parse_increments("10+30x3")
    assert len(sizes) == 31 and sizes[0] == 10 and set(sizes[1:]) == {3} and sum(sizes) == 100


@pytest.mark.parametrize("bad", ["10+", "6x", "x5", "10-5", "abc", "10+6x15x2", "1.5", "10++5"])
def test_bad_syntax_names_text_and_grammar(bad):
    with pytest.raises(ValueError) as error:
        parse_increments(bad)
    message = str(error.value)
    assert repr(bad) in message and "RxN" in message


@pytest.mark.parametrize("bad", ["0", "10+0x5", "10+3x0"])
def test_empty_tasks_are_refused(bad):
    with pytest.raises(ValueError, match="at least one task of at least one class"):
        parse_increments(bad)


def test_empty_and_non_string_specs():
    with pytest.raises(ValueError, match="empty"):
        parse_increments("  ")
    with pytest.raises(ValueError, match="must be a string"):
        parse_increments(10)


def test_sequence_partitions_the_seeded_order():
    pool = np.arange(200, 320)  # 120 classes, 100 used
    sequence = build_task_sequence(pool, "10+6x15", seed=3)
    assert sequence.num_tasks == 7 and sequence.num_classes == 100
    assert [len(task) for task in sequence.tasks] == [10] + [15] * 6
    used = np.concatenate(sequence.tasks)
    np.testing.assert_array_equal(used, sequence.class_order[:100])
    assert np.unique(used).size == 100 and set(used.tolist()) <= set(pool.tolist())
    np.testing.assert_array_equal(np.sort(sequence.class_order), pool)
    # The seeded order is numpy's permutation of the sorted pool.
    np.testing.assert_array_equal(sequence.class_order, np.random.default_rng(3).permutation(pool))


def test_seeded_order_ignores_input_order_and_depends_on_seed():
    pool = np.arange(50)
    a = build_task_sequence(pool, "10+4x10", seed=7)
    b = build_task_sequence(pool[::-1].copy(), "10+4x10", seed=7)
    c = build_task_sequence(pool, "10+4x10", seed=8)
    np.testing.assert_array_equal(a.class_order, b.class_order)
    assert not np.array_equal(a.class_order, c.class_order)


def test_given_order_is_kept():
    order = np.array([5, 3, 9, 1, 7, 2])
    sequence = build_task_sequence(order, "2+2x2", order="given")
    assert [task.tolist() for task in sequence.tasks] == [[5, 3], [9, 1], [7, 2]]


def test_too_few_classes_and_bad_pools():
    with pytest.raises(ValueError, match="need 100 classes .* only 50"):
        build_task_sequence(np.arange(50), "10+6x15", seed=0)
    with pytest.raises(ValueError, match="distinct"):
        build_task_sequence(np.array([1, 2, 2, 3]), "2x2")
    with pytest.raises(ValueError, match="order must be"):
        build_task_sequence(np.arange(10), "2x2", order="sorted")
    with pytest.raises(ValueError, match="integer class ids"):
        build_task_sequence(np.array([0.5, 1.5]), "2")


def test_open_set_guard_lists_the_overlap():
    check_open_set([0, 1, 2], [3, 4])
    with pytest.raises(ValueError) as error:
        check_open_set(np.array([1, 2, 3, 7]), np.array([7, 8, 3]), train_name="finetune", test_name="gallery")
    message = str(error.value)
    assert "[3, 7]" in message and "2 class id(s)" in message and "finetune" in message and "gallery" in message


def test_open_set_guard_truncates_long_lists():
    with pytest.raises(ValueError, match=r"and 5 more"):
        check_open_set(np.arange(25), np.arange(25))


def test_select_class_samples():
    labels = np.array([0, 1, 2, 1, 0, 3])
    assert select_class_samples(labels, [1, 3]).tolist() == [1, 3, 5]
    assert select_class_samples(labels, np.array([9])).tolist() == []

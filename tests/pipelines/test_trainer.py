"""The trainer's steps (pipelines.training.trainer): epoch plans from a resume point, loop statistics, resume from a
checkpoint, when checkpoints are due, and which epoch is kept."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from compat_core.models.compat_model import frozen_copy
from pipelines.methods import get_method
from pipelines.training.checkpoints import CheckpointPolicy, EpochCheckpoint, decode_state, encode_state
from pipelines.training.distributed import DataParallel
from pipelines.training.records import _Window
from pipelines.training.task_data import epoch_batches
from pipelines.training.trainer import EpochPlan, LoopStatistics, ResumePoint, Trainer, plan_epochs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_training import config, source, task_data, tiny_model  # noqa: E402,F401


class MemorySink:
    """Checkpoints kept in memory; ``latest`` is what a restarted stage would find."""

    def __init__(self, every: int | None, latest=None) -> None:
        self.policy = CheckpointPolicy(every)
        self.saved: list = []
        self.latest = latest

    def load_latest(self):
        return self.latest

    def save(self, checkpoint) -> None:  # through bytes, as a store keeps it (the state holds live tensors)
        self.saved.append(EpochCheckpoint(checkpoint.epochs_done, decode_state(encode_state(checkpoint.state))))


def _positions(plans: list[EpochPlan]) -> list[list[list[int]]]:
    return [[batch.tolist() for batch in plan.local] for plan in plans]


def test_a_fresh_plan_runs_every_batch_of_every_epoch(source):
    data, method = task_data(source, "simplex"), get_method("dsimplex-hoc")
    cfg = config(epochs=3)
    plans = plan_epochs(data, method, cfg, ResumePoint())
    assert [(plan.epoch, plan.skip) for plan in plans] == [(0, 0), (1, 0), (2, 0)]
    expected = [[b.tolist() for b in epoch_batches(data, method, cfg, epoch)] for epoch in range(3)]
    assert _positions(plans) == expected
    assert [[b.tolist() for b in plan.batches] for plan in plans] == expected


def test_a_resumed_plan_skips_only_the_steps_done_in_its_first_epoch(source):
    """Resumed after 2 steps of epoch 1 (0-based) of 3: epoch 0 is not planned, epoch 1 runs its batches from the
    third on (its global batch list stays whole: the step numbers count from it), epoch 2 runs whole."""
    data, method = task_data(source, "simplex"), get_method("dsimplex-hoc")
    cfg = config(epochs=3)
    plans = plan_epochs(data, method, cfg, ResumePoint(epoch=1, step_in_epoch=2, from_checkpoint=1))
    one, two = ([b.tolist() for b in epoch_batches(data, method, cfg, epoch)] for epoch in (1, 2))
    assert len(one) == 6  # 24 task + 6 memory samples, half-and-half batches of 8: 6 steps an epoch
    assert [(plan.epoch, plan.skip) for plan in plans] == [(1, 2), (2, 0)]
    assert _positions(plans) == [one[2:], two]
    assert [b.tolist() for b in plans[0].batches] == one


def test_a_rank_plans_its_rows_of_each_remaining_global_batch(source):
    """Rank 1 of 3: rows [3, 6) of a global batch of 8 (sizes 3, 3, 2), of every batch still to run."""
    data, method = task_data(source, "simplex"), get_method("dsimplex-hoc")
    cfg = config(epochs=1)
    plan, = plan_epochs(data, method, cfg, ResumePoint(step_in_epoch=4), DataParallel(rank=1, world=3))
    batches = [b.tolist() for b in epoch_batches(data, method, cfg, 0)]
    assert [b.tolist() for b in plan.local] == [batch[3:6] for batch in batches[4:]]


def test_loop_statistics_sum_steps_and_travel_through_a_checkpoint():
    stats = LoopStatistics()
    assert stats.images_per_s == 0.0  # no step yet: no division by zero
    stats.step = 2
    stats.add_step(8, 0.5)
    stats.add_step(4, 0.25)
    assert (stats.train_images, stats.train_seconds, stats.images_per_s) == (12, 0.75, 16.0)
    stats.add_checkpoint(0.5)
    stats.add_checkpoint(1.5)
    assert (stats.checkpoints_written, stats.checkpoint_seconds) == (2, 2.0)
    window = _Window()
    window.add(torch.tensor(3.0), {"ce": torch.tensor(1.0)}, 8, 0.5)
    extras = stats.checkpoint_extras(window)
    assert set(extras) == {"train_seconds", "train_images", "window"} and extras["window"]["count"] == 1
    restored = LoopStatistics()
    restored.restore(2, extras)
    assert (restored.step, restored.train_images, restored.train_seconds) == (2, 12, 0.75)
    # what this process did is not carried: a restarted stage counts its own first step and checkpoints
    assert (restored.first_step_seconds, restored.checkpoints_written, restored.checkpoint_seconds) == (None, 0, 0.0)


def test_resume_restores_the_position_statistics_and_records_of_a_checkpoint(source):
    """A run saving after each epoch (3 epochs of 6 steps): a restart given its epoch-1 checkpoint starts at epoch
    1 step 0 with the step count, the record of epoch 0 (re-emitted) and the throughput totals of that moment."""
    data, method = task_data(source, "simplex"), get_method("dsimplex-hoc")
    old = frozen_copy(tiny_model(seed=1))
    sink = MemorySink(every=1)
    first = Trainer(tiny_model(seed=0), old, method, data, config(epochs=3), checkpoints=sink)
    first.fit()
    assert [c.epochs_done for c in sink.saved] == [1, 2]  # none after the last epoch: the stage commits then
    checkpoint = sink.saved[0]
    emitted = []
    restarted = Trainer(tiny_model(seed=0), old, get_method("dsimplex-hoc"), data, config(epochs=3),
                        on_record=emitted.append, checkpoints=MemorySink(every=1, latest=checkpoint))
    restarted.prepare()
    start = restarted.resume()
    assert start == ResumePoint(epoch=1, step_in_epoch=0, from_checkpoint=1)
    assert restarted.stats.step == 6
    assert restarted.stats.train_images == checkpoint.state["extras"]["train_images"] == 6 * 8
    assert [(r.epoch, r.step, r.loss) for r in emitted] == [(0, 6, first.records[0].loss)]
    assert restarted.records == emitted


def test_resume_without_a_checkpoint_starts_at_the_beginning(source):
    trainer = Trainer(tiny_model(seed=0), None, get_method("dsimplex-hoc"), task_data(source, "simplex"),
                      config(epochs=2), checkpoints=MemorySink(every=1))
    trainer.prepare()
    assert trainer.resume() == ResumePoint() and trainer.stats.step == 0 and trainer.records == []


@pytest.mark.parametrize("every, preempted, expected", [
    (1, False, [True, True, False]),   # every epoch end but the last (the stage commits after it)
    (2, False, [False, True, False]),
    (10, True, [True, True, True]),    # SIGTERM: always, the last epoch too
    (None, False, [False, False, False]),  # by time (10 minutes): not in a short test
])
def test_checkpoints_are_due_by_policy_never_after_the_last_epoch_but_always_on_sigterm(source, every, preempted,
                                                                                         expected):
    trainer = Trainer(tiny_model(), None, get_method("dsimplex-hoc"), task_data(source, "simplex"), config(epochs=3),
                      checkpoints=MemorySink(every))
    assert [trainer._checkpoint_due(done, preempted) for done in (1, 2, 3)] == expected
    without = Trainer(tiny_model(), None, get_method("dsimplex-hoc"), task_data(source, "simplex"), config(epochs=3))
    assert [without._checkpoint_due(done, True) for done in (1, 2, 3)] == [False, False, False]


def test_the_selected_epoch_is_the_selectors_best_else_the_last(source):
    trainer = Trainer(tiny_model(), None, get_method("dsimplex-hoc"), task_data(source, "simplex"), config(epochs=4))
    assert trainer.selected_epoch() == 3

    class Selector:
        best_state, best_epoch = {"w": torch.zeros(1)}, 1

    trainer.selector = Selector()
    assert trainer.selected_epoch() == 1
    Selector.best_state = None  # no epoch qualified: the last one is kept
    assert trainer.selected_epoch() == 3


def test_bad_inputs_are_refused_before_anything_is_prepared(source):
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="config must be a TrainConfig, got dict"):
        Trainer(model, None, get_method("dsimplex-hoc"), task_data(source, "simplex"), {"epochs": 1})
    with pytest.raises(ValueError, match="method must be a pipelines.methods Method, got str"):
        Trainer(model, None, "dsimplex-hoc", task_data(source, "simplex"), config())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

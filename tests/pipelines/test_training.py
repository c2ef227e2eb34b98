"""Tests of the shared training loop (pipelines.training.loop and its trainer, pipelines.training.trainer)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import pipelines.training.loop as training
import pipelines.training.selection as selection
from compat_core.data.source import ArraySource
from compat_core.models.compat_model import create_model, frozen_copy
from pipelines.methods import get_method
from pipelines.methods.objective import Batch, Method, TaskContext
from pipelines.training.loop import pretrain_model, snapshot_state, train_task
from pipelines.training.settings import TrainConfig
from pipelines.training.task_data import SelectionSplit, TaskData, _steps_per_epoch, epoch_batches
from pipelines.training.trainer import lr_factor

K = 16
CLASSES = 6
PER_CLASS = 8


@pytest.fixture(scope="module")
def source() -> ArraySource:
    """6 classes x 8 grey 16x16 images; class c has a bright square at a class-specific place plus noise."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 60, size=(CLASSES * PER_CLASS, 16, 16, 1), dtype=np.uint8)
    labels = np.repeat(np.arange(CLASSES), PER_CLASS)
    for index, label in enumerate(labels):
        row, col = divmod(int(label), 3)
        images[index, 2 + 6 * row : 7 + 6 * row, 1 + 5 * col : 5 + 5 * col] = 230
    return ArraySource(name="squares", images=images, labels=labels, class_names=[str(c) for c in range(CLASSES)],
                       hflip=False)


def tiny_model(classifier: str = "simplex", seed: int = 0, classes: int = 0):
    torch.manual_seed(seed)
    return create_model("cnn4", K, classifier=classifier, backbone_config={"width": 4, "in_chans": 1},
                        num_active_classes=classes)


def task_data(source, classifier: str, task: int = 1, **extra) -> TaskData:
    """Task 1: new classes 3..5 (all their samples), memory: 2 samples of each old class 0..2."""
    labels = source.labels
    indices = np.flatnonzero(labels >= 3)
    memory = np.concatenate([np.flatnonzero(labels == c)[:2] for c in range(3)])
    to_slot = (lambda y: y) if classifier == "learnable" else (lambda y: K - 1 - y)
    return TaskData(source=source, task=task, indices=indices, slots=to_slot(labels[indices]), num_old_classes=3,
                    num_new_classes=3, memory_indices=memory, memory_slots=to_slot(labels[memory]), **extra)


def config(**overrides) -> TrainConfig:
    values = dict(epochs=2, batch_size=8, optimizer={"lr": 0.05}, seed=3, autocast=False)
    values.update(overrides)
    return TrainConfig(**values)


def weights_equal(first, second) -> bool:
    a, b = first.state_dict(), second.state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_same_seed_gives_identical_weights_and_other_seed_does_not(source):
    data = task_data(source, "simplex")
    old = frozen_copy(tiny_model(seed=1))
    results = []
    for seed in (3, 3, 4):
        result = train_task(tiny_model(seed=0), old, get_method("dsimplex-hoc"), data, config(seed=seed, epochs=1))
        results.append(result.model)
    assert weights_equal(results[0], results[1])
    assert not weights_equal(results[0], results[2])
    assert not weights_equal(results[0], tiny_model(seed=0))  # it did train


def test_replay_batches_are_half_memory_half_task(source):
    seen: list[tuple[int, int]] = []

    class Recording(Method):
        name = "recording"
        classifier = "simplex"
        uses_replay = True

        def loss(self, batch: Batch, ctx: TaskContext):
            memory = int(batch.is_memory.sum())
            seen.append((memory, int(batch.is_memory.numel()) - memory))
            # memory samples carry old-class slots, task samples new-class slots
            assert bool((batch.targets[batch.is_memory] > K - 1 - 3).all())
            assert bool((batch.targets[~batch.is_memory] <= K - 1 - 3).all())
            output = ctx.model(batch.images)
            return output.logits.float().logsumexp(dim=1).mean(), {}

    data = task_data(source, "simplex")
    train_task(tiny_model(), None, Recording(), data, config(epochs=1))
    assert seen and all(pair == (4, 4) for pair in seen), seen
    # the positions: task positions < 24 (24 task samples), memory positions 24..29
    for positions in epoch_batches(data, Recording(), config(), 0):
        assert (positions >= data.indices.size).sum() == 4


def test_non_replay_methods_see_each_task_sample_once_per_epoch(source):
    data = task_data(source, "simplex")
    cores = get_method("cores")
    positions = np.concatenate(list(epoch_batches(data, cores, config(batch_size=5), 0)))
    assert sorted(positions.tolist()) == list(range(data.indices.size))  # 24 samples: 4x5 + 4, no memory


def test_records_schedule_and_progress(source):
    records, progress = [], []
    data = task_data(source, "learnable")
    cfg = config(epochs=3, schedule={"name": "cosine"}, optimizer={"lr": 0.1})
    result = train_task(tiny_model("learnable", classes=3), None, get_method("er"), data, cfg,
                        on_record=records.append, progress=lambda *args: progress.append(args))
    steps = _steps_per_epoch(data, get_method("er"), cfg)
    total = 3 * steps
    assert [r.epoch for r in records] == [0, 1, 2]
    assert [r.step for r in records] == [steps, 2 * steps, 3 * steps]
    for record in records:  # lr after the record's last step: 0.1 * 0.5 * (1 + cos(pi * step / total))
        assert record.lr == pytest.approx(0.1 * 0.5 * (1 + math.cos(math.pi * record.step / total)), abs=1e-9)
        assert math.isfinite(record.loss) and "ce" in record.loss_parts and record.images_per_s > 0
    assert len(progress) == total and progress[-1][1:3] == (total, total)
    assert result.selected_epoch == 2 and result.records == records
    assert result.model.classifier.out_features == CLASSES  # grown from 3 to the largest slot + 1


def test_mixed_precision_run_keeps_fp32_weights(source):
    result = train_task(tiny_model(), frozen_copy(tiny_model(seed=1)), get_method("dsimplex-hoc"),
                        task_data(source, "simplex"), config(epochs=1, autocast=True, steps_per_epoch=2))
    assert all(math.isfinite(r.loss) for r in result.records)
    assert all(p.dtype == torch.float32 for p in result.model.parameters())


def test_step_schedule_and_warmup_factors():
    factor = lr_factor(config(epochs=4, schedule={"name": "step", "milestones": [2, 3], "gamma": 0.5},
                              warmup_epochs=1), 10)
    assert [factor(s) for s in (0, 4, 9, 10, 19, 20, 30)] == [0.1, 0.5, 1.0, 1.0, 1.0, 0.5, 0.25]


def test_cores_restarts_from_the_same_initial_weights(source):
    initial = snapshot_state(tiny_model(seed=0))
    cores = get_method("cores")
    labels = source.labels
    first = np.flatnonzero(labels < 3)
    data0 = TaskData(source=source, task=0, indices=first, slots=K - 1 - labels[first], num_old_classes=0,
                     num_new_classes=3, initial_state=initial)
    trained0 = train_task(tiny_model(seed=5), None, cores, data0, config()).model
    assert not weights_equal(trained0, tiny_model(seed=0))
    everything = np.arange(len(source))
    data1 = TaskData(source=source, task=1, indices=everything, slots=K - 1 - labels, num_old_classes=3,
                     num_new_classes=3, initial_state=initial)
    continued = train_task(trained0, frozen_copy(trained0), cores, data1, config()).model
    fresh = train_task(tiny_model(seed=0), None, cores, data1, config()).model
    assert weights_equal(continued, fresh)
    with pytest.raises(ValueError, match="TaskData.initial_state is required"):
        data1.initial_state = None
        train_task(tiny_model(seed=0), None, cores, data1, config())


def test_compatibility_selection_keeps_best_self_test_among_compatible_epochs(source, monkeypatch):
    # scripted Recall@1 values: the old model's self-test, then (self, cross) per epoch
    old_self = 0.5
    per_epoch = [(0.9, 0.4), (0.6, 0.55), (0.7, 0.6), (0.8, 0.5)]
    for strict, expected_epoch in ((True, 2), (False, 3)):
        script = [old_self] + [value for pair in per_epoch for value in pair]
        monkeypatch.setattr(selection, "recall_at_1", lambda *args: script.pop(0))
        snapshots = {}
        model = tiny_model()
        split = SelectionSplit(source, np.arange(0, 48, 2), np.arange(1, 48, 2))
        result = train_task(
            model, frozen_copy(tiny_model(seed=1)), get_method("dsimplex-hoc"),
            task_data(source, "simplex", selection=split),
            config(epochs=4, steps_per_epoch=1, model_selection="compatibility", selection_strict=strict),
            on_record=lambda record: snapshots.setdefault(record.epoch, snapshot_state(model)),
        )
        assert not script
        assert result.selected_epoch == expected_epoch
        assert all(torch.equal(v, snapshots[expected_epoch][k]) for k, v in result.model.state_dict().items())
        assert [h["selection_compatible"] for h in result.selection] == [0.0, 1.0, 1.0, float(not strict)]
        assert result.selection[1]["selection_cross"] == 0.55


def test_compatibility_selection_runs_real_recall(source):
    split = SelectionSplit(source, np.arange(0, 48, 2), np.arange(1, 48, 2))
    result = train_task(tiny_model(), frozen_copy(tiny_model(seed=1)), get_method("dsimplex-fd"),
                        task_data(source, "simplex", selection=split),
                        config(epochs=2, model_selection="compatibility"))
    for entry in result.selection:
        for key in ("selection_self", "selection_cross", "selection_old_self"):
            assert 0.0 <= entry[key] <= 1.0
            assert entry[key] * 24 == pytest.approx(round(entry[key] * 24))  # a count out of 24 queries


def test_fan_exports_its_adapter(source):
    result = train_task(tiny_model("learnable", classes=6), frozen_copy(tiny_model("learnable", 1, 3)),
                        get_method("fan", adapter_hidden=8), task_data(source, "learnable"), config(epochs=1))
    assert set(result.extra_state) == {"adapter"}
    assert result.extra_state["adapter"].state_dict()["0.weight"].shape == (8, K - 1)


def test_pretrain_model_uses_left_to_right_slots(source):
    seen_targets = []
    original = training.SupervisedPretraining.loss

    def spy(self, batch, ctx):
        seen_targets.append(batch.targets.clone())
        return original(self, batch, ctx)

    training.SupervisedPretraining.loss = spy
    try:
        result = pretrain_model(tiny_model(), source, np.arange(len(source)), config(epochs=1))
    finally:
        training.SupervisedPretraining.loss = original
    assert sorted(torch.cat(seen_targets).unique().tolist()) == list(range(CLASSES))
    assert result.model.features(torch.zeros(2, 1, 16, 16)).shape == (2, K - 1)


def test_validation_names_the_field(source):
    with pytest.raises(ValueError, match=r"TrainConfig\noptimizer.name\n  Input should be 'sgd' or 'adamw'"):
        TrainConfig(optimizer={"name": "adam"})
    with pytest.raises(ValueError, match=r"TrainConfig\n  Value error, warmup_epochs must be < epochs \(2\)"):
        TrainConfig(epochs=2, warmup_epochs=2)
    with pytest.raises(ValueError, match="TaskData.indices and slots must have the same length"):
        TaskData(source=source, task=0, indices=[0, 1], slots=[0], num_old_classes=0, num_new_classes=1)
    with pytest.raises(ValueError, match="needs a model with classifier='learnable'"):
        train_task(tiny_model("simplex"), None, get_method("er"), task_data(source, "learnable"), config())
    with pytest.raises(ValueError, match="needs TaskData.selection"):
        train_task(tiny_model(), None, get_method("dsimplex-hoc"), task_data(source, "simplex"),
                   config(model_selection="compatibility"))


def _host_reads_during_training(source, monkeypatch, steps: int) -> int:
    """How many times a tensor value is read back to the host while training ``steps`` steps of one epoch."""
    reads = {"count": 0}
    for name in ("item", "tolist", "__float__", "__bool__", "__int__"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, **kwargs):
            reads["count"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    data = task_data(source, "simplex")
    train_task(tiny_model(), None, get_method("dsimplex-hoc"), data, config(epochs=1, batch_size=4, steps_per_epoch=steps))
    monkeypatch.undo()
    return reads["count"]


def test_training_steps_do_not_read_values_back_to_the_host(source, monkeypatch):
    # the loss, its parts and the finiteness check stay on the device; only the per-epoch record reads them
    few = _host_reads_during_training(source, monkeypatch, steps=2)
    many = _host_reads_during_training(source, monkeypatch, steps=6)
    assert few == many


def test_non_finite_loss_is_reported_at_the_record(source):
    class Exploding(Method):
        name = "exploding"
        classifier = "simplex"

        def loss(self, batch, ctx):
            output = ctx.model(batch.images)
            value = output.logits.sum() * float("inf")
            return value, {"ce": value.detach()}

    with pytest.raises(FloatingPointError, match=r"non-finite loss in 3 of the 3 steps ending at step 3.*lower training.optimizer.lr"):
        train_task(tiny_model(), None, Exploding(), task_data(source, "simplex"),
                   config(epochs=1, batch_size=4, steps_per_epoch=3))


def test_streaming_workers_give_the_same_weights_as_reading_in_the_loop(source):
    data = task_data(source, "simplex")
    inline = train_task(tiny_model(), None, get_method("dsimplex-hoc"), data, config(input_workers=0)).model
    streamed = train_task(tiny_model(), None, get_method("dsimplex-hoc"), data,
                          config(input_workers=2, prefetch_batches=1)).model
    assert weights_equal(inline, streamed)


class _PidRecordingSource:
    """``source`` whose reads record the reading process id in shared memory (one slot per read)."""

    def __init__(self, source, slots: int = 64) -> None:
        self.source, self.count = source, 0
        self.pids = torch.zeros(slots, dtype=torch.int64).share_memory_()
        for name in ("labels", "class_names", "image_shape", "mean", "std", "hflip", "name"):
            setattr(self, name, getattr(source, name))

    def __len__(self) -> int:
        return len(self.source)

    def read(self, indices):
        import os

        self.pids[self.count] = os.getpid()  # each worker counts its own reads: 1 worker -> slots in read order
        self.count += 1
        return self.source.read(indices)


def test_input_workers_start_once_for_all_epochs_and_read_every_batch(source):
    """One input stream over the task's epochs: the worker process is forked once (not per epoch), it reads
    every batch of every epoch, and the weights equal reading in the loop."""
    import os

    data = task_data(source, "simplex")
    watched = _PidRecordingSource(source)
    streamed = train_task(tiny_model(), None, get_method("dsimplex-hoc"), task_data(watched, "simplex"),
                          config(epochs=3, input_workers=1)).model
    steps = 3 * sum(1 for _ in epoch_batches(data, get_method("dsimplex-hoc"), config(epochs=3), 0))
    pids = watched.pids[: steps + 1].tolist()
    assert pids[steps] == 0 and 0 not in pids[:steps]           # every step's batch read, nothing more
    assert len(set(pids[:steps])) == 1 and pids[0] != os.getpid()  # by one worker process, forked once
    inline = train_task(tiny_model(), None, get_method("dsimplex-hoc"), data, config(epochs=3)).model
    assert weights_equal(inline, streamed)

"""The training options that follow the public IAM-CL2R script: cosine per epoch to a floor, no weight decay on
norm/bias parameters, a dropped last partial batch, a replayed batch plan, fp64 batches and logits."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from compat_core.data.source import ArraySource
from compat_core.data.transforms import make_transforms
from compat_core.models.compat_model import create_model
from pipelines.training.settings import TrainConfig
from pipelines.training.task_data import TaskData, epoch_batches
from pipelines.training.trainer import lr_factor, make_optimizer, parameter_groups


class _Sampling:
    uses_replay = False


def _source(n: int = 10) -> ArraySource:
    images = np.arange(n * 4 * 4 * 3, dtype=np.int64).reshape(n, 4, 4, 3).astype(np.uint8)
    return ArraySource(name="tiny", images=images, labels=np.arange(n) % 2, class_names=["a", "b"],
                       mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))


def test_cosine_per_epoch_to_a_floor_equals_torch_cosine_annealing_stepped_per_epoch():
    config = TrainConfig(optimizer={"lr": 0.001}, schedule={"name": "cosine", "min_lr": 1e-5, "interval": "epoch"},
                         epochs=7)
    steps_per_epoch = 3
    factor = lr_factor(config, steps_per_epoch)
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=0.001)
    reference = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=7, eta_min=1e-5)
    for epoch in range(7):
        for in_epoch in range(steps_per_epoch):
            assert 0.001 * factor(epoch * steps_per_epoch + in_epoch) == pytest.approx(
                optimizer.param_groups[0]["lr"], rel=1e-12)
        optimizer.step()  # no gradient: nothing moves; keeps torch's optimiser-then-scheduler order
        reference.step()
    # hand value: epoch 1 of 2 at lr 1e-3 -> 1e-5 + (1e-3 - 1e-5) / 2 = 5.05e-4
    half = lr_factor(config.model_copy(update={"epochs": 2}), 1)(1) * 0.001
    assert half == pytest.approx(5.05e-4, rel=1e-12)


def test_cosine_per_step_keeps_its_values_without_a_floor():
    config = TrainConfig(schedule={"name": "cosine"}, epochs=2)
    factor = lr_factor(config, 5)
    assert [factor(s) for s in (0, 5, 9)] == pytest.approx(
        [1.0, 0.5 * (1 + math.cos(math.pi * 5 / 10)), 0.5 * (1 + math.cos(math.pi * 9 / 10))])


@pytest.mark.parametrize("schedule, message", [
    ({"name": "constant", "min_lr": 1e-5}, "cosine schedule only"),
    ({"name": "step", "milestones": [1], "interval": "epoch"}, "cosine schedule only"),
])
def test_floor_and_interval_belong_to_the_cosine_schedule(schedule, message):
    with pytest.raises(ValidationError, match=message):
        TrainConfig(schedule=schedule, epochs=2)


def test_floor_below_the_learning_rate():
    with pytest.raises(ValidationError, match="min_lr"):
        TrainConfig(optimizer={"lr": 0.01}, schedule={"name": "cosine", "min_lr": 0.01}, epochs=2)


def test_norm_and_bias_parameters_get_no_weight_decay():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2, bias=False))
    config = TrainConfig(optimizer={"lr": 0.5, "momentum": 0.0, "weight_decay": 0.1,
                                    "weight_decay_exclude": "norm_and_bias"})
    groups = parameter_groups(list(model.named_parameters()), config)
    assert [len(g["params"]) for g in groups] == [3, 2]  # 0.bias, 1.weight, 1.bias | 0.weight, 2.weight
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = make_optimizer(groups, config)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # zero gradients: only weight decay moves a parameter, w <- w - lr * wd * w
    for name, p in model.named_parameters():
        expected = before[name] * (1 - 0.5 * 0.1) if name in ("0.weight", "2.weight") else before[name]
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-7)
    plain = parameter_groups(list(model.named_parameters()), TrainConfig())
    assert len(plain) == 1 and len(plain[0]["params"]) == 5


def test_drop_last_drops_the_partial_batch_of_a_task_without_replay():
    data = TaskData(source=_source(), task=0, indices=np.arange(10), slots=np.zeros(10), num_old_classes=0,
                    num_new_classes=2)
    kept = [b.size for b in epoch_batches(data, _Sampling(), TrainConfig(batch_size=4), 0)]
    dropped = [b.size for b in epoch_batches(data, _Sampling(), TrainConfig(batch_size=4, drop_last=True), 0)]
    assert kept == [4, 4, 2] and dropped == [4, 4]


def test_a_batch_plan_replaces_the_sampler_and_is_checked():
    plan = [[np.array([0, 1]), np.array([2, 3, 9])], [np.array([4, 5]), np.array([6, 7])]]
    data = TaskData(source=_source(), task=0, indices=np.arange(8), slots=np.zeros(8), num_old_classes=0,
                    num_new_classes=2, memory_indices=np.array([8, 9]), memory_slots=np.zeros(2), batch_plan=plan)
    assert [b.tolist() for b in epoch_batches(data, _Sampling(), TrainConfig(batch_size=4), 1)] == [[4, 5], [6, 7]]
    with pytest.raises(ValueError, match="epoch 2"):
        list(epoch_batches(data, _Sampling(), TrainConfig(), 2))
    with pytest.raises(ValueError, match=r"in \[0, 10\)"):
        TaskData(source=_source(), task=0, indices=np.arange(8), slots=np.zeros(8), num_old_classes=0,
                 num_new_classes=2, memory_indices=np.array([8, 9]), memory_slots=np.zeros(2),
                 batch_plan=[[np.array([0, 10])]])
    with pytest.raises(ValueError, match="same number of batches"):
        TaskData(source=_source(), task=0, indices=np.arange(8), slots=np.zeros(8), num_old_classes=0,
                 num_new_classes=2, batch_plan=[[np.array([0, 1])], [np.array([0, 1]), np.array([2, 3])]])


def test_fp64_default_dtype_gives_fp64_batches_and_logits():
    images = torch.tensor([[[[0, 51, 255]]]], dtype=torch.uint8)  # (1, 1, 1, 3)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = make_transforms(((0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761)), train=False)(images)
        torch.manual_seed(0)
        model = create_model("cnn4", 8)
        logits = model(torch.zeros(2, 3, 32, 32)).logits
    finally:
        torch.set_default_dtype(previous)
    assert out.dtype == torch.float64
    expected = [(0 / 255 - 0.5071) / 0.2675, (51 / 255 - 0.4867) / 0.2565, (255 / 255 - 0.4408) / 0.2761]
    assert out.flatten().tolist() == pytest.approx(expected, rel=1e-15, abs=1e-15)
    assert logits.dtype == torch.float64
    fp32 = make_transforms(((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)), train=False)(images)
    assert fp32.dtype == torch.float32


def test_pool_normalisation_override_replaces_the_readers_statistics(tmp_path):
    import sys
    from pathlib import Path

    sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))  # appended: never shadows a package
    from parity.cifar_pool import PoolShape, write_cifar_pool
    from pipelines.config.schema import PoolSpec
    from pipelines.stages.pools import load_pool

    write_cifar_pool(tmp_path, PoolShape(classes=2, train_per_class=3, test_per_class=1), seed=0)
    public = {"mean": [0.5071, 0.4867, 0.4408], "std": [0.2675, 0.2565, 0.2761]}
    pool = load_pool(PoolSpec(dataset="cifar10", root=str(tmp_path), split="test", normalize=public))
    plain = load_pool(PoolSpec(dataset="cifar10", root=str(tmp_path), split="test"))
    assert pool.mean == tuple(public["mean"]) and pool.std == tuple(public["std"])
    assert plain.mean == (0.4914, 0.4822, 0.4465)  # the reader's own, untouched
    assert np.array_equal(pool.read(np.arange(len(pool))), plain.read(np.arange(len(plain))))
    with pytest.raises(ValueError, match="3 channels"):
        load_pool(PoolSpec(dataset="cifar10", root=str(tmp_path), split="test", normalize={"mean": [0.5], "std": [0.2]}))
    with pytest.raises(ValidationError, match="one value per channel"):
        PoolSpec(dataset="cifar10", normalize={"mean": [0.5, 0.5], "std": [0.2]})
    with pytest.raises(ValidationError, match="std values be > 0"):
        PoolSpec(dataset="cifar10", normalize={"mean": [0.5], "std": [0.0]})


def test_the_new_options_are_in_the_training_stage_key():
    from pipelines.stages.inputs import TrainRecipe

    base = TrainRecipe.of(TrainConfig())
    for changed in (TrainConfig(drop_last=True), TrainConfig(optimizer={"weight_decay_exclude": "norm_and_bias"}),
                    TrainConfig(schedule={"name": "cosine", "min_lr": 1e-5, "interval": "epoch"})):
        assert TrainRecipe.of(changed).model_dump(mode="json") != base.model_dump(mode="json")

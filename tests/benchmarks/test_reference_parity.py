"""The parts of benchmarks/reference_parity.py that need no clone of the public code: the CIFAR-format pool through
our readers, the weight layout both ways (a forward of each layout equal), the plan's sampling rules, the per-step
comparator, and the message when --reference is missing."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT / "benchmarks"))  # appended: benchmarks/cluster.py must not shadow the cluster package

from compat_core.data.datasets import load_dataset  # noqa: E402
from compat_core.models.compat_model import create_model  # noqa: E402
from compat_core.models.weights import load_external_weights  # noqa: E402
from parity.cifar_pool import PoolShape, write_cifar_pool  # noqa: E402
from parity.plan import PlanShape, make_plan, steps  # noqa: E402
from parity.traces import compare_traces, format_table  # noqa: E402
from parity.weight_layout import public_state  # noqa: E402


def _hwc(rows: np.ndarray) -> np.ndarray:
    """(N, 3072) planar CIFAR rows -> (N, 32, 32, 3), written out independently of the reader."""
    return rows.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)


def test_pool_round_trips_through_our_cifar_readers(tmp_path):
    shape = PoolShape(classes=3, train_per_class=5, test_per_class=2, cifar10_train_per_class=2,
                      cifar10_test_per_class=1)
    written = write_cifar_pool(tmp_path, shape, seed=3)
    train = load_dataset("cifar100", str(tmp_path), "train")
    assert np.array_equal(train.images, _hwc(written["cifar100_train"]))
    assert train.labels.tolist() == [0] * 5 + [1] * 5 + [2] * 5
    assert len(train.class_names) == 100
    test = load_dataset("cifar100", str(tmp_path), "test")
    assert np.array_equal(test.images, _hwc(written["cifar100_test"]))
    reduced = load_dataset("cifar100r", str(tmp_path), "train", per_class=4)  # the first 4 of each class
    assert np.array_equal(reduced.images, _hwc(written["cifar100_train"][[0, 1, 2, 3, 5, 6, 7, 8, 10, 11, 12, 13]]))
    c10 = load_dataset("cifar10", str(tmp_path), "train")
    assert np.array_equal(c10.images, _hwc(written["cifar10_train"]))
    assert c10.labels.tolist() == np.repeat(np.arange(10), 2).tolist()
    assert load_dataset("cifar10", str(tmp_path), "test").labels.tolist() == list(range(10))


class _PublicLayout(nn.Module):
    """A model with the public code's key names: backbone (torchvision ResNet18, no fc) + fc1 (+ fc2)."""

    def __init__(self, fc2_rows: int | None) -> None:
        super().__init__()
        self.backbone = torchvision.models.resnet18()
        self.backbone.fc = nn.Identity()
        self.fc1 = nn.Linear(512, 15, bias=False) if fc2_rows is None else nn.Identity()
        self.fc2 = nn.Linear(512, fc2_rows, bias=False) if fc2_rows else None

    def forward(self, x):
        z = self.fc1(self.backbone(x))
        return z if self.fc2 is None else self.fc2(z)


@pytest.mark.parametrize("kind", ["simplex", "learnable"])
def test_weight_layout_forward_equal_both_ways(kind):
    torch.manual_seed(0)
    if kind == "simplex":
        ours = create_model("resnet18", 16)
        public = _PublicLayout(None)
    else:
        ours = create_model("resnet18", 16, classifier="learnable", head="backbone", num_active_classes=3)
        public = _PublicLayout(3)
    ours.eval()
    state = public_state(ours.state_dict())
    if kind == "simplex":
        assert state["fc2.weight"].shape == (1, 15) and not state["fc2.weight"].any()  # the placeholder
        del state["fc2.weight"]
    public.load_state_dict(state, strict=True)
    public.eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = ours.project(x) if kind == "simplex" else ours.logits(x)
        torch.testing.assert_close(public(x), expected, rtol=0, atol=1e-6)
        back = create_model("resnet18", 16) if kind == "simplex" else create_model(
            "resnet18", 16, classifier="learnable", head="backbone", num_active_classes=3)
        report = load_external_weights(back, public_state(ours.state_dict()), key_map="iamcl2r")
        assert report.layout == "iamcl2r"
        back.eval()
        torch.testing.assert_close(back(x).logits, ours(x).logits, rtol=0, atol=0)


def test_plan_follows_the_public_samplers_rules():
    shape = PlanShape(initial=2, increment=2, tasks=3, per_class=10, rehearsal=3, batch_size=8, epochs=2)
    plan = make_plan(shape, seed=0)
    first, second, third = plan["tasks"]
    # task 1: 20 images -> 2 full batches of 8, the last 4 dropped, no position repeated within an epoch
    assert [len(b) for b in first["batches"][0]] == [8, 8]
    assert len(set(sum(first["batches"][0], []))) == 16
    # task 2: 20 task + 6 memory = 26 -> 3 batches, each 4 memory positions (>= 20) then 4 task positions (< 20);
    # the memory side (6 > 4) is drawn without replacement
    assert len(second["memory_rows"]) == 6 and second["memory_labels"] == [0, 0, 0, 1, 1, 1]
    for batch in second["batches"][0]:
        assert all(p >= 20 for p in batch[:4]) and all(p < 20 for p in batch[4:])
        assert len(set(batch[:4])) == 4
    assert len(third["memory_rows"]) == 12 and sorted(set(third["memory_labels"])) == [0, 1, 2, 3]
    assert steps(plan) == 2 * (2 + 3 + 4)  # (20 + 12) // 8 = 4 batches at task 3
    small = make_plan(PlanShape(initial=1, increment=1, tasks=2, per_class=10, rehearsal=2, batch_size=8, epochs=1), 0)
    memory_half = small["tasks"][1]["batches"][0][0][:4]  # 2 memory samples <= 4: drawn with replacement
    assert set(memory_half) <= {10, 11} and len(memory_half) == 4


def _trace(losses, tasks):
    return [{"step": i + 1, "task": t, "loss": v, "lr": 0.001} for i, (v, t) in enumerate(zip(losses, tasks))]


def test_comparator_on_synthetic_traces():
    ours = _trace([2.0, 1.5, 1.25], [0, 0, 1])
    public = _trace([2.0, 1.5 + 2 ** -52, 1.0], [0, 0, 1])  # one ulp of 1.5
    rows, summary = compare_traces(ours, public, [0.0, 1e-15, 2e-3])
    assert [r.loss_diff for r in rows] == [0.0, 2 ** -52, 0.25]
    assert summary.max_loss_diff == pytest.approx(0.25) and summary.worst_loss_step == 3
    assert summary.max_param_diff == 2e-3 and summary.worst_param_step == 3 and summary.steps == 3
    assert "max |loss diff| 2.50e-01 (step 3)" in format_table(rows, summary, "t")
    with pytest.raises(ValueError, match="structure"):
        compare_traces(ours, _trace([2.0, 1.5, 1.0], [0, 1, 1]), [0.0] * 3)
    with pytest.raises(ValueError, match="equal length"):
        compare_traces(ours, public[:2], [0.0] * 3)
    with pytest.raises(ValueError, match="non-finite"):
        compare_traces(ours, _trace([2.0, float("nan"), 1.0], [0, 0, 1]), [0.0] * 3)


@pytest.mark.parametrize("extra", [[], ["--reference", "/nonexistent/clone"]])
def test_missing_reference_says_what_it_needs(extra):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "reference_parity.py"), *extra],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode != 0
    assert "needs --reference PATH" in done.stderr and "git clone https://github.com/miccunifi/iamcl2r" in done.stderr


def test_scenario_config_of_ours_validates_with_the_public_script_options(tmp_path):
    from parity.scenario import PUBLIC_NORMALIZE, metrics, our_config, side_by_side
    from pipelines.config.load import load_config

    paths = [tmp_path / f"model_{i}.safetensors" for i in range(3)]
    config = load_config(our_config(tmp_path, paths, seed=3, epochs=2, batch_size=16))
    assert load_config(our_config(tmp_path, paths, 3, 2, 16, method="er")).method.name == "er"
    assert config.training.schedule.interval == "epoch" and config.training.schedule.min_lr == 1e-5
    assert config.training.optimizer.weight_decay_exclude == "norm_and_bias" and config.training.drop_last
    assert config.evaluation.query_set.normalize.mean == PUBLIC_NORMALIZE["mean"]
    assert [r.at_task for r in config.replacements] == [3, 5] and config.tasks.order == "given"
    matrix = np.array([[0.5, 0.0], [0.6, 0.4]])  # pair (2, 1): 0.6 > 0.5 compatible; AA = (0.5 + 0.6 + 0.4) / 3
    assert metrics(matrix) == pytest.approx((1.0, 0.5))
    assert "0.600" in side_by_side(matrix, matrix, 3)

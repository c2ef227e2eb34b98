"""Losses against direct float64 formula evaluations written out with explicit loops, plus hand-worked cases."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from compat_core.losses import (
    bct_influence_loss,
    compatibility_info_nce,
    feature_distillation_loss,
    feature_distillation_weight,
    hoc_loss,
    simplex_cross_entropy,
)

LABELS_WITH_REPEATS = [0, 1, 0, 2, 1, 1, 3, 0]


# ------------------------------------------------------------------------------------ brute-force references


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def info_nce_loops(new, old, labels, rho, masking):
    batch = len(labels)
    total = 0.0
    for i in range(batch):
        s = [cosine(old[i], new[j]) for j in range(batch)]
        if masking == "standard":
            denominator = math.exp(rho * s[i]) + sum(
                math.exp(rho * s[j]) for j in range(batch) if labels[j] != labels[i]
            )
            total += -math.log(math.exp(rho * s[i]) / denominator)
        elif masking == "paper":  # Eq. 4 as printed: denominator over every j != i, same class included
            denominator = sum(math.exp(rho * s[j]) for j in range(batch) if j != i)
            total += -math.log(math.exp(rho * s[i]) / denominator)
        else:
            total += -rho * s[i] + math.log(
                sum(math.exp(rho * s[j] * (1.0 if labels[j] != labels[i] else 0.0)) for j in range(batch))
            )
    return total / batch


def cross_entropy_loops(logits, labels):
    total = 0.0
    for row, label in zip(logits, labels):
        total += -math.log(math.exp(row[label]) / sum(math.exp(v) for v in row))
    return total / len(labels)


def random_batch(seed, batch=8, dim=5, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    new = torch.randn(batch, dim, generator=generator, dtype=dtype) * 3.0
    old = torch.randn(batch, dim, generator=generator, dtype=dtype) * 0.5
    return new, old


# --------------------------------------------------------------------------------------------------- SCE


def test_sce_hand_worked_uses_all_slots():
    # K=3, logits [ln2, 0, 0]: softmax = [2/4, 1/4, 1/4] (slot 2 is a future slot but still in the denominator).
    logits = torch.tensor([[math.log(2.0), 0.0, 0.0], [math.log(2.0), 0.0, 0.0]], dtype=torch.float64)
    labels = torch.tensor([0, 1])
    # sample 0: -ln(1/2) = ln2; sample 1: -ln(1/4) = 2 ln2; mean 1.5 ln2
    assert simplex_cross_entropy(logits, labels).item() == pytest.approx(1.5 * math.log(2.0), abs=1e-12)


def test_sce_matches_loops_on_random_logits():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(7, 11, generator=generator, dtype=torch.float64) * 4
    labels = torch.tensor([0, 10, 3, 3, 7, 10, 1])
    expected = cross_entropy_loops(logits.numpy(), labels.tolist())
    assert simplex_cross_entropy(logits, labels).item() == pytest.approx(expected, abs=1e-12)
    assert simplex_cross_entropy(logits.float(), labels).item() == pytest.approx(expected, abs=1e-5)


def test_sce_validation():
    with pytest.raises(ValueError, match=r"slot indices in \[0, 3\)"):
        simplex_cross_entropy(torch.zeros(2, 3), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"labels must be a 1-D integer tensor of shape \(2,\)"):
        simplex_cross_entropy(torch.zeros(2, 3), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="integer class indices"):
        simplex_cross_entropy(torch.zeros(2, 3), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"logits must be a 2-D tensor"):
        simplex_cross_entropy(torch.zeros(3), torch.tensor([0, 1, 2]))


# ---------------------------------------------------------------------------------------------- InfoNCE

# old = [[1,0],[0,1]], new = [[1,0],[1,1]] (unnormalised on purpose): s_00 = 1, s_01 = 1/sqrt2, s_10 = 0,
# s_11 = 1/sqrt2, with s_ij = cos(old_i, new_j). rho = 1.
HAND_NEW = torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
HAND_OLD = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)


def test_info_nce_hand_worked_different_labels():
    labels = torch.tensor([0, 1])
    # standard, anchor 0: -ln(e^1/(e^1 + e^0.70711)) = ln(1 + e^-0.29289) = ln(1.74611) = 0.55739
    #           anchor 1: -ln(e^0.70711/(e^0.70711 + e^0)) = ln(1 + e^-0.70711) = ln(1.49307) = 0.40083
    #           mean 0.47911
    standard = compatibility_info_nce(HAND_NEW, HAND_OLD, labels, rho=1.0, masking="standard")
    assert standard.item() == pytest.approx(0.47910964518, abs=1e-10)
    # reference, anchor 0: -1 + ln(e^0 [j=0 same class] + e^0.70711) = -1 + ln(3.02811) = 0.10794
    #            anchor 1: -0.70711 + ln(e^0 [s_10 = 0] + e^0 [j=1 same class]) = -0.70711 + ln2 = -0.01396
    #            mean 0.04699
    reference = compatibility_info_nce(HAND_NEW, HAND_OLD, labels, rho=1.0, masking="reference")
    assert reference.item() == pytest.approx(0.04699035352, abs=1e-10)
    # paper (Eq. 4), anchor 0: -ln(e^1 / e^0.70711) = -0.29289; anchor 1: -ln(e^0.70711 / e^0) = -0.70711
    #        mean -(1 - 1/sqrt2 + 1/sqrt2)/2 = -0.5 exactly
    paper = compatibility_info_nce(HAND_NEW, HAND_OLD, labels, rho=1.0, masking="paper")
    assert paper.item() == pytest.approx(-0.5, abs=1e-12)


def test_info_nce_hand_worked_same_labels():
    labels = torch.tensor([4, 4])
    # standard: no negatives, each anchor sees only its positive: -ln(e^s/e^s) = 0
    assert compatibility_info_nce(HAND_NEW, HAND_OLD, labels, rho=1.0).item() == pytest.approx(0.0, abs=1e-12)
    # reference: both entries of each row are zeroed -> ln(1 + 1) = ln2; (-1 + ln2 + -0.70711 + ln2)/2 = -0.16041
    reference = compatibility_info_nce(HAND_NEW, HAND_OLD, labels, rho=1.0, masking="reference")
    assert reference.item() == pytest.approx(-0.16040621003, abs=1e-10)
    # paper (Eq. 4): the same-class pair stays a negative, so the value is the distinct-label one, -0.5
    paper = compatibility_info_nce(HAND_NEW, HAND_OLD, labels, rho=1.0, masking="paper")
    assert paper.item() == pytest.approx(-0.5, abs=1e-12)


@pytest.mark.parametrize("masking", ["standard", "reference", "paper"])
@pytest.mark.parametrize("rho", [1.0, 5.0, 10.0])
def test_info_nce_matches_loops_with_repeated_labels(masking, rho):
    new, old = random_batch(seed=int(rho) + len(masking))
    expected = info_nce_loops(new.numpy(), old.numpy(), LABELS_WITH_REPEATS, rho, masking)
    labels = torch.tensor(LABELS_WITH_REPEATS)
    got64 = compatibility_info_nce(new, old, labels, rho=rho, masking=masking)
    assert got64.item() == pytest.approx(expected, abs=1e-10)
    got32 = compatibility_info_nce(new.float(), old.float(), labels, rho=rho, masking=masking)
    assert got32.dtype == torch.float32
    assert got32.item() == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("labels", [list(range(8)), LABELS_WITH_REPEATS, [3] * 8],
                         ids=["distinct", "repeats", "one-class"])
def test_paper_masking_is_eq4_as_printed(labels):
    """Eq. 4: the positive is out of the denominator and every j != i is in it, whatever its class, so the value
    does not depend on the labels at all; it equals the fp64 loop with and without same-class pairs."""
    new, old = random_batch(seed=17)
    expected = info_nce_loops(new.numpy(), old.numpy(), labels, 10.0, "paper")
    got = compatibility_info_nce(new, old, torch.tensor(labels), rho=10.0, masking="paper")
    assert got.item() == pytest.approx(expected, abs=1e-10)
    distinct = compatibility_info_nce(new, old, torch.arange(8), rho=10.0, masking="paper")
    assert got.item() == pytest.approx(distinct.item(), abs=1e-12)
    # "standard" keeps the positive in the denominator: standard = mean log(1 + e^{paper_i}) > paper
    standard = compatibility_info_nce(new, old, torch.arange(8), rho=10.0, masking="standard")
    assert standard.item() > distinct.item()


def test_paper_masking_needs_two_samples():
    new, old = random_batch(seed=2, batch=1)
    with pytest.raises(ValueError, match=r"masking 'paper' .* at least 2 samples, got 1"):
        compatibility_info_nce(new, old, torch.tensor([0]), masking="paper")


def test_masking_modes_differ_only_through_same_class_pairs():
    new, old = random_batch(seed=3)
    distinct = torch.arange(8)
    # with all labels distinct, "reference" replaces e^{rho s_ii} by e^0 in the denominator: the modes differ
    standard = compatibility_info_nce(new, old, distinct, rho=5.0)
    reference = compatibility_info_nce(new, old, distinct, rho=5.0, masking="reference")
    assert abs(standard.item() - reference.item()) > 1e-3
    expected = info_nce_loops(new.numpy(), old.numpy(), list(range(8)), 5.0, "reference")
    assert reference.item() == pytest.approx(expected, abs=1e-10)


@pytest.mark.parametrize("masking", ["standard", "reference", "paper"])
def test_info_nce_gradients_exact_and_old_side_constant(masking):
    new, old = random_batch(seed=11, batch=5, dim=3)
    labels = torch.tensor([0, 1, 0, 2, 1])
    new.requires_grad_(True)

    def as_function(new_features):
        return compatibility_info_nce(new_features, old, labels, rho=3.0, masking=masking)

    assert torch.autograd.gradcheck(as_function, (new,))
    old_tracked = old.clone().requires_grad_(True)
    compatibility_info_nce(new, old_tracked, labels, masking=masking).backward()
    assert old_tracked.grad is None  # detached: the old model stays frozen


@pytest.mark.parametrize("masking", ["standard", "reference", "paper"])
def test_info_nce_finite_at_large_rho_and_scale(masking):
    generator = torch.Generator().manual_seed(5)
    new = (torch.randn(64, 32, generator=generator) * 1e4).requires_grad_(True)
    old = torch.randn(64, 32, generator=generator) * 1e-3
    labels = torch.randint(0, 4, (64,), generator=generator)
    loss = compatibility_info_nce(new, old, labels, rho=200.0, masking=masking)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(new.grad).all()


def test_info_nce_under_bf16_autocast_stays_fp32():
    new, old = random_batch(seed=21, dtype=torch.float32)
    labels = torch.tensor(LABELS_WITH_REPEATS)
    expected = info_nce_loops(new.double().numpy(), old.double().numpy(), LABELS_WITH_REPEATS, 10.0, "standard")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = compatibility_info_nce(new, old, labels)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(expected, abs=1e-4)


def test_info_nce_validation():
    new, old = random_batch(seed=0)
    labels = torch.tensor(LABELS_WITH_REPEATS)
    with pytest.raises(ValueError, match=r"masking must be one of \('standard', 'reference', 'paper'\), got 'eq4'"):
        compatibility_info_nce(new, old, labels, masking="eq4")
    with pytest.raises(ValueError, match="rho"):
        compatibility_info_nce(new, old, labels, rho=0.0)
    with pytest.raises(ValueError, match="same shape"):
        compatibility_info_nce(new, old[:, :3], labels)
    with pytest.raises(ValueError, match=r"shape \(8,\)"):
        compatibility_info_nce(new, old, labels[:4])


# -------------------------------------------------------------------------------------------------- HOC


@pytest.mark.parametrize("masking", ["standard", "reference", "paper"])
def test_hoc_is_the_weighted_sum(masking):
    new, old = random_batch(seed=7)
    generator = torch.Generator().manual_seed(8)
    logits = torch.randn(8, 6, generator=generator, dtype=torch.float64)
    labels = torch.tensor(LABELS_WITH_REPEATS)
    lam, rho = 0.1, 10.0
    expected = lam * cross_entropy_loops(logits.numpy(), LABELS_WITH_REPEATS) + (1 - lam) * info_nce_loops(
        new.numpy(), old.numpy(), LABELS_WITH_REPEATS, rho, masking
    )
    got = hoc_loss(logits, labels, new, old, lam=lam, rho=rho, masking=masking)
    assert got.item() == pytest.approx(expected, abs=1e-10)


def test_hoc_defaults_and_extremes():
    new, old = random_batch(seed=9)
    generator = torch.Generator().manual_seed(10)
    logits = torch.randn(8, 6, generator=generator, dtype=torch.float64)
    labels = torch.tensor(LABELS_WITH_REPEATS)
    sce = cross_entropy_loops(logits.numpy(), LABELS_WITH_REPEATS)
    nce10 = info_nce_loops(new.numpy(), old.numpy(), LABELS_WITH_REPEATS, 10.0, "standard")
    # defaults: lam = 0.1, rho = 10, masking = standard
    assert hoc_loss(logits, labels, new, old).item() == pytest.approx(0.1 * sce + 0.9 * nce10, abs=1e-10)
    assert hoc_loss(logits, labels, new, old, lam=1.0).item() == pytest.approx(sce, abs=1e-10)
    assert hoc_loss(logits, labels, new, old, lam=0.0).item() == pytest.approx(nce10, abs=1e-10)


def test_hoc_gradients_finite_and_validation():
    new, old = random_batch(seed=12, dtype=torch.float32)
    new.requires_grad_(True)
    logits = (new @ torch.randn(5, 6)).requires_grad_(True)
    labels = torch.tensor(LABELS_WITH_REPEATS)
    hoc_loss(logits, labels, new, old).backward()
    assert torch.isfinite(new.grad).all() and new.grad.abs().sum() > 0
    with pytest.raises(ValueError, match=r"lam .* \[0, 1\]"):
        hoc_loss(logits, labels, new, old, lam=1.5)
    with pytest.raises(ValueError, match="batch size"):
        hoc_loss(logits[:4], labels, new, old)


# --------------------------------------------------------------------------------------------------- FD


def test_fd_hand_worked_and_mask():
    new = torch.tensor([[1.0, 0.0], [3.0, 4.0]], requires_grad=True)
    old = torch.tensor([[0.0, 2.0], [3.0, 4.0]])
    # 1 - cos: sample 0 orthogonal -> 1; sample 1 identical direction -> 0
    assert feature_distillation_loss(new, old).item() == pytest.approx(0.5, abs=1e-7)
    assert feature_distillation_loss(new, old, torch.tensor([True, False])).item() == pytest.approx(1.0, abs=1e-7)
    assert feature_distillation_loss(new, old, torch.tensor([False, True])).item() == pytest.approx(0.0, abs=1e-7)


def test_fd_matches_loops_on_memory_samples_only():
    new, old = random_batch(seed=13)
    mask = torch.tensor([True, False, False, True, True, False, True, False])
    expected = np.mean([1 - cosine(new[i].numpy(), old[i].numpy()) for i in range(8) if mask[i]])
    assert feature_distillation_loss(new, old, mask).item() == pytest.approx(expected, abs=1e-12)


def test_fd_without_memory_samples_is_zero_but_differentiable():
    new, old = random_batch(seed=14, dtype=torch.float32)
    new.requires_grad_(True)
    old_tracked = old.clone().requires_grad_(True)
    loss = feature_distillation_loss(new, old_tracked, torch.zeros(8, dtype=torch.bool))
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(new.grad, torch.zeros_like(new))
    assert old_tracked.grad is None


def test_fd_gradients_and_validation():
    new, old = random_batch(seed=15)
    new.requires_grad_(True)
    mask = torch.tensor([True, True, False, False, True, False, False, False])
    assert torch.autograd.gradcheck(lambda x: feature_distillation_loss(x, old, mask), (new,))
    with pytest.raises(ValueError, match=r"memory_mask must be a bool tensor of shape \(8,\)"):
        feature_distillation_loss(new, old, torch.ones(8))
    with pytest.raises(ValueError, match="same shape"):
        feature_distillation_loss(new, old[:4])


def test_fd_weight_formula():
    # CL2R CIFAR100 10+6x15, second task: 15 new classes, 10 in memory: 5 * sqrt(1.5) = 6.1237244
    assert feature_distillation_weight(15, 10) == pytest.approx(6.123724356957945, rel=1e-12)
    assert feature_distillation_weight(90, 10) == pytest.approx(15.0, rel=1e-12)  # 5 * sqrt(9)
    assert feature_distillation_weight(10, 40, w_base=10.0) == pytest.approx(5.0, rel=1e-12)  # 10 * sqrt(1/4)
    assert feature_distillation_weight(np.int64(15), np.int64(10)) == pytest.approx(6.123724356957945)
    with pytest.raises(ValueError, match="old_classes must be > 0"):
        feature_distillation_weight(10, 0)
    with pytest.raises(ValueError, match="new_classes must be >= 0"):
        feature_distillation_weight(-1, 10)
    with pytest.raises(ValueError, match="new_classes must be an int"):
        feature_distillation_weight(1.5, 10)
    with pytest.raises(ValueError, match="w_base"):
        feature_distillation_weight(10, 10, w_base=float("nan"))


# -------------------------------------------------------------------------------------------------- BCT


def bct_loops(new, labels, weight, bias, selected):
    losses = []
    for i, label in enumerate(labels):
        if not selected[i]:
            continue
        z = [float(np.dot(weight[c], new[i]) + (0.0 if bias is None else bias[c])) for c in range(len(weight))]
        losses.append(-z[label] + math.log(sum(math.exp(v) for v in z)))
    return float(np.mean(losses))


def test_bct_hand_worked():
    # old classifier = identity on 2 classes; new feature [ln3, 0] -> logits [ln3, 0] -> p(class 0) = 3/4
    weight = torch.eye(2, dtype=torch.float64)
    new = torch.tensor([[math.log(3.0), 0.0]], dtype=torch.float64)
    assert bct_influence_loss(new, torch.tensor([0]), weight).item() == pytest.approx(math.log(4 / 3), abs=1e-12)
    # a bias of [0, ln3] evens the logits: p = 1/2
    bias = torch.tensor([0.0, math.log(3.0)], dtype=torch.float64)
    assert bct_influence_loss(new, torch.tensor([0]), weight, bias).item() == pytest.approx(math.log(2), abs=1e-12)


def test_bct_matches_loops_on_old_classes_only():
    generator = torch.Generator().manual_seed(16)
    new = torch.randn(6, 4, generator=generator, dtype=torch.float64)
    weight = torch.randn(3, 4, generator=generator, dtype=torch.float64)
    bias = torch.randn(3, generator=generator, dtype=torch.float64)
    labels = [0, 2, 5, 1, 3, 2]  # labels 5 and 3 are new classes the 3-class old classifier does not know
    selected = [label < 3 for label in labels]
    expected = bct_loops(new.numpy(), labels, weight.numpy(), bias.numpy(), selected)
    got = bct_influence_loss(new, torch.tensor(labels), weight, bias)
    assert got.item() == pytest.approx(expected, abs=1e-12)
    # explicit mask (e.g. replay samples only)
    mask = [True, False, False, True, False, False]
    expected_masked = bct_loops(new.numpy(), labels, weight.numpy(), None, mask)
    got_masked = bct_influence_loss(new, torch.tensor(labels), weight, old_class_mask=torch.tensor(mask))
    assert got_masked.item() == pytest.approx(expected_masked, abs=1e-12)


def test_bct_gradients_flow_to_new_features_only():
    generator = torch.Generator().manual_seed(17)
    new = torch.randn(5, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 1, 2, 4, 1])
    assert torch.autograd.gradcheck(lambda x: bct_influence_loss(x, labels, weight.detach()), (new,))
    bct_influence_loss(new, labels, weight).backward()
    assert weight.grad is None
    assert torch.equal(new.grad[3], torch.zeros(4, dtype=torch.float64))  # new-class sample contributes nothing


def test_bct_no_old_class_sample_and_validation():
    new = torch.randn(3, 4, requires_grad=True)
    weight = torch.randn(2, 4)
    loss = bct_influence_loss(new, torch.tensor([2, 3, 5]), weight)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(new.grad, torch.zeros_like(new))
    with pytest.raises(ValueError, match=r"labels \[3\].*2 classes"):
        bct_influence_loss(new, torch.tensor([0, 3, 1]), weight, old_class_mask=torch.tensor([True, True, False]))
    with pytest.raises(ValueError, match=r"feature size 5 .*expected weight shape \(2, 4\)"):
        bct_influence_loss(new, torch.tensor([0, 1, 1]), torch.randn(2, 5))
    with pytest.raises(ValueError, match=r"old_classifier_bias must have shape \(2,\)"):
        bct_influence_loss(new, torch.tensor([0, 1, 1]), weight, torch.zeros(3))
    with pytest.raises(ValueError, match="non-negative"):
        bct_influence_loss(new, torch.tensor([0, -1, 1]), weight)

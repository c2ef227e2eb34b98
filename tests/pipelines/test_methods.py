"""Contract and value tests of the training recipes in pipelines.methods."""
from __future__ import annotations

import typing

import math

import numpy as np
import pytest
import torch

from compat_core.losses import INFO_NCE_MASKINGS, hoc_loss, simplex_cross_entropy
from compat_core.models.compat_model import create_model, frozen_copy
from compat_core.upgrades.adapters import FanAdapter, apply_chain, load_adapter_bytes, save_adapter
from pipelines.methods import METHODS, get_method
from pipelines.methods.objective import Batch, ClassStatistics, TaskContext, boundary_hinge
from pipelines.methods.cards.dsimplex import HOCParams
from pipelines.methods.cvs import Attractors, data_coherence, model_coherence

K = 16
NUM_OLD, NUM_NEW = 3, 3
ALL_METHODS = ["advbct-er", "bct-er", "cores", "cvs", "dsimplex-fd", "dsimplex-hoc", "er", "fan", "lce-er", "lsp", "psp"]


def tiny_model(classifier: str, seed: int, classes: int = 0):
    torch.manual_seed(seed)
    return create_model("cnn4", K, classifier=classifier, backbone_config={"width": 4, "in_chans": 1},
                        num_active_classes=classes)


def fixed_batch(classifier: str) -> Batch:
    """8 images: 4 memory samples of old classes 0..2, 4 task samples of new classes 3..5 (as slots)."""
    generator = torch.Generator().manual_seed(123)
    images = torch.randn(8, 1, 16, 16, generator=generator)
    classes = torch.tensor([0, 1, 2, 0, 3, 4, 5, 3])
    targets = classes if classifier == "learnable" else K - 1 - classes  # fine-tuning slots right to left
    is_memory = torch.tensor([True] * 4 + [False] * 4)
    return Batch(images=images, targets=targets, is_memory=is_memory)


def make_context(method, with_old: bool = True):
    """New model (seed 0) and a different frozen old model (seed 1), as after a replacement."""
    kind = method.classifier
    model = tiny_model(kind, 0, NUM_OLD + NUM_NEW if kind == "learnable" else 0)
    old = frozen_copy(tiny_model(kind, 1, NUM_OLD if kind == "learnable" else 0)) if with_old else None
    batch = fixed_batch(kind)

    def iterate_memory():
        keep = batch.is_memory
        yield Batch(images=batch.images[keep], targets=batch.targets[keep], is_memory=batch.is_memory[keep])

    def iterate_task():
        keep = ~batch.is_memory
        yield Batch(images=batch.images[keep], targets=batch.targets[keep], is_memory=batch.is_memory[keep])

    ctx = TaskContext(model=model, old_model=old, task=1, num_old_classes=NUM_OLD, num_new_classes=NUM_NEW,
                      hparams=method.hparams, iterate_memory=iterate_memory, iterate_task=iterate_task)
    return ctx, batch


def test_registry_holds_every_compared_method():
    assert set(ALL_METHODS) <= set(METHODS.names())  # a method added by one card module is listed too
    with pytest.raises(KeyError, match="valid method names: advbct-er, bct-er"):
        get_method("dsimplex")


@pytest.mark.parametrize("name", METHODS.names())
def test_card_names_its_objective_and_the_objective_carries_the_card(name):
    card = METHODS.get(name)
    method = get_method(name)
    assert type(method) is card.objective_class() and type(method).card is card
    for trait in ("name", "classifier", "uses_replay", "needs_old_model", "retrain_from_scratch",
                  "requires_initial_state", "independent_init", "training_free", "adapts_gallery", "Params"):
        assert getattr(method, trait) == getattr(card, trait), trait
    assert isinstance(method.hparams, card.Params)


def test_card_traits_as_the_papers_describe_the_methods():
    learnable = {"advbct-er", "bct-er", "cvs", "er", "fan", "lce-er", "lsp", "psp"}
    assert {name for name in ALL_METHODS if METHODS.get(name).classifier == "learnable"} == learnable
    # PSP / LSP / CoReS retrain every model on all data seen so far; only FAN maps gallery features at entries
    assert {n for n in ALL_METHODS if METHODS.get(n).retrain_from_scratch} == {"cores", "lsp", "psp"}
    assert {n for n in ALL_METHODS if METHODS.get(n).adapts_gallery} == {"fan"}
    assert {n for n in ALL_METHODS if METHODS.get(n).training_free} == {"lsp", "psp"}


def test_hoc_card_accepts_exactly_the_maskings_the_loss_implements():
    assert typing.get_args(HOCParams.model_fields["masking"].annotation) == INFO_NCE_MASKINGS


def test_unknown_or_bad_hparams_name_the_method_and_valid_names():
    with pytest.raises(ValueError, match=r"method 'dsimplex-hoc': lambda: unknown key; valid: lam, masking, rho"):
        get_method("dsimplex-hoc", **{"lambda": 0.5})
    with pytest.raises(ValueError, match="lam: Input should be less than or equal to 1"):
        get_method("dsimplex-hoc", lam=1.5)
    with pytest.raises(ValueError, match=r"masking: Input should be 'standard', 'reference' or 'paper' \(got 'zero'\)"):
        get_method("dsimplex-hoc", masking="zero")
    with pytest.raises(ValueError, match=r"method 'dsimplex-fd': w_base: Input should be a valid number \(got '5'\)"):
        get_method("dsimplex-fd", w_base="5")
    with pytest.raises(ValueError, match="temperature: Input should be a finite number"):
        get_method("psp", temperature=float("inf"))


def test_spec_defaults():
    hoc = get_method("dsimplex-hoc")
    assert (hoc.hparams.lam, hoc.hparams.rho, hoc.hparams.masking) == (0.1, 10.0, "standard")
    assert get_method("dsimplex-fd").hparams.w_base == 5.0
    assert get_method("dsimplex-hoc", rho=5).hparams.rho == 5.0  # YAML ints accepted for floats
    cores = get_method("cores")
    assert cores.retrain_from_scratch and cores.requires_initial_state and not cores.uses_replay
    assert get_method("psp").training_free and get_method("lsp").training_free
    assert get_method("er").classifier == "learnable" and get_method("dsimplex-hoc").classifier == "simplex"


@pytest.mark.parametrize("name", METHODS.names())
def test_contract_one_step_trains(name):
    method = get_method(name)
    ctx, batch = make_context(method)
    extra = method.setup(ctx)
    parameters = list(ctx.model.parameters()) + [p for module in extra for p in module.parameters()]
    optimizer = torch.optim.SGD(parameters, lr=0.05)
    losses = []
    for step in range(6):
        loss, parts = method.loss(batch, ctx)
        assert loss.ndim == 0 and math.isfinite(loss.item())
        assert all(math.isfinite(v) for v in parts.values()) and parts
        optimizer.zero_grad()
        loss.backward()
        if step == 0:
            first_conv = next(m for m in ctx.model.backbone.modules() if isinstance(m, torch.nn.Conv2d))
            assert first_conv.weight.grad is not None and float(first_conv.weight.grad.abs().sum()) > 0
            assert all(p.grad is None for p in ctx.old_model.parameters())
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    assert ctx.model(batch.images).features.shape == (8, K - 1)


@pytest.mark.parametrize("name", ["er", "dsimplex-hoc", "dsimplex-fd", "bct-er", "fan", "lce-er", "advbct-er"])
def test_first_task_without_old_model_is_plain_classification(name):
    method = get_method(name)
    ctx, batch = make_context(method, with_old=False)
    ctx.model.eval()
    assert method.setup(ctx) == []
    loss, _ = method.loss(batch, ctx)
    logits = ctx.model(batch.images).logits
    expected = torch.nn.functional.cross_entropy(logits.double(), batch.targets)  # all K slots for simplex
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("masking", ["standard", "reference"])
def test_hoc_method_equals_hoc_loss(masking):
    method = get_method("dsimplex-hoc", lam=0.3, rho=5, masking=masking)
    ctx, batch = make_context(method)
    ctx.model.eval()
    loss, parts = method.loss(batch, ctx)
    new, old = ctx.model(batch.images), ctx.old_model(batch.images)
    expected = hoc_loss(new.logits, batch.targets, new.features, old.features, lam=0.3, rho=5.0, masking=masking)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert 0.3 * float(parts["sce"]) + 0.7 * float(parts["info_nce"]) == pytest.approx(expected.item(), rel=1e-5)


def test_fd_distils_memory_samples_only():
    method = get_method("dsimplex-fd", w_base=2.0)
    ctx, batch = make_context(method)
    ctx.model.eval()
    loss, parts = method.loss(batch, ctx)
    new = ctx.model(batch.images)
    old = ctx.old_model(batch.images)
    a = new.projection.detach().double().numpy()
    b = old.projection.double().numpy()
    cosines = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    fd_memory = float(np.mean(1.0 - cosines[:4]))  # samples 0..3 are the memory
    weight = 2.0 * math.sqrt(NUM_NEW / NUM_OLD)
    sce = simplex_cross_entropy(new.logits, batch.targets).item()
    assert float(parts["fd"]) == pytest.approx(fd_memory, rel=1e-5)
    assert float(parts["fd_weight"]) == pytest.approx(weight)
    assert loss.item() == pytest.approx(sce + weight * fd_memory, rel=1e-5)
    # with no memory sample in the batch only the SCE remains
    no_memory = Batch(images=batch.images, targets=batch.targets, is_memory=torch.zeros(8, dtype=torch.bool))
    loss_without, parts_without = method.loss(no_memory, ctx)
    assert float(parts_without["fd"]) == 0.0 and loss_without.item() == pytest.approx(sce, rel=1e-6)


def bct_influence_loop(new_inputs, old_inputs, targets, old_weight, num_old):
    """BCT's influence loss written out in fp64 loops: the old classifier's rows for old classes, for each new class
    the mean of the old model's classifier inputs over its images, then the mean over samples of
    -log softmax(W x_new)[y]."""
    rows = [list(map(float, row)) for row in old_weight]
    for c in range(num_old, int(max(targets)) + 1):
        members = [old_inputs[i] for i in range(len(targets)) if targets[i] == c]
        rows.append([sum(float(m[j]) for m in members) / len(members) for j in range(len(old_weight[0]))])
    total = 0.0
    for i, y in enumerate(targets):
        logits = [sum(float(new_inputs[i][j]) * row[j] for j in range(len(row))) for row in rows]
        top = max(logits)
        total += -(logits[int(y)] - top - math.log(sum(math.exp(v - top) for v in logits)))
    return total / len(targets)


def test_bct_influence_loss_with_synthesised_new_class_rows_equals_the_fp64_loop():
    """Every sample counts: old classes through the old head, the task's new classes through rows synthesised as the
    mean old-model classifier input of their images (BCT's new-class classifier)."""
    method = get_method("bct-er", lam=0.5)
    ctx, batch = make_context(method)
    ctx.model.eval()
    method.setup(ctx)
    loss, parts = method.loss(batch, ctx)
    with torch.no_grad():
        new_inputs = ctx.model(batch.images).projection.double().numpy()
        old_inputs = ctx.old_model(batch.images).projection.double().numpy()
    old_weight = ctx.old_model.classifier.weight.detach().double().numpy()  # (3, K-1), no bias
    assert ctx.old_model.classifier.bias is None
    targets = batch.targets.tolist()
    assert max(targets) >= NUM_OLD and sum(t >= NUM_OLD for t in targets) == 4  # new-class samples are scored
    expected = bct_influence_loop(new_inputs, old_inputs, targets, old_weight, NUM_OLD)
    assert float(parts["influence"]) == pytest.approx(expected, rel=1e-5)
    assert loss.item() == pytest.approx(float(parts["ce"]) + 0.5 * expected, rel=1e-5)
    # the old-class-only variant (the earlier approximation) is a different number
    old_only = bct_influence_loop(new_inputs[:4], old_inputs[:4], targets[:4], old_weight, NUM_OLD)
    assert abs(old_only - expected) > 1e-3


def test_bct_needs_setup_before_the_loss():
    method = get_method("bct-er")
    ctx, batch = make_context(method)
    with pytest.raises(ValueError, match="bct-er: setup"):
        method.loss(batch, ctx)


def test_boundary_hinge_by_hand():
    stats = ClassStatistics(
        centres=torch.tensor([[1.0, 0.0], [0.0, 1.0]]),
        radius=torch.tensor([0.1, 0.5]),
        present=torch.tensor([True, True]),
    )
    # sample 0: class 0 at 60 degrees -> distance 0.5, hinge 0.4; sample 1: class 1 at 0 -> hinge 0;
    # sample 2: class 2 is not an old class -> ignored
    features = torch.tensor([[0.5, math.sqrt(3) / 2], [0.0, 3.0], [1.0, 0.0]])
    value = boundary_hinge(features, torch.tensor([0, 1, 2]), stats)
    assert float(value) == pytest.approx((0.4 + 0.0) / 2, abs=1e-6)
    assert float(boundary_hinge(features, torch.tensor([0, 1, 2]), stats, scale=2.0)) == pytest.approx(0.3 / 2, abs=1e-6)


def test_lce_statistics_are_old_class_centres_over_memory():
    method = get_method("lce-er")
    ctx, batch = make_context(method)
    method.setup(ctx)
    old = ctx.old_model(batch.images[:4]).features.double().numpy()
    centre0 = old[0] + old[3]
    centre0 /= np.linalg.norm(centre0)
    np.testing.assert_allclose(method.stats.centres[0].numpy(), centre0, atol=1e-5)
    radius0 = np.mean([1 - old[0] @ centre0, 1 - old[3] @ centre0])
    assert float(method.stats.radius[0]) == pytest.approx(radius0, abs=1e-5)
    assert float(method.stats.radius[1]) == pytest.approx(0.0, abs=1e-6)  # one sample is its own centre
    farthest0 = max(1 - old[0] @ centre0, 1 - old[3] @ centre0)
    assert float(method.stats.farthest[0]) == pytest.approx(farthest0, abs=1e-5)


def test_lce_loss_equals_the_fp64_loop_of_its_terms():
    """CE + 100 * mean((W_c / ||W_c|| - centre_c)^2) + 1 * mean over old-class samples of
    max(min_j cos(old_j, centre_y) - cos(new_i, centre_y), 0), every term written out over classes and samples."""
    method = get_method("lce-er")
    assert (method.hparams.lam_align, method.hparams.lam_boundary) == (100.0, 1.0)
    ctx, batch = make_context(method)
    ctx.model.eval()
    method.setup(ctx)
    loss, parts = method.loss(batch, ctx)
    with torch.no_grad():
        old = [list(map(float, row)) for row in ctx.old_model(batch.images[:4]).features.double()]
        new = [list(map(float, row)) for row in ctx.model(batch.images).features.double()]
    weight = [list(map(float, row)) for row in ctx.model.classifier.weight.detach().double()]
    targets = batch.targets.tolist()
    dot = lambda a, b: sum(x * y for x, y in zip(a, b))  # noqa: E731
    unit = lambda a: [x / math.sqrt(dot(a, a)) for x in a]  # noqa: E731
    centres, lowest = {}, {}
    for c in range(NUM_OLD):
        members = [old[i] for i in range(4) if targets[i] == c]
        centres[c] = unit([sum(m[j] for m in members) for j in range(len(members[0]))])
        lowest[c] = min(dot(m, centres[c]) for m in members)
    dim = len(weight[0])
    align = sum((unit(weight[c])[j] - centres[c][j]) ** 2 for c in centres for j in range(dim)) / (len(centres) * dim)
    hinges = [max(lowest[y] - dot(new[i], centres[y]), 0.0) for i, y in enumerate(targets) if y < NUM_OLD]
    boundary = sum(hinges) / len(hinges)
    assert float(parts["align"]) == pytest.approx(align, rel=1e-4)
    assert float(parts["boundary"]) == pytest.approx(boundary, rel=1e-4, abs=1e-6)
    assert loss.item() == pytest.approx(float(parts["ce"]) + 100.0 * align + boundary, rel=1e-4)


def test_psp_and_lsp_features_by_hand():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.5, 0.5, 3.0, 0.0]])
    z = logits.double().numpy()
    probs = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    known = probs[:, :3] - probs[:, :3].mean(1, keepdims=True)
    expected_psp = known / np.linalg.norm(known, axis=1, keepdims=True)
    np.testing.assert_allclose(get_method("psp").extract_features(logits, 3).numpy(), expected_psp, atol=1e-6)
    expected_lsp = z[:, :2] / np.linalg.norm(z[:, :2], axis=1, keepdims=True)
    np.testing.assert_allclose(get_method("lsp").extract_features(logits, 2).numpy(), expected_lsp, atol=1e-6)
    # top-1: only the largest entry survives, renormalised to 1
    top1 = get_method("lsp", top_k=1).extract_features(logits)
    np.testing.assert_allclose(top1.numpy(), [[1, 0, 0, 0], [0, 0, 1, 0]], atol=1e-6)


def _lists(tensor):
    return [list(map(float, row)) for row in tensor.detach().double()]


def _unit(vector):
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector]


def _distance(a, b, eps=0.0):
    return math.sqrt(sum((x - y + eps) ** 2 for x, y in zip(a, b)))


def cvs_normalised_softmax_loop(embeddings, weights, targets, temperature):
    """Mean over samples of -log softmax_c(cos(f_i, w_c) / T)[y_i], written out in fp64."""
    total = 0.0
    for f, y in zip(embeddings, targets):
        logits = [sum(a * b for a, b in zip(_unit(f), _unit(w))) / temperature for w in weights]
        top = max(logits)
        total += -(logits[y] - top - math.log(sum(math.exp(v - top) for v in logits)))
    return total / len(targets)


def cvs_model_coherence_loop(new_unit, old_unit, targets, margin):
    """The authors' triplet: for each anchor i, the other-label j nearest (Euclidean) to new_i among old_j, then
    max(d(new_i, old_i) - d(new_i, old_j) + margin, 0) with torch's pairwise distance (eps 1e-6 on the difference)."""
    terms = []
    for i in range(len(targets)):
        candidates = [j for j in range(len(targets)) if targets[j] != targets[i]]
        if not candidates:
            continue
        j = min(candidates, key=lambda c: _distance(new_unit[i], old_unit[c]))
        positive = _distance(new_unit[i], old_unit[i], eps=1e-6)
        negative = _distance(new_unit[i], old_unit[j], eps=1e-6)
        terms.append(max(positive - negative + margin, 0.0))
    return sum(terms) / len(terms) if terms else 0.0


def cvs_data_coherence_loop(new_unit, targets, memory_unit, memory_targets, num_old):
    """Mean over old-class samples of ||new_i - mean of the class's old unit memory embeddings||^2."""
    terms = []
    for f, y in zip(new_unit, targets):
        members = [m for m, t in zip(memory_unit, memory_targets) if t == y]
        if y >= num_old or not members:
            continue
        centre = [sum(m[k] for m in members) / len(members) for k in range(len(f))]
        terms.append(sum((a - b) ** 2 for a, b in zip(f, centre)))
    return sum(terms) / len(terms) if terms else 0.0


def test_cvs_defaults_are_the_authors_values():
    hp = get_method("cvs").hparams
    assert (hp.lam_model, hp.lam_data, hp.margin, hp.temperature) == (10.0, 1.0, 0.1, 0.05)


def test_cvs_loss_equals_the_fp64_loop_of_the_authors_terms():
    """L_c + 10 L_m + 1 L_d on the hand-sized batch, each term from its own fp64 loop."""
    method = get_method("cvs")
    ctx, batch = make_context(method)
    ctx.model.eval()
    assert method.setup(ctx) == []
    loss, parts = method.loss(batch, ctx)
    targets = batch.targets.tolist()
    with torch.no_grad():
        embeddings = _lists(ctx.model(batch.images).projection)
        new_unit = [_unit(f) for f in embeddings]
        old_unit = [_unit(f) for f in _lists(ctx.old_model(batch.images).projection)]
    weights = _lists(ctx.model.classifier.weight)
    discrimination = cvs_normalised_softmax_loop(embeddings, weights, targets, 0.05)
    model_term = cvs_model_coherence_loop(new_unit, old_unit, targets, 0.1)
    data_term = cvs_data_coherence_loop(new_unit, targets, old_unit[:4], targets[:4], NUM_OLD)
    assert model_term > 0 and data_term > 0
    assert float(parts["ce"]) == pytest.approx(discrimination, rel=1e-5)
    assert float(parts["model"]) == pytest.approx(model_term, rel=1e-5)
    assert float(parts["data"]) == pytest.approx(data_term, rel=1e-5)
    assert loss.item() == pytest.approx(discrimination + 10.0 * model_term + data_term, rel=1e-5)


def test_cvs_first_task_is_the_normalised_softmax_alone():
    method = get_method("cvs", temperature=0.5)
    ctx, batch = make_context(method, with_old=False)
    ctx.model.eval()
    assert method.setup(ctx) == []
    loss, parts = method.loss(batch, ctx)
    with torch.no_grad():
        embeddings = _lists(ctx.model(batch.images).projection)
    expected = cvs_normalised_softmax_loop(embeddings, _lists(ctx.model.classifier.weight), batch.targets.tolist(), 0.5)
    assert set(parts) == {"ce"} and loss.item() == pytest.approx(expected, rel=1e-5)


def test_cvs_terms_by_hand_on_tied_and_degenerate_batches():
    """Hand-worked: 2-d unit embeddings where the hardest negative is not the first other-label sample."""
    new = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]], dtype=torch.float64)
    old = torch.tensor([[0.0, 1.0], [0.8, 0.6], [1.0, 0.0]], dtype=torch.float64)
    targets = torch.tensor([0, 1, 2])
    got = float(model_coherence(new, old, targets, margin=0.1))
    expected = cvs_model_coherence_loop(_lists(new), _lists(old), targets.tolist(), 0.1)
    # anchor 0: positive at sqrt 2, hardest negative old_2 (not old_1) at 0; anchor 1: positive at sqrt 0.8,
    # hardest old_0 at 0; anchor 2: positive at sqrt 0.8, hardest old_1 at sqrt 0.08
    by_hand = (math.sqrt(2) + 0.1 + math.sqrt(0.8) + 0.1 + math.sqrt(0.8) - math.sqrt(0.08) + 0.1) / 3
    assert expected == pytest.approx(by_hand, rel=1e-5) and got == pytest.approx(expected, rel=1e-9)
    assert float(model_coherence(new, old, torch.tensor([4, 4, 4]), margin=0.1)) == 0.0  # no negative anywhere
    # two labels: every anchor has a negative (the class-3 anchors can only take the class-7 image)
    partial = float(model_coherence(new, old, torch.tensor([3, 3, 7]), margin=0.1))
    assert partial == pytest.approx(cvs_model_coherence_loop(_lists(new), _lists(old), [3, 3, 7], 0.1), rel=1e-9)
    attractors = Attractors(means=torch.tensor([[0.5, 0.5], [0.0, 0.0]], dtype=torch.float64),
                            present=torch.tensor([True, False]))
    # sample 0 (class 0): (0.5)^2 + (0.5)^2; class 1 has no memory, class 2 is new
    assert float(data_coherence(new, targets, attractors)) == pytest.approx(0.5, rel=1e-12)
    assert float(data_coherence(new, torch.tensor([1, 2, 2]), attractors)) == 0.0


def test_fan_adapters_compose_and_round_trip():
    """FAN's psi is the ``fan`` kind of the common adapter interface: stored and reloaded as every adapter is."""
    method = get_method("fan", adapter_hidden=8, adapter_epochs=2)
    ctx, batch = make_context(method)
    assert method.setup(ctx) == []  # nothing trains with the model: psi is fitted after the update
    exported = method.export_state()["adapter"]
    assert isinstance(exported, FanAdapter)
    rebuilt = load_adapter_bytes(save_adapter(exported))
    assert (rebuilt.kind, rebuilt.direction) == ("fan", "gallery")
    features = torch.nn.functional.normalize(torch.randn(3, K - 1), dim=1)
    once = apply_chain(features, [rebuilt])
    with torch.no_grad():
        w1, b1 = exported.net[0].weight.double(), exported.net[0].bias.double()
        w2, b2 = exported.net[2].weight.double(), exported.net[2].bias.double()
        expected = torch.nn.functional.normalize(torch.relu(features.double() @ w1.T + b1) @ w2.T + b2, dim=1)
    torch.testing.assert_close(once.double(), expected, rtol=1e-5, atol=1e-6)
    twice = apply_chain(features, [rebuilt, rebuilt])
    torch.testing.assert_close(twice, apply_chain(once, [rebuilt]))
    with pytest.raises(ValueError, match="expected metadata format"):
        load_adapter_bytes(__import__("safetensors.torch", fromlist=["save"]).save({"w": torch.ones(2)}))


def test_fan_update_loss_and_adapter_fitted_after_the_update_on_old_new_pairs():
    """The update's loss is CE + (1 - cos(new, old)) (fp64 loop); psi is fitted once training is over, on the pairs
    (old model, updated model) of every task and memory image: the same weights as fitting a FanAdapter on pairs
    computed here, and its fit lowers the pairs' squared error."""
    method = get_method("fan", adapter_hidden=8, adapter_epochs=5, adapter_lr=1e-2)
    ctx, batch = make_context(method)
    ctx.model.eval()
    method.setup(ctx)
    loss, parts = method.loss(batch, ctx)
    with torch.no_grad():
        new = [list(map(float, r)) for r in torch.nn.functional.normalize(ctx.model(batch.images).features.double())]
        old = [list(map(float, r)) for r in torch.nn.functional.normalize(ctx.old_model(batch.images).features.double())]
    distill = sum(1.0 - sum(a * b for a, b in zip(n, o)) for n, o in zip(new, old)) / len(new)
    assert float(parts["distill"]) == pytest.approx(distill, rel=1e-5)
    assert loss.item() == pytest.approx(float(parts["ce"]) + distill, rel=1e-5)
    ctx.model.train()
    adapter = method.export_state()["adapter"]
    assert ctx.model.training  # the pairs were taken in eval mode and the mode restored
    task, memory = ~batch.is_memory, batch.is_memory
    order = torch.cat([torch.nonzero(task).flatten(), torch.nonzero(memory).flatten()])  # task images first, then memory
    ctx.model.eval()
    with torch.no_grad():
        old_pairs = ctx.old_model(batch.images[order]).features.float()
        new_pairs = ctx.model(batch.images[order]).features.float()
    reference = FanAdapter(hidden=8, epochs=5, lr=1e-2, seed=ctx.task).fit(old_pairs, new_pairs)
    for name, value in adapter.net.state_dict().items():
        torch.testing.assert_close(value, reference.net.state_dict()[name])
    assert adapter.fit_loss[-1] < adapter.fit_loss[0]


def test_advbct_loss_equals_the_fp64_loop_of_the_authors_terms():
    """CE + 1 * elastic boundary + 1 * (E - e + 1) / E * (NLL(D(new), 0) + NLL(D(old), 1)), every term written out:
    the discriminator with batch-statistics BatchNorm, the boundary r_max +- sigmoid(w) |r_max - 1| in Euclidean
    distance of unit features, averaged over violating samples; at step 5 of 4 epochs x 2 steps (epoch 2)."""
    method = get_method("advbct-er")
    assert (method.hparams.lam_boundary, method.hparams.lam_adv, method.hparams.threshold) == (1.0, 1.0, 1.0)
    ctx, batch = make_context(method)
    ctx.model.eval()
    discriminator, elastic = method.setup(ctx)
    ctx.step, ctx.steps_per_epoch, ctx.epochs = 5, 2, 4
    assert ctx.progress() == (2, 5 / 8)
    loss, parts = method.loss(batch, ctx)
    to_lists = lambda t: [list(map(float, row)) for row in t.detach().double()]  # noqa: E731
    with torch.no_grad():
        new_emb = to_lists(ctx.model(batch.images).projection)
        old_emb = to_lists(ctx.old_model(batch.images).projection)
        new_feat = to_lists(ctx.model(batch.images).features)
        old_feat = to_lists(ctx.old_model(batch.images[:4]).features)
    targets = batch.targets.tolist()
    dot = lambda a, b: sum(x * y for x, y in zip(a, b))  # noqa: E731
    unit = lambda a: [x / math.sqrt(dot(a, a)) for x in a]  # noqa: E731
    dist = lambda a, b: math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))  # noqa: E731

    def discriminate(rows):
        w1, b1 = to_lists(discriminator[0].weight), [float(v) for v in discriminator[0].bias]
        gamma, beta = [float(v) for v in discriminator[1].weight], [float(v) for v in discriminator[1].bias]
        w2, b2 = to_lists(discriminator[3].weight), [float(v) for v in discriminator[3].bias]
        hidden = [[dot(w, x) + b for w, b in zip(w1, b1)] for x in rows]
        n = len(rows)
        for k in range(len(b1)):
            mean = sum(h[k] for h in hidden) / n
            var = sum((h[k] - mean) ** 2 for h in hidden) / n
            for h in hidden:
                h[k] = max(gamma[k] * (h[k] - mean) / math.sqrt(var + 1e-5) + beta[k], 0.0)
        out = []
        for h in hidden:
            logits = [dot(w, h) + b for w, b in zip(w2, b2)]
            top = max(logits)
            norm = top + math.log(sum(math.exp(v - top) for v in logits))
            out.append([v - norm for v in logits])
        return out

    adversarial = (-sum(row[0] for row in discriminate(new_emb)) / 8) + (-sum(row[1] for row in discriminate(old_emb)) / 8)
    weights = [float(v) for v in elastic.weight]
    hinges = []
    for i, y in enumerate(targets):
        members = [unit(old_feat[j]) for j in range(4) if targets[j] == y]
        if y >= NUM_OLD or len(members) < 2:
            continue
        centre = unit([sum(m[k] for m in members) for k in range(len(members[0]))])
        r_max = max(dist(m, centre) for m in members)
        shift = abs(r_max - 1.0) / (1.0 + math.exp(-weights[y]))
        radius = r_max + shift if r_max < 1.0 else r_max - shift
        hinges.append(max(dist(unit(new_feat[i]), centre) - radius, 0.0))
    violating = [h for h in hinges if h > 0]
    boundary = sum(violating) / len(violating) if violating else 0.0
    assert len(hinges) == 2  # the two samples of class 0, the only old class with two memory features
    assert float(parts["adversarial"]) == pytest.approx(adversarial, rel=1e-4)
    assert float(parts["boundary"]) == pytest.approx(boundary, rel=1e-4, abs=1e-6)
    assert loss.item() == pytest.approx(float(parts["ce"]) + boundary + 0.75 * adversarial, rel=1e-4)


def test_advbct_reverses_the_new_embeddings_gradient_by_the_dann_factor():
    """The discriminator's loss reaches the new model negated and scaled by 2 / (1 + exp(-10 p)) - 1."""
    method = get_method("advbct-er", lam_boundary=0.0)
    ctx, batch = make_context(method)
    ctx.model.eval()
    discriminator, _ = method.setup(ctx)
    ctx.step, ctx.steps_per_epoch, ctx.epochs = 3, 2, 4
    alpha = 2.0 / (1.0 + math.exp(-10.0 * 3 / 8)) - 1.0
    captured = {}
    handle = ctx.model.junction.register_forward_hook(lambda m, i, o: captured.__setitem__("out", o))
    loss, _ = method.loss(batch, ctx)
    handle.remove()
    out = captured["out"]
    (total_grad,) = torch.autograd.grad(loss, out, retain_graph=True)
    ce = torch.nn.functional.cross_entropy(ctx.model.logits_from_projection(out).float(), batch.targets)
    (ce_grad,) = torch.autograd.grad(ce, out)
    reversed_grad = total_grad - ce_grad  # the adversarial term's share (decay (4 - 1 + 1) / 4 = 1)
    embedding = captured["out"].detach().clone().requires_grad_(True)
    direct = torch.nn.functional.nll_loss(discriminator(embedding), torch.zeros(8, dtype=torch.long))
    direct.backward()
    torch.testing.assert_close(reversed_grad, -alpha * embedding.grad, rtol=1e-4, atol=1e-7)

"""Adapters reproduce known solutions on synthetic data; MLP losses equal their formula computed independently."""
import numpy as np
import pytest
import torch

from compat_core.upgrades.adapters import (
    ADAPTER_KINDS,
    AffineAdapter,
    FanAdapter,
    FctAdapter,
    ProcrustesAdapter,
    ResidualMlpAdapter,
    apply_chain,
    load_adapter_bytes,
    make_adapter,
    save_adapter,
)


def _unit_rows(rng, n, d):
    x = rng.standard_normal((n, d))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _random_rotation(rng, d):
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    return q * np.sign(np.diag(r))


def test_procrustes_recovers_a_random_rotation_to_1e_5():
    rng = np.random.default_rng(0)
    x = _unit_rows(rng, 400, 32)
    rotation = _random_rotation(rng, 32)
    y = x @ rotation                      # rows stay unit-norm: the adapter's normalisation changes nothing
    adapter = ProcrustesAdapter().fit(torch.from_numpy(x), torch.from_numpy(y))
    assert np.abs(adapter.weight.double().numpy() - rotation).max() < 1e-5
    mapped = adapter.apply(torch.from_numpy(x)).double().numpy()
    assert np.abs(mapped - y).max() < 1e-5


def test_affine_recovers_an_exact_low_rank_map():
    rng = np.random.default_rng(1)
    x = _unit_rows(rng, 500, 24)
    a, b = rng.standard_normal((24, 3)), rng.standard_normal((3, 16))
    y = (x - x.mean(0)) @ a @ b + 0.5                # rank-3 affine map; the adapter normalises y, so do it too
    y /= np.linalg.norm(y, axis=1, keepdims=True)
    target = torch.from_numpy(y)
    adapter = AffineAdapter(rank=16, ridge=0.0).fit(torch.from_numpy(x), target)
    # y is a normalised (non-linear) function of x, so the fitted value is the least-squares optimum: compare with it
    xc = np.c_[x, np.ones(len(x))]
    optimum = xc @ np.linalg.lstsq(xc, y, rcond=None)[0]
    assert np.abs(adapter.apply(torch.from_numpy(x)).double().numpy() - optimum).max() < 1e-4


def _mlp_forward_numpy(state, x, residual, relu=False):
    first, second = ("0", "2") if relu else ("fc1", "fc2")   # FAN's psi keeps nn.Sequential's tensor names
    hidden = x @ state[f"{first}.weight"].double().numpy().T + state[f"{first}.bias"].double().numpy()
    if relu:
        hidden = np.maximum(hidden, 0.0)
    else:
        hidden = 0.5 * hidden * (1.0 + np.vectorize(__import__("math").erf)(hidden / np.sqrt(2.0)))   # exact GELU
    out = hidden @ state[f"{second}.weight"].double().numpy().T + state[f"{second}.bias"].double().numpy()
    return out + x if residual else out


@pytest.mark.parametrize("cls,residual", [(ResidualMlpAdapter, True), (FctAdapter, False), (FanAdapter, False)])
def test_mlp_adapter_loss_matches_formula_and_decreases(cls, residual):
    rng = np.random.default_rng(2)
    x = _unit_rows(rng, 300, 16)
    y = np.tanh(x @ rng.standard_normal((16, 16)))
    adapter = cls(hidden=32, epochs=15, lr=3e-3, batch_size=64, seed=0)
    adapter.fit(torch.from_numpy(x), torch.from_numpy(y))
    yn = y / np.linalg.norm(y, axis=1, keepdims=True)
    predicted = _mlp_forward_numpy(adapter.state_dict(), x, residual, relu=cls is FanAdapter)
    expected = float(np.mean(np.sum((predicted - yn) ** 2, axis=1)))   # (1/n) sum_i ||f(x_i) - y_i||^2
    assert adapter.loss(torch.from_numpy(x), torch.from_numpy(y)) == pytest.approx(expected, rel=1e-4)
    assert adapter.fit_loss[-1] < adapter.fit_loss[0]
    if residual:  # identity at initialisation: the first epoch starts from ||x - y||^2
        assert adapter.fit_loss[0] <= float(np.mean(np.sum((x - yn) ** 2, axis=1))) + 1e-6


@pytest.mark.parametrize("kind", ADAPTER_KINDS)
def test_adapters_round_trip_through_safetensors(kind):
    rng = np.random.default_rng(3)
    x, y = torch.from_numpy(_unit_rows(rng, 64, 8)), torch.from_numpy(_unit_rows(rng, 64, 8))
    params = {"rank": 4} if kind == "affine" else ({} if kind == "procrustes" else {"hidden": 8, "epochs": 2})
    adapter = make_adapter(kind, **params).fit(x, y)
    restored = load_adapter_bytes(save_adapter(adapter))
    assert restored.kind == kind and restored.direction == adapter.direction
    assert torch.equal(restored.apply(x), adapter.apply(x))


def test_bad_input_is_refused_with_a_clear_message():
    with pytest.raises(ValueError, match="source has 3 rows, target 4"):
        ProcrustesAdapter().fit(torch.ones(3, 2), torch.ones(4, 2))
    with pytest.raises(ValueError, match="expected one of"):
        make_adapter("lora")


def test_fan_adapter_trained_jointly_chains_and_reads_legacy_files():
    """FAN's psi through the shared interface: objective = the loss formula, chain = psi_2(psi_1(x)) normalised at
    each step, and a bare-Sequential file written before the shared format loads as the same ``fan`` adapter."""
    from safetensors.torch import save

    rng = np.random.default_rng(4)
    x, y = torch.from_numpy(_unit_rows(rng, 40, 6)).float(), torch.from_numpy(_unit_rows(rng, 40, 6)).float()
    torch.manual_seed(0)
    first, second = FanAdapter(hidden=5), FanAdapter(hidden=7)
    first.build(6, 6), second.build(6, 6)
    predicted = _mlp_forward_numpy(first.state_dict(), x.double().numpy(), False, relu=True)
    expected = float(np.mean(np.sum((predicted - y.double().numpy()) ** 2, axis=1)))
    assert float(first.objective(x, y)) == pytest.approx(expected, rel=1e-5)
    assert first.loss(x, y) == pytest.approx(expected, rel=1e-5)

    def unit(a):
        return a / np.linalg.norm(a, axis=1, keepdims=True)

    chained = unit(_mlp_forward_numpy(second.state_dict(), unit(_mlp_forward_numpy(first.state_dict(),
                                                                                    x.double().numpy(), False,
                                                                                    relu=True)), False, relu=True))
    assert np.abs(apply_chain(x, [first, second]).double().numpy() - chained).max() < 1e-5
    legacy = {name: value for name, value in first.state_dict().items() if name != "shape"}
    restored = load_adapter_bytes(save(legacy))
    assert restored.kind == "fan" and torch.equal(restored.apply(x), first.apply(x))


def test_each_listed_kind_has_one_class_of_that_kind_and_direction():
    """compat_core.kinds lists the kinds once (config schema, `compat gate --adapter`); each builds its class."""
    from compat_core.kinds import GALLERY_ADAPTERS, QUERY_ADAPTERS

    assert ADAPTER_KINDS == QUERY_ADAPTERS + GALLERY_ADAPTERS
    for kind in ADAPTER_KINDS:
        adapter = make_adapter(kind)
        assert adapter.kind == kind
        assert adapter.direction == ("query" if kind in QUERY_ADAPTERS else "gallery")
    with pytest.raises(ValueError, match=r"adapter 'rotation': expected one of \['procrustes', 'affine', 'mlp', "):
        make_adapter("rotation")

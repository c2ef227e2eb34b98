"""d-Simplex geometry, Appendix-D variant, closed-form helpers and the class-slot convention."""
from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from compat_core.simplex import (
    SlotMapper,
    dsimplex,
    dsimplex_logits,
    dsimplex_rows,
    finetune_slot,
    pretrain_slot,
)


def recipe_fp64(K: int) -> np.ndarray:
    """SPEC §3 written out literally, dense, in float64: identity rows, alpha row, centre columns, unit rows."""
    W = np.zeros((K, K - 1))
    W[: K - 1] = np.eye(K - 1)
    W[K - 1, :] = (1.0 - math.sqrt(K)) / (K - 1)
    W = W - W.mean(axis=0, keepdims=True)
    return W / np.linalg.norm(W, axis=1, keepdims=True)


def appendix_d_fp64(K: int) -> np.ndarray:
    """The 2026 paper's Appendix D code (Frobenius normalisation with +1e-8), transcribed to numpy."""
    W = np.zeros((K, K - 1))
    W[:-1, :] = np.eye(K - 1)
    c = math.sqrt(1 + (K - 1))
    W[-1, :] = W[-1, :] + (1 - c) / (K - 1)
    W = W - W.mean(axis=0)
    return W / (np.linalg.norm(W) + 1e-8)


def test_k2_is_the_pair_plus_minus_one():
    # K=2: alpha = 1 - sqrt2, column mean (2 - sqrt2)/2, centred rows +-(sqrt2/2): unit rows are +1 and -1.
    np.testing.assert_allclose(dsimplex(2, dtype=torch.float64).numpy(), [[1.0], [-1.0]], atol=1e-15)


def test_k3_hand_worked_values():
    # alpha = (1 - sqrt3)/2 = -0.3660254, column mean m = (1 + alpha)/3 = 0.2113249.
    # centred rows: [1-m, -m] = [0.7886751, -0.2113249], [-m, 1-m], [alpha-m]*2 = [-0.5773503]*2, all of norm sqrt(2/3).
    # unit rows: [cos15deg, -sin15deg], [-sin15deg, cos15deg], [-1/sqrt2, -1/sqrt2].
    c15, s15, h = 0.9659258262890683, 0.25881904510252074, 0.7071067811865476
    expected = [[c15, -s15], [-s15, c15], [-h, -h]]
    np.testing.assert_allclose(dsimplex(3, dtype=torch.float64).numpy(), expected, atol=1e-12)


@pytest.mark.parametrize("K", [2, 3, 10, 1024])
def test_geometry_fp32(K):
    W = dsimplex(K)
    assert W.shape == (K, K - 1) and W.dtype == torch.float32
    W64 = W.double()
    gram = W64 @ W64.T
    np.testing.assert_allclose(gram.diagonal().numpy(), np.ones(K), atol=1e-5)
    off_diagonal = gram[~torch.eye(K, dtype=torch.bool)]
    np.testing.assert_allclose(off_diagonal.numpy(), np.full(K * (K - 1), -1.0 / (K - 1)), atol=1e-5)
    np.testing.assert_allclose(W64.sum(dim=0).numpy(), np.zeros(K - 1), atol=1e-5)
    np.testing.assert_allclose(W64.numpy(), recipe_fp64(K), atol=1e-6)


@pytest.mark.parametrize("K", [2, 3, 10, 257])
def test_frobenius_reproduces_appendix_d(K):
    frobenius = dsimplex(K, norm="frobenius", dtype=torch.float64)
    np.testing.assert_allclose(frobenius.numpy(), appendix_d_fp64(K), atol=1e-14)
    # all centred rows have equal norm, so the Frobenius variant is the row-normalised one shrunk by sqrt(K)
    row = dsimplex(K, dtype=torch.float64)
    np.testing.assert_allclose(frobenius.numpy() * math.sqrt(K), row.numpy(), rtol=1e-7)
    np.testing.assert_allclose(torch.linalg.norm(frobenius, dim=1).numpy(), np.full(K, 1 / math.sqrt(K)), rtol=1e-7)


def test_rows_helper_matches_full_matrix_and_keeps_dtype_device():
    K = 1024
    rows = [0, 7, 1022, 1023, 7]
    full = dsimplex(K)
    np.testing.assert_array_equal(dsimplex_rows(K, rows).numpy(), full[rows].numpy())
    np.testing.assert_array_equal(
        dsimplex_rows(K, np.array(rows), norm="frobenius").numpy(), dsimplex(K, norm="frobenius")[rows].numpy()
    )
    assert dsimplex_rows(K, torch.tensor(rows), dtype=torch.float64).dtype == torch.float64
    assert dsimplex_rows(K, []).shape == (0, K - 1)


def test_k22000_analytic_properties_on_a_few_rows():
    K = 22000
    rows = dsimplex_rows(K, [0, 1, 12345, 21998, 21999], dtype=torch.float64)
    assert rows.shape == (5, K - 1)
    np.testing.assert_allclose(torch.linalg.norm(rows, dim=1).numpy(), np.ones(5), atol=1e-12)
    gram = rows @ rows.T
    off_diagonal = gram[~torch.eye(5, dtype=torch.bool)]
    np.testing.assert_allclose(off_diagonal.numpy(), np.full(20, -1.0 / (K - 1)), atol=1e-12)
    # column 0 of the full matrix holds: row 0's diagonal entry, K-2 off-diagonal entries (as row 1 has there)
    # and the last row's entry; the rows sum to zero iff that column sums to zero.
    diagonal, off, last = rows[0, 0].item(), rows[1, 0].item(), rows[4, 0].item()
    assert abs(diagonal + (K - 2) * off + last) < 1e-10
    # the last row is constant: -1/sqrt(K-1) in every entry (unit norm, equal to minus the mean of the others)
    np.testing.assert_allclose(rows[4].numpy(), np.full(K - 1, -1 / math.sqrt(K - 1)), rtol=1e-12)
    # fp32 rows are the fp64 rows rounded
    np.testing.assert_allclose(dsimplex_rows(K, [0, 21999]).numpy(), rows[[0, 4]].numpy(), rtol=1e-6, atol=1e-9)


def test_closed_form_logits_match_matmul():
    generator = torch.Generator().manual_seed(0)
    K = 1024
    x = torch.randn(6, K - 1, generator=generator, dtype=torch.float64, requires_grad=True)
    for norm in ("row", "frobenius"):
        expected = x @ dsimplex(K, norm=norm, dtype=torch.float64).T
        np.testing.assert_allclose(dsimplex_logits(x, K, norm).detach().numpy(), expected.detach().numpy(), atol=1e-12)
    dsimplex_logits(x, K).sum().backward()
    assert torch.isfinite(x.grad).all()
    # a huge simplex, checked against a few explicit rows
    K = 22000
    x = torch.randn(3, K - 1, generator=generator, dtype=torch.float64)
    slots = [0, 5000, 21999]
    expected = x @ dsimplex_rows(K, slots, dtype=torch.float64).T
    np.testing.assert_allclose(dsimplex_logits(x, K)[:, slots].numpy(), expected.numpy(), atol=1e-10)


def test_peak_memory_is_about_the_output():
    # A dense implementation (eye + mean + division) holds 2-3 copies at once; the closed form holds one.
    K = 6000
    output_mb = K * (K - 1) * 4 / 2**20
    script = textwrap.dedent(
        f"""
        import resource, torch
        from compat_core.simplex import dsimplex
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        W = dsimplex({K})
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print((after - before) / 1024)
        """
    )
    growth_mb = float(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)
    assert growth_mb < 1.3 * output_mb, (growth_mb, output_mb)


@pytest.mark.parametrize("bad", [1, 0, -5, 2.5, True, "10"])
def test_invalid_k_is_refused(bad):
    with pytest.raises(ValueError, match="K"):
        dsimplex(bad)


def test_invalid_norm_and_rows_are_refused():
    with pytest.raises(ValueError, match="norm must be one of"):
        dsimplex(4, norm="l1")
    with pytest.raises(ValueError, match=r"rows must be slot indices in \[0, 4\)"):
        dsimplex_rows(4, [0, 4])
    with pytest.raises(ValueError, match=r"projection must have shape \(B, 3\)"):
        dsimplex_logits(torch.zeros(2, 4), 4)


# ------------------------------------------------------------------------------------------------ slots


def test_slot_functions_on_ints_arrays_tensors():
    assert pretrain_slot(7) == 7
    np.testing.assert_array_equal(pretrain_slot(np.array([0, 3])), [0, 3])
    assert finetune_slot(0, 1024) == 1023
    assert finetune_slot(99, 1024) == 924
    np.testing.assert_array_equal(finetune_slot(np.array([0, 1, 2]), 10), [9, 8, 7])
    out = finetune_slot(torch.tensor([0, 9]), 10)
    assert isinstance(out, torch.Tensor) and out.tolist() == [9, 0]
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        finetune_slot(10, 10)
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        finetune_slot(np.array([-1, 2]), 10)


def test_mapper_iam_cl2r_layout():
    # IAM-CL2R CIFAR100R/10: K=1024, replacement pre-trained on 600 classes, 100 fine-tuning classes.
    mapper = SlotMapper(1024, pretrain_labels=range(600), finetune_labels=range(100))
    assert mapper.num_free_slots == 1024 - 600 - 100
    np.testing.assert_array_equal(mapper.pretrain_slots(np.array([0, 599])), [0, 599])
    assert mapper.pretrain_slots(5) == 5
    slots = mapper.finetune_slots(torch.tensor([0, 99, 3]))
    assert isinstance(slots, torch.Tensor) and slots.tolist() == [1023, 924, 1020]
    assert mapper.finetune_slots(np.int64(1)) == 1022


def test_mapper_refuses_overlap_and_names_labels():
    # K=10: pretrain 0..5 uses slots 0..5; fine-tuning label 4 maps to slot 10-1-4 = 5.
    with pytest.raises(ValueError, match=r"slots \[5\].*pretrain_labels \[5\].*finetune_labels \[4\]"):
        SlotMapper(10, pretrain_labels=range(6), finetune_labels=range(5))
    # exactly filling K is allowed
    assert SlotMapper(10, range(5), range(5)).num_free_slots == 0


def test_mapper_refuses_out_of_range_negative_and_non_integer_labels():
    with pytest.raises(ValueError, match=r"pretrain_labels \[10\].*outside \[0, 10\)"):
        SlotMapper(10, pretrain_labels=[0, 10])
    with pytest.raises(ValueError, match=r"finetune_labels \[12\].*slots \[-3\]"):
        SlotMapper(10, finetune_labels=[12])
    with pytest.raises(ValueError, match="non-negative"):
        SlotMapper(10, pretrain_labels=[-1])
    with pytest.raises(ValueError, match="integer"):
        SlotMapper(10, pretrain_labels=np.array([0.5]))


def test_mapper_growth_and_undeclared_labels():
    mapper = SlotMapper(16, pretrain_labels=range(4))
    grown = mapper.with_labels(pretrain_labels=range(8), finetune_labels=[0, 1])
    assert grown.num_free_slots == 16 - 8 - 2
    assert mapper.num_free_slots == 12  # the original is untouched
    with pytest.raises(ValueError, match="slot overlap"):
        grown.with_labels(finetune_labels=range(9))  # label 8 -> slot 7, already a pre-training slot
    with pytest.raises(ValueError, match=r"finetune labels \[2\] \(1 in all\) were not declared"):
        grown.finetune_slots([1, 2])
    with pytest.raises(ValueError, match=r"pretrain labels \[8, 9\]"):
        grown.pretrain_slots(np.array([8, 9, 1]))


def test_row_eps_rows_are_the_public_construction_divided_by_norm_plus_1e8():
    """The public IAM-CL2R construction, step by step in fp64: identity rows, a last row of (1 - sqrt(1 + n)) / n,
    columns centred, each row divided by its norm + 1e-8."""
    import math

    import torch

    from compat_core.simplex import dsimplex, dsimplex_logits

    K = 6
    n = K - 1
    t = torch.zeros(K, n, dtype=torch.float64)
    t[:n] = torch.eye(n, dtype=torch.float64)
    t[n] = (1.0 - math.sqrt(1.0 + n)) / n
    t -= t.mean(dim=0)
    t /= t.norm(dim=1, keepdim=True) + 1e-8
    torch.testing.assert_close(dsimplex(K, norm="row_eps", dtype=torch.float64), t, rtol=0, atol=1e-15)
    x = torch.randn(3, n, dtype=torch.float64)
    torch.testing.assert_close(dsimplex_logits(x, K, norm="row_eps"), x @ t.T, rtol=0, atol=1e-14)
    assert not torch.equal(dsimplex(K, norm="row_eps", dtype=torch.float64), dsimplex(K, dtype=torch.float64))

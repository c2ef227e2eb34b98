"""PSP / LSP on hand-made probabilities and logits (expected vectors written out), projection matrix, top-k."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from compat_core.evaluation.psp_lsp import lsp, psp, psp_from_logits


def test_psp_own_space_hand_worked():
    # p = [0.7, 0.2, 0.1], C_k = C_t = 3: centred = p - 1/3 = [11, -4, -7]/30, norm sqrt(186)/30
    h = psp(torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64))
    np.testing.assert_allclose(h.numpy(), np.array([11.0, -4.0, -7.0]) / math.sqrt(186.0), atol=1e-12)


def test_psp_drops_unknown_classes_and_centres_with_old_count():
    # C_t = 4, C_k = 3: keep [0.1, 0.6, 0.2], mean over C_k = 0.3 -> [-0.2, 0.3, -0.1] -> [-2, 3, -1]/sqrt14
    probs = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.7, 0.2, 0.1, 0.0]], dtype=torch.float64)
    h = psp(probs, num_classes_old=3)
    expected_row0 = np.array([-2.0, 3.0, -1.0]) / math.sqrt(14.0)
    # row 1: keep [0.7, 0.2, 0.1] (the 4th class has p = 0), same as the C_t = 3 case above
    expected_row1 = np.array([11.0, -4.0, -7.0]) / math.sqrt(186.0)
    np.testing.assert_allclose(h.numpy(), np.stack([expected_row0, expected_row1]), atol=1e-12)
    # C_k = 2 on [0.7, 0.2, 0.1]: keep [0.7, 0.2], centred [0.25, -0.25] -> [1, -1]/sqrt2
    np.testing.assert_allclose(
        psp(torch.tensor([0.7, 0.2, 0.1]), 2).numpy(), [1 / math.sqrt(2), -1 / math.sqrt(2)], atol=1e-7
    )


def test_psp_equals_algorithm_1_matrix_product():
    # Alg. 1: P_kk = I - J/C_k, P_tk = [P_kk | 0] (C_k x C_t), h = P_tk f / ||P_tk f||
    C_t, C_k = 7, 4
    P = np.zeros((C_k, C_t))
    P[:, :C_k] = np.eye(C_k) - np.ones((C_k, C_k)) / C_k
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(5, C_t, generator=generator, dtype=torch.float64) * 3, dim=1)
    projected = probs.numpy() @ P.T
    expected = projected / np.linalg.norm(projected, axis=1, keepdims=True)
    np.testing.assert_allclose(psp(probs, C_k).numpy(), expected, atol=1e-12)


def test_psp_prototypes_of_updated_model_align_with_old_ones():
    # Prop. 2: the one-hot vertex e_y of the C_t-class simplex projects onto the same direction as e_y of the
    # C_k-class simplex. e_0 with C_k = 3: centred [2/3, -1/3, -1/3] -> [2, -1, -1]/sqrt6
    expected = np.array([2.0, -1.0, -1.0]) / math.sqrt(6.0)
    for C_t in (3, 5, 9):
        vertex = torch.zeros(C_t, dtype=torch.float64)
        vertex[0] = 1.0
        np.testing.assert_allclose(psp(vertex, 3).numpy(), expected, atol=1e-12)


def test_psp_from_logits_and_half_precision_input():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]], dtype=torch.float64))
    np.testing.assert_allclose(
        psp_from_logits(logits).numpy(), [np.array([11.0, -4.0, -7.0]) / math.sqrt(186.0)], atol=1e-12
    )
    h = psp(torch.tensor([0.7, 0.2, 0.1], dtype=torch.float16))
    assert h.dtype == torch.float32
    np.testing.assert_allclose(h.numpy(), np.array([11.0, -4.0, -7.0]) / math.sqrt(186.0), atol=2e-3)


def test_psp_top_k():
    # h = [11, -4, -7]/sqrt186. k=1 keeps 11 -> [1, 0, 0]; k=2 keeps 11 and -4 -> [11, -4, 0]/sqrt137
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.2, 0.7]], dtype=torch.float64)
    np.testing.assert_allclose(psp(probs, top_k=1).numpy(), [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]], atol=1e-12)
    s137 = math.sqrt(137.0)
    np.testing.assert_allclose(
        psp(probs, top_k=2).numpy(), [[11 / s137, -4 / s137, 0.0], [0.0, -4 / s137, 11 / s137]], atol=1e-12
    )
    # k >= C_k leaves the feature unchanged
    np.testing.assert_allclose(psp(probs, top_k=3).numpy(), psp(probs).numpy(), atol=0)
    # top-k acts after the projection: on the 3 kept classes of a 4-class output
    h = psp(torch.tensor([0.1, 0.6, 0.2, 0.1], dtype=torch.float64), 3, top_k=2)  # [-2, 3, -1] -> keep 3, -1
    np.testing.assert_allclose(h.numpy(), [0.0, 3 / math.sqrt(10), -1 / math.sqrt(10)], atol=1e-12)


def test_psp_uniform_maps_to_zero_vector():
    assert torch.equal(psp(torch.full((4,), 0.25)), torch.zeros(4))


def test_psp_validation():
    with pytest.raises(ValueError, match="softmax probabilities"):
        psp(torch.tensor([2.0, -1.0, 0.5]))  # logits passed by mistake
    with pytest.raises(ValueError, match="softmax probabilities"):
        psp(torch.tensor([0.5, 0.2, 0.1]))  # sums to 0.8
    with pytest.raises(ValueError, match=r"num_classes_old must be >= 2 and <= 3, got 4"):
        psp(torch.tensor([0.7, 0.2, 0.1]), 4)
    with pytest.raises(ValueError, match=r"num_classes_old must be >= 2"):
        psp(torch.tensor([0.7, 0.2, 0.1]), 1)
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        psp(torch.tensor([0.7, 0.2, 0.1]), top_k=0)
    with pytest.raises(ValueError, match="floating-point"):
        psp(torch.tensor([1, 0, 0]))
    with pytest.raises(ValueError, match=r"shape \(C,\) or \(N, C\)"):
        psp(torch.full((2, 2, 2), 0.5))


def test_lsp_hand_worked():
    # z = [3, 4] -> [0.6, 0.8]
    np.testing.assert_allclose(lsp(torch.tensor([3.0, 4.0])).numpy(), [0.6, 0.8], atol=1e-7)
    z = torch.tensor([[3.0, 4.0, 12.0]], dtype=torch.float64)
    # full: [3, 4, 12]/13; first C_k = 2 logits: [3, 4]/5
    np.testing.assert_allclose(lsp(z).numpy(), [[3 / 13, 4 / 13, 12 / 13]], atol=1e-12)
    np.testing.assert_allclose(lsp(z, num_classes_old=2).numpy(), [[0.6, 0.8]], atol=1e-12)
    # centred (Alg. 1 applied to logits): mean 19/3 -> [-10, -7, 17]/3 -> [-10, -7, 17]/sqrt438
    np.testing.assert_allclose(
        lsp(z, center=True).numpy(), [np.array([-10.0, -7.0, 17.0]) / math.sqrt(438.0)], atol=1e-12
    )
    # top-1: [0, 0, 1]; top-2: keep 4 and 12 -> [0, 4, 12]/sqrt160
    np.testing.assert_allclose(lsp(z, top_k=1).numpy(), [[0.0, 0.0, 1.0]], atol=1e-12)
    np.testing.assert_allclose(lsp(z, top_k=2).numpy(), [[0.0, 4 / math.sqrt(160), 12 / math.sqrt(160)]], atol=1e-12)


def test_lsp_accepts_numpy_and_validates():
    out = lsp(np.array([[3.0, 4.0]]))
    assert isinstance(out, torch.Tensor)
    np.testing.assert_allclose(out.numpy(), [[0.6, 0.8]], atol=1e-12)
    with pytest.raises(ValueError, match=r"num_classes_old must be >= 2 and <= 2, got 3"):
        lsp(np.array([[3.0, 4.0]]), num_classes_old=3)
    with pytest.raises(ValueError, match="top_k must be an int"):
        lsp(np.array([[3.0, 4.0]]), top_k=1.5)

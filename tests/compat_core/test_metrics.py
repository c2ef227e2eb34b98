"""Compatibility metrics (SPEC §1-2) on hand-worked matrices, brute-force property tests, and the matrix record."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compat_core.evaluation.metrics import (
    CompatibilityMatrix,
    average_accuracy,
    average_compatibility,
    average_compatibility_accuracy,
    backward_compatibility,
    empirical_compatibility,
    forward_compatibility,
    metrics_by_task,
    update_gain,
)

NAN = float("nan")

# Hand-worked 3 x 3 matrix (fractions; rows = query model t, columns = gallery model k, 0-based):
#           k=0   k=1   k=2
#   t=0   0.50    -     -
#   t=1   0.55  0.60    -
#   t=2   0.52  0.57  0.70
# ECC pairs: (1,0) 0.55 > 0.50 yes; (2,0) 0.52 > 0.50 yes; (2,1) 0.57 > 0.60 no.
HAND = np.array([[0.50, NAN, NAN], [0.55, 0.60, NAN], [0.52, 0.57, 0.70]])


def test_hand_worked_average_compatibility():
    # 2 compatible pairs out of 3
    assert average_compatibility(HAND) == pytest.approx(2 / 3)
    # tau = 2: only pair (1,0), compatible -> 1/1
    assert average_compatibility(HAND, tau=2) == 1.0


def test_hand_worked_average_accuracy():
    # (0.50 + 0.55 + 0.60 + 0.52 + 0.57 + 0.70) / 6 = 3.44 / 6
    assert average_accuracy(HAND) == pytest.approx(3.44 / 6)
    # tau = 2: (0.50 + 0.55 + 0.60) / 3 = 0.55
    assert average_accuracy(HAND, tau=2) == pytest.approx(0.55)
    # tau = 1: the single self-test
    assert average_accuracy(HAND, tau=1) == pytest.approx(0.50)


def test_hand_worked_aca_is_normalised_by_all_pairs():
    # compatible cross-tests 0.55 + 0.52 = 1.07, divided by all 3 pairs (not by the 2 compatible ones)
    assert average_compatibility_accuracy(HAND) == pytest.approx(1.07 / 3)
    # T = 2 (SPEC): ACA equals the single cross-test when it is compatible
    assert average_compatibility_accuracy(HAND, tau=2) == pytest.approx(0.55)


def test_hand_worked_backward_and_forward_compatibility():
    # BC = ((C[2,0] - C[0,0]) + (C[2,1] - C[1,1])) / 2 = ((0.52 - 0.50) + (0.57 - 0.60)) / 2 = (0.02 - 0.03) / 2
    assert backward_compatibility(HAND) == pytest.approx(-0.005)
    # BC(t=2) (1-based count of models): C[1,0] - C[0,0] = 0.05
    assert backward_compatibility(HAND, t=2) == pytest.approx(0.05)
    assert backward_compatibility(HAND, t=3) == backward_compatibility(HAND)
    # FC = ((C[1,0] - C[1,1]) + (C[2,1] - C[2,2])) / 2 = ((0.55 - 0.60) + (0.57 - 0.70)) / 2 = (-0.05 - 0.13) / 2
    assert forward_compatibility(HAND) == pytest.approx(-0.09)


def test_hand_worked_empirical_compatibility_matrix():
    expected = np.array([[False, False, False], [True, False, False], [True, False, False]])
    np.testing.assert_array_equal(empirical_compatibility(HAND), expected)


def test_metrics_by_task_lists():
    curves = metrics_by_task(HAND)
    assert math.isnan(curves["AC_tau"][0])
    assert curves["AC_tau"][1:] == pytest.approx([1.0, 2 / 3])
    assert curves["AA_tau"] == pytest.approx([0.50, 0.55, 3.44 / 6])
    assert math.isnan(curves["ACA_tau"][0])
    assert curves["ACA_tau"][1:] == pytest.approx([0.55, 1.07 / 3])
    assert math.isnan(curves["BC_t"][0])
    assert curves["BC_t"][1:] == pytest.approx([0.05, -0.005])


def test_strict_versus_non_strict_with_an_equal_cell():
    # cross-test 0.40 equals the self-test 0.40 of gallery model 0
    tied = np.array([[0.40, NAN], [0.40, 0.50]])
    assert average_compatibility(tied, strict=True) == 0.0
    assert average_compatibility(tied, strict=False) == 1.0
    assert average_compatibility_accuracy(tied, strict=True) == 0.0
    assert average_compatibility_accuracy(tied, strict=False) == pytest.approx(0.40)
    assert not empirical_compatibility(tied, strict=True)[1, 0]
    assert empirical_compatibility(tied, strict=False)[1, 0]


def test_values_above_the_diagonal_are_ignored():
    # the papers print 0 above the diagonal; results must not change
    zeros_above = np.nan_to_num(HAND, nan=0.0)
    ones_above = np.nan_to_num(HAND, nan=1.0)
    for matrix in (zeros_above, ones_above):
        assert average_compatibility(matrix) == pytest.approx(2 / 3)
        assert average_accuracy(matrix) == pytest.approx(3.44 / 6)
        assert forward_compatibility(matrix) == pytest.approx(-0.09)


def test_single_model_pair_metrics_are_nan():
    single = np.array([[0.8]])
    assert math.isnan(average_compatibility(single))
    assert math.isnan(average_compatibility_accuracy(single))
    assert math.isnan(backward_compatibility(single))
    assert math.isnan(forward_compatibility(single))
    assert average_accuracy(single) == 0.8


@pytest.mark.parametrize(
    "matrix, message",
    [
        (np.zeros((2, 3)), "square"),
        (np.zeros(3), "square"),
        (np.zeros((0, 0)), "at least one model"),
        (np.array([[0.5, NAN], [NAN, 0.5]]), r"C\[1,0\]"),
        (np.array([[0.5, NAN], [0.4, np.inf]]), r"C\[1,1\]"),
        (np.array([[55.0, NAN], [60.0, 70.0]]), r"C\[0,0\] = 55.0.*divide percentages by 100"),
    ],
)
def test_validation_names_the_problem(matrix, message):
    with pytest.raises(ValueError, match=message):
        average_accuracy(matrix)


@pytest.mark.parametrize("tau", [0, 4, -1, 2.0, True])
def test_tau_out_of_range_is_rejected(tau):
    with pytest.raises(ValueError, match="tau"):
        average_compatibility(HAND, tau=tau)


def test_bc_t_out_of_range_is_rejected():
    with pytest.raises(ValueError, match=r"t=4"):
        backward_compatibility(HAND, t=4)


def test_update_gain_hand_worked():
    # (0.62 - 0.60) / (0.70 - 0.60) = 0.02 / 0.10
    assert update_gain(0.62, 0.60, 0.70) == pytest.approx(0.2)
    # a cross-test below the old self-test gives a negative gain: (0.55 - 0.60) / (0.70 - 0.60)
    assert update_gain(0.55, 0.60, 0.70) == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="self_upper"):
        update_gain(0.62, 0.60, 0.60)
    with pytest.raises(ValueError, match="cross"):
        update_gain(float("nan"), 0.60, 0.70)


# --- property tests against brute-force loops ---------------------------------------------------------------------

def _lower_triangle_matrix(draw, values):
    size = draw(st.integers(min_value=1, max_value=6))
    matrix = np.full((size, size), NAN)
    for t in range(size):
        for k in range(t + 1):
            matrix[t, k] = draw(values)
    return matrix


@st.composite
def matrices(draw):
    # half the draws use a coarse grid so that ties between cross- and self-tests are frequent
    coarse = draw(st.booleans())
    values = (
        st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0])
        if coarse
        else st.floats(min_value=0.0, max_value=1.0, allow_nan=False, allow_infinity=False)
    )
    return _lower_triangle_matrix(draw, values)


def _brute_force(matrix, strict):
    size = len(matrix)
    cross = [(t, k) for t in range(size) for k in range(t)]
    compatible = [
        (t, k) for t, k in cross if (matrix[t][k] > matrix[k][k] if strict else matrix[t][k] >= matrix[k][k])
    ]
    entries = [matrix[t][k] for t in range(size) for k in range(t + 1)]
    return {
        "AC": len(compatible) / len(cross) if cross else NAN,
        "AA": sum(entries) / len(entries),
        "ACA": sum(matrix[t][k] for t, k in compatible) / len(cross) if cross else NAN,
        "cross_mean": sum(matrix[t][k] for t, k in cross) / len(cross) if cross else NAN,
    }


@settings(max_examples=150, deadline=None)
@given(matrix=matrices(), strict=st.booleans())
def test_properties_against_brute_force(matrix, strict):
    expected = _brute_force(matrix, strict)
    size = len(matrix)
    ac = average_compatibility(matrix, strict=strict)
    aca = average_compatibility_accuracy(matrix, strict=strict)
    assert average_accuracy(matrix) == pytest.approx(expected["AA"], abs=1e-12)
    if size == 1:
        assert math.isnan(ac) and math.isnan(aca)
        return
    assert 0.0 <= ac <= 1.0
    assert ac == pytest.approx(expected["AC"], abs=1e-12)
    assert aca == pytest.approx(expected["ACA"], abs=1e-12)
    assert aca <= expected["cross_mean"] + 1e-12
    assert average_compatibility(matrix, strict=False) >= average_compatibility(matrix, strict=True)
    assert average_compatibility(matrix, tau=size, strict=strict) == ac
    assert average_accuracy(matrix, tau=size) == average_accuracy(matrix)
    assert average_compatibility_accuracy(matrix, tau=size, strict=strict) == aca
    assert backward_compatibility(matrix, t=size) == backward_compatibility(matrix)
    assert int(empirical_compatibility(matrix, strict=strict).sum()) == round(expected["AC"] * size * (size - 1) / 2)


@settings(max_examples=60, deadline=None)
@given(matrix=matrices())
def test_leading_block_equals_metric_of_the_cropped_matrix(matrix):
    size = len(matrix)
    for tau in range(2, size + 1):
        block = matrix[:tau, :tau]
        assert average_compatibility(matrix, tau=tau) == average_compatibility(block)
        assert average_accuracy(matrix, tau=tau) == average_accuracy(block)
        assert backward_compatibility(matrix, t=tau) == backward_compatibility(block)


# --- CompatibilityMatrix record -------------------------------------------------------------------------------------

def _record(values=HAND, ids=("m0", "m1", "m2")):
    return CompatibilityMatrix(values, list(ids), "recall_at_1", {"gallery": "instances", "strict": True})


def test_json_round_trip_is_exact_and_writes_null_above_the_diagonal():
    rng = np.random.default_rng(3)
    values = np.tril(rng.random((4, 4)))
    values[0, 0] = 0.1 + 0.2  # a float whose shortest repr has 17 significant digits
    values[np.triu_indices(4, k=1)] = NAN
    record = _record(values, ["a", "b", "c", "d"])
    text = record.to_json()
    parsed = json.loads(text)
    assert parsed["values"][0][1] is None and parsed["values"][2][3] is None
    assert parsed["units"] == "fraction" and parsed["metric"] == "recall_at_1"
    back = CompatibilityMatrix.from_json(text)
    np.testing.assert_array_equal(back.values, values)  # NaN positions compare equal
    assert back.values[0, 0] == 0.1 + 0.2
    assert back.model_ids == ["a", "b", "c", "d"]
    assert back.protocol == {"gallery": "instances", "strict": True}


def test_csv_round_trip_is_exact_with_empty_cells_above_the_diagonal():
    values = HAND.copy()
    values[2, 1] = 1 / 3
    record = _record(values)
    text = record.to_csv()
    lines = text.splitlines()
    assert lines[0] == "query\\gallery,m0,m1,m2"
    assert lines[1] == "m0,0.5,,"
    back = CompatibilityMatrix.from_csv(text, metric="recall_at_1", protocol={"strict": True})
    np.testing.assert_array_equal(back.values, values)
    assert back.values[2, 1] == 1 / 3
    assert back.model_ids == ["m0", "m1", "m2"]


def test_csv_rejects_mismatched_row_ids():
    text = "query\\gallery,m0,m1\nm0,0.5,\nmX,0.4,0.6\n"
    with pytest.raises(ValueError, match="'mX' differs from column id 'm1'"):
        CompatibilityMatrix.from_csv(text, metric="recall_at_1")


def test_from_json_rejects_missing_keys_and_nulls_below_the_diagonal():
    good = json.loads(_record().to_json())
    missing = dict(good)
    del missing["model_ids"]
    with pytest.raises(KeyError, match="model_ids"):
        CompatibilityMatrix.from_dict(missing)
    holed = json.loads(_record().to_json())
    holed["values"][2][1] = None
    with pytest.raises(ValueError, match=r"values\[2\]\[1\]"):
        CompatibilityMatrix.from_dict(holed)


def test_record_validation():
    with pytest.raises(ValueError, match="model_ids: expected 3 ids"):
        CompatibilityMatrix(HAND, ["a", "b"], "recall_at_1")
    with pytest.raises(ValueError, match="repeated"):
        CompatibilityMatrix(HAND, ["a", "b", "a"], "recall_at_1")
    with pytest.raises(ValueError, match="units"):
        CompatibilityMatrix(HAND, ["a", "b", "c"], "recall_at_1", units="percent")
    with pytest.raises(ValueError, match="model_ids: expected a list"):
        CompatibilityMatrix(np.array([[0.5]]), "a", "recall_at_1")
    with pytest.raises(ValueError, match="protocol: must be JSON-serialisable"):
        CompatibilityMatrix(np.array([[0.5]]), ["a"], "recall_at_1", {"when": object()})
    with pytest.raises(ValueError, match=r"values\[1,0\]"):
        CompatibilityMatrix(np.array([[0.5, NAN], [NAN, 0.4]]), ["a", "b"], "recall_at_1")


def test_record_replaces_values_above_the_diagonal_by_nan():
    record = _record(np.nan_to_num(HAND, nan=0.0))
    assert np.isnan(record.values[np.triu_indices(3, k=1)]).all()


def test_render_shows_percent_dashes_and_ecc_failures():
    text = _record().render()
    lines = text.splitlines()
    assert lines[0].startswith("recall_at_1 (percent)")
    # row m2: 0.52 compatible, 0.57 fails the ECC against C[1,1] = 0.60, diagonal 0.70
    row_m2 = next(line for line in lines if line.startswith("m2"))
    assert row_m2.split() == ["m2", "52.00", "57.00*", "70.00"]
    row_m0 = next(line for line in lines if line.startswith("m0"))
    assert row_m0.split() == ["m0", "50.00", "-", "-"]
    assert any(line.startswith("legend:") and "*" in line for line in lines)
    assert "AC 0.6667" in text


def test_summary_matches_the_functions():
    summary = _record().summary()
    assert summary["AC"] == pytest.approx(2 / 3)
    assert summary["AA"] == pytest.approx(3.44 / 6)
    assert summary["ACA"] == pytest.approx(1.07 / 3)
    assert summary["BC"] == pytest.approx(-0.005)
    assert summary["FC"] == pytest.approx(-0.09)
    non_strict = CompatibilityMatrix(np.array([[0.4, NAN], [0.4, 0.5]]), ["a", "b"], "recall_at_1", {"strict": False})
    assert non_strict.summary()["AC"] == 1.0


def test_the_criterion_is_written_once_for_numbers_and_arrays():
    from compat_core.evaluation.metrics import criterion_sign, is_compatible, upgrade_verdict

    assert bool(is_compatible(0.61, 0.6)) and not bool(is_compatible(0.6, 0.6))
    assert bool(is_compatible(0.6, 0.6, strict=False)) and not bool(is_compatible(0.59, 0.6, strict=False))
    cross = np.array([0.7, 0.5, np.nan])
    assert is_compatible(cross, 0.5).tolist() == [True, False, False]
    assert is_compatible(cross, 0.5, strict=False).tolist() == [True, True, False]
    assert (criterion_sign(True), criterion_sign(False)) == (">", ">=")
    assert upgrade_verdict(0.6, 0.6)["compatible"] is False and upgrade_verdict(0.6, 0.6, strict=False)["compatible"]

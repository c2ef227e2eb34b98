"""The demo states whether the README's criteria were met, from the two runs' metrics (hand-worked values)."""
from __future__ import annotations

from app.commands.demo import demo_criteria


def test_criteria_met_and_not_met_with_the_measured_values():
    hoc = {"AC": 0.5238095238095238, "AA": 0.6690563086548488}
    er = {"AC": 0.0, "AA": 0.39156456378171706}
    assert demo_criteria(hoc, er) == [("d-Simplex-HOC AC >= 0.5", True, "0.524"), ("ER AC <= 0.25", True, "0.000"),
                                      ("HOC AA >= 1.5x ER's", True, "1.71x")]
    # 8 of 21 pairs compatible is below the floor; AA 0.5 / 0.4 = 1.25x misses the ratio; ER at 6 of 21 is above 0.25
    missed = demo_criteria({"AC": 8 / 21, "AA": 0.5}, {"AC": 6 / 21, "AA": 0.4})
    assert [(name, met) for name, met, _ in missed] == [("d-Simplex-HOC AC >= 0.5", False), ("ER AC <= 0.25", False),
                                                        ("HOC AA >= 1.5x ER's", False)]
    assert [value for _, _, value in missed] == ["0.381", "0.286", "1.25x"]

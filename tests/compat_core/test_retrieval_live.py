"""The live check's policy: which stage an "auto" search runs on, from hand-fed readings."""
from __future__ import annotations

import threading

import pytest

from compat_core.retrieval.live import CANDIDATE, FP32, LiveCheck, alternating_plan


def test_plan_warms_then_alternates_then_leaves_spare_chunks():
    bounds, plan = alternating_plan(100, 100 + 10 * 512, 512, warm=2, pairs=2, spare=2)
    assert bounds == [(100 + 512 * i, 100 + 512 * (i + 1)) for i in range(8)]
    assert plan == {bounds[2]: CANDIDATE, bounds[3]: FP32, bounds[4]: CANDIDATE, bounds[5]: FP32}


def test_plan_drops_spare_chunks_that_do_not_fit_and_refuses_too_few_rows():
    bounds, plan = alternating_plan(0, 6 * 512 + 100, 512, warm=2, pairs=2, spare=4)
    assert len(bounds) == 6 and len(plan) == 4
    with pytest.raises(ValueError, match="fewer than 6 probe chunks of 512"):
        alternating_plan(0, 5 * 512, 512, warm=2, pairs=2, spare=0)


def _check():
    bounds, plan = alternating_plan(0, 8 * 10, 10, warm=2, pairs=2, spare=2)
    return bounds, LiveCheck(plan, margin=1.1, pairs=2)


def test_a_stage_within_the_margin_is_kept_after_one_pair():
    bounds, check = _check()
    assert [check.stage_for(b) for b in bounds] == [CANDIDATE, CANDIDATE, CANDIDATE, FP32, CANDIDATE, FP32,
                                                    CANDIDATE, CANDIDATE]
    check.record(CANDIDATE, 1.09e-5)
    assert check.decided is None                    # no fp32 reading yet
    check.record(FP32, 1.0e-5)
    assert check.decided == CANDIDATE
    assert [check.stage_for(b) for b in bounds] == [CANDIDATE] * 8
    assert not check.timed(bounds[5], FP32)         # the second pair's fp32 chunk is no longer a reading


def test_one_slow_reading_does_not_decide_and_a_faster_one_keeps_the_stage():
    bounds, check = _check()
    check.record(CANDIDATE, 3.0e-5)                 # e.g. a reading slowed by another process's cache traffic
    check.record(FP32, 1.0e-5)
    assert check.decided is None and check.timed(bounds[4], CANDIDATE)
    check.record(CANDIDATE, 1.05e-5)                # min 1.05e-5 <= 1.1 * 1.0e-5
    assert check.decided == CANDIDATE


def test_a_stage_slower_in_every_pair_is_left_and_later_readings_are_ignored():
    bounds, check = _check()
    for candidate, fp32 in ((1.5e-5, 1.0e-5), (1.2e-5, 1.05e-5)):     # 1.2 > 1.1 * 1.0 (the best of each side)
        check.record(CANDIDATE, candidate)
        check.record(FP32, fp32)
    assert check.decided == FP32
    assert [check.stage_for(b) for b in bounds] == [FP32] * 8
    check.record(CANDIDATE, 1e-9)
    assert check.decided == FP32 and check.readings[CANDIDATE] == [1.5e-5, 1.2e-5]


def test_readings_from_many_threads_decide_once():
    bounds, check = _check()
    decided = []

    def report(stage, value):
        check.record(stage, value)
        decided.append(check.decided)

    threads = [threading.Thread(target=report, args=(CANDIDATE if i % 2 == 0 else FP32, 2e-5 if i % 2 == 0 else 1e-5))
               for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert check.decided == FP32
    assert len(check.readings[CANDIDATE]) >= 2 and len(check.readings[FP32]) >= 2
    assert sum(len(v) for v in check.readings.values()) <= 16


def test_invalid_settings_are_refused():
    with pytest.raises(ValueError, match="margin >= 1 and pairs >= 1"):
        LiveCheck({}, margin=0.9, pairs=2)

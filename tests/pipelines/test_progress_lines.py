"""pipelines.engine.progress with the records of pipelines.engine.events: off a terminal the reporter writes flushed
lines (start, progress with ETA, end), forwards every record to its sinks, and unwraps records tagged by stage."""
from __future__ import annotations

import io
import re
from dataclasses import dataclass

from pipelines.engine.events import ProgressUpdate, StageEvent, StageRecord
from pipelines.engine.progress import ProgressReporter


@dataclass
class EpochRecord:  # a per-epoch training summary: for the sinks, never a progress line of its own
    epoch: int
    loss: float


def test_lines_for_a_stage_and_its_progress():
    stream, seen = io.StringIO(), []
    reporter = ProgressReporter(enabled=True, sinks=[seen.append], stream=stream, line_interval_s=0.0, label="er")
    started = StageEvent("k1", "finetune[t=0]", "finetune", "started", 0, 3)
    update = ProgressUpdate("k1", 1, 4, "batch", images_per_second=120.0)
    steps = ProgressUpdate("k1", 61, 2700, "step", images_per_second=50.0, epoch=2, epochs=30)
    done = StageEvent("k1", "finetune[t=0]", "finetune", "done", 0, 3, seconds=2.25)
    for record in (started, update, StageRecord("k1", EpochRecord(1, 0.5)), steps, done):
        reporter(record)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[er] [1/3] finetune[t=0]: started"
    assert re.fullmatch(r"\[er\] \[1/3\] finetune\[t=0\]: batch 1/4, 120 img/s, \d+ s elapsed, ETA \d+ s", lines[1])
    # the step's line names the epoch in progress of the stage's epochs (the epoch record itself shows nothing)
    assert re.fullmatch(r"\[er\] \[1/3\] finetune\[t=0\]: epoch 2/30, step 61/2700, 50 img/s, \d+ s elapsed, "
                        r"ETA \d+ s", lines[2])
    assert lines[3] == "[er] [1/3] finetune[t=0]: done in 2.2 s"
    assert len(lines) == 4
    assert seen[0] is started and seen[-1] is done and len(seen) == 5  # sinks get the records as they came


def test_eta_comes_from_the_measured_rate():
    stream = io.StringIO()
    reporter = ProgressReporter(enabled=False, stream=stream, line_interval_s=0.0)
    reporter.follow(StageEvent("k", "pretrain[p1]", "pretrain", "started", 0, 0))
    reporter._started -= 30.0  # the stage began 30 s ago: 100 of 400 steps done -> 90 s to go
    reporter(ProgressUpdate("k", 100, 400, "step", epoch=1, epochs=4))
    line = stream.getvalue().splitlines()
    # a worker's reporter follows a stage the driver announced: no "started" line and no graph position
    assert len(line) == 1 and line[0].startswith("pretrain[p1]: epoch 1/4, step 100/400, 30 s elapsed, ETA ")
    assert 89 <= int(line[0].rsplit("ETA ", 1)[1].split()[0]) <= 91


def test_skipped_stages_and_quiet_intervals():
    stream = io.StringIO()
    reporter = ProgressReporter(enabled=False, stream=stream, line_interval_s=3600.0)
    reporter(StageEvent("k2", "extract[t=0,gallery]", "extract", "started", 4, 9))
    reporter(ProgressUpdate("k2", 1, 10, "batch"))  # within the hour since the start: no line
    reporter(StageEvent("k3", "entry[1,0]", "entry", "skipped", 5, 9))
    assert stream.getvalue().splitlines() == ["[5/9] extract[t=0,gallery]: started", "[6/9] entry[1,0]: skipped"]

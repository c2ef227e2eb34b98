"""pipelines.engine.progress with the records of pipelines.engine.events: off a terminal the reporter writes flushed
lines (start, progress with ETA, end), forwards every record to its sinks, and unwraps records tagged by stage."""
from __future__ import annotations

import io
import re
from dataclasses import dataclass

from pipelines.engine.events import ProgressUpdate, StageEvent, StageRecord
from pipelines.engine.progress import ProgressReporter


@dataclass
class EpochRecord:  # the fields of a TrainRecord the reporter reads
    epoch: int
    epochs: int
    images_per_second: float
    loss: float


def test_lines_for_a_stage_and_its_progress():
    stream, seen = io.StringIO(), []
    reporter = ProgressReporter(enabled=True, sinks=[seen.append], stream=stream, line_interval_s=0.0, label="er")
    started = StageEvent("k1", "finetune[t=0]", "finetune", "started", 0, 3)
    update = ProgressUpdate("k1", 1, 4, "batch", images_per_second=120.0)
    done = StageEvent("k1", "finetune[t=0]", "finetune", "done", 0, 3, seconds=2.25)
    for record in (started, update, StageRecord("k1", EpochRecord(1, 4, 50.0, 0.5)), done):
        reporter(record)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[er] [1/3] finetune[t=0]: started"
    assert re.fullmatch(r"\[er\] \[1/3\] finetune\[t=0\]: batch 1/4, 120 img/s, \d+ s elapsed, ETA \d+ s", lines[1])
    # a training record inside a stage tag: epoch 1 (0-based) of 4 is the second epoch done
    assert re.fullmatch(r"\[er\] \[1/3\] finetune\[t=0\]: epoch 2/4, 50 img/s, \d+ s elapsed, ETA \d+ s", lines[2])
    assert lines[3] == "[er] [1/3] finetune[t=0]: done in 2.2 s"
    assert seen[0] is started and seen[-1] is done and len(seen) == 4  # sinks get the records as they came


def test_skipped_stages_and_quiet_intervals():
    stream = io.StringIO()
    reporter = ProgressReporter(enabled=False, stream=stream, line_interval_s=3600.0)
    reporter(StageEvent("k2", "extract[t=0,gallery]", "extract", "started", 4, 9))
    reporter(ProgressUpdate("k2", 1, 10, "batch"))  # within the hour since the start: no line
    reporter(StageEvent("k3", "entry[1,0]", "entry", "skipped", 5, 9))
    assert stream.getvalue().splitlines() == ["[5/9] extract[t=0,gallery]: started", "[6/9] entry[1,0]: skipped"]

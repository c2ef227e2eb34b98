"""The retrieval kernel's live check: which candidate stage the rest of an "auto" search runs on.

The calibration picks the candidate stage from products measured once per machine, maybe under another load, and
on other data; the data of the call decide how many candidates the stage leaves to re-scoring. So an "auto" search
times the stage against the kernel's fp32 stage (an fp32 product and its narrow window: the exact counterpart of
a plain fp32 loop; in the gallery's low-rank coordinates where its rank is at most D/2, which costs at most about
half the full product) on its own early chunks. Both sides run real chunks of the search, alternating
(every chunk is exact on either stage, so nothing is computed twice); a reading is one chunk's seconds per query
row on the worker's clock. The policy is pure: ``LiveCheck`` takes readings and says which stage a chunk runs on;
the kernel times and runs them.
"""
from __future__ import annotations

import threading

CANDIDATE = "candidate"
FP32 = "fp32"


class LiveCheck:
    """Decides between the candidate stage and the fp32 stage from readings of the live search.

    ``planned``: the probe chunks (start, stop) and the stage each is timed on, alternating candidate / fp32.
    The candidate stage is kept as soon as its best reading is within ``margin`` times the fp32 stage's best;
    it is left once ``pairs`` readings of each side say it is slower (one slow reading on a busy machine does not
    decide). Until then, chunks outside the plan run on the candidate stage (the calibration's choice). Thread
    safe: the kernel's workers report readings concurrently.
    """

    def __init__(self, planned: dict[tuple[int, int], str], margin: float, pairs: int) -> None:
        if margin < 1.0 or pairs < 1:
            raise ValueError(f"LiveCheck: expected margin >= 1 and pairs >= 1, got {margin} and {pairs}")
        self.planned = dict(planned)
        self.margin = margin
        self.pairs = pairs
        self.readings: dict[str, list[float]] = {CANDIDATE: [], FP32: []}
        self.decided: str | None = None
        self._lock = threading.Lock()

    def stage_for(self, bounds: tuple[int, int]) -> str:
        """The stage the chunk ``bounds`` runs on now."""
        with self._lock:
            if self.decided is not None:
                return self.decided
            return self.planned.get(bounds, CANDIDATE)

    def timed(self, bounds: tuple[int, int], stage: str) -> bool:
        """Whether the chunk ``bounds``, run on ``stage``, is a reading the decision still needs."""
        with self._lock:
            return self.decided is None and self.planned.get(bounds) == stage

    def record(self, stage: str, seconds_per_row: float) -> None:
        """Add a reading of ``stage`` (seconds per query row) and decide when the readings allow it."""
        with self._lock:
            if self.decided is not None:
                return
            self.readings[stage].append(seconds_per_row)
            candidate, fp32 = self.readings[CANDIDATE], self.readings[FP32]
            if not candidate or not fp32:
                return
            if min(candidate) <= self.margin * min(fp32):
                self.decided = CANDIDATE
            elif len(candidate) >= self.pairs and len(fp32) >= self.pairs:
                self.decided = FP32


def alternating_plan(start: int, stop: int, size: int, warm: int, pairs: int, spare: int) -> tuple[
        list[tuple[int, int]], dict[tuple[int, int], str]]:
    """Probe chunks of ``size`` rows from row ``start`` (none past ``stop``): ``warm`` untimed chunks on the
    candidate stage (one per worker: the first call of a half product pays for kernel selection and buffers),
    ``pairs`` pairs timed alternately on the candidate and the fp32 stage, then up to ``spare`` untimed chunks (a
    worker that finishes its timed chunk before the other takes one of these, not a full-size chunk on a stage
    the pending decision may leave). Returns (every probe chunk in order, the timed ones' plan)."""
    count = min(warm + 2 * pairs + spare, (stop - start) // size)
    if count < warm + 2 * pairs:
        raise ValueError(f"alternating_plan: {stop - start} rows hold fewer than {warm + 2 * pairs} probe chunks "
                         f"of {size}")
    edges = [start + size * i for i in range(count + 1)]
    bounds = list(zip(edges[:-1], edges[1:]))
    timed = bounds[warm:warm + 2 * pairs]
    return bounds, {chunk: (CANDIDATE if i % 2 == 0 else FP32) for i, chunk in enumerate(timed)}

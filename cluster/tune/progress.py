"""Progress of a search in the driver's terminal or log: one line per trial event (started, each task it reports
with its objective, finished, stopped early, failed), named by the trial's id and sampled values. The trials' own
stage lines (tasks, epochs, images/s, ETA) come from their workers, labelled ``[trial <id>]``
(:func:`cluster.tune.trial.run_trial_pipeline`); Ray Tune's periodic status table is left off (``verbose=0``)."""
from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from cluster.tune.callbacks import lazy_callback_class
from cluster.tune.spec import OBJECTIVE_KEY, TIME_ATTR
from cluster.tune.tracking import params_text


def progress_callback_class():
    """The Tune callback class, built on first use so that importing this module does not import Ray (slow)."""
    return lazy_callback_class(globals(), "TrialProgressLines", _TrialProgressLinesMixin)


def __getattr__(name: str):
    # pickle finds the class by name (Tune stores callbacks with the experiment)
    if name == "TrialProgressLines":
        return progress_callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _TrialProgressLinesMixin:
    """Driver-side Tune callback printing a flushed line per trial event (picklable: the stream is not kept)."""

    def __init__(self, objective: str, num_tasks: int, samples: int, stream: TextIO | None = None) -> None:
        self.objective = objective
        self.num_tasks = num_tasks
        self.samples = samples
        self._stream = stream
        self._started = time.monotonic()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_stream": None}

    def line(self, trial: Any, text: str) -> str:
        """``[search 12 s] trial <id> (lam=0.1): <text>`` printed and returned."""
        params = params_text(getattr(trial, "config", None) or {})
        shown = f"[search {time.monotonic() - self._started:.0f} s] trial {trial.trial_id}" + \
            (f" ({params})" if params else "") + f": {text}"
        print(shown, file=self._stream or sys.stdout, flush=True)
        return shown

    def on_trial_start(self, iteration, trials, trial, **info):
        self.line(trial, f"started ({len(trials)} of {self.samples} trials begun)")

    def on_trial_result(self, iteration, trials, trial, result, **info):
        value = result.get(OBJECTIVE_KEY)
        shown = f"{self.objective} {value:.4f}" if isinstance(value, (int, float)) else f"{self.objective} n/a"
        self.line(trial, f"task {int(result.get(TIME_ATTR, 0))}/{self.num_tasks} reported, {shown}")

    def on_trial_complete(self, iteration, trials, trial, **info):
        done = int((trial.last_result or {}).get(TIME_ATTR, 0))
        self.line(trial, "finished" if done >= self.num_tasks else
                  f"stopped early after task {done}/{self.num_tasks} (scheduler)")

    def on_trial_error(self, iteration, trials, trial, **info):
        self.line(trial, "failed (its error is in the trial's folder and the search summary)")


__all__ = ["progress_callback_class"]

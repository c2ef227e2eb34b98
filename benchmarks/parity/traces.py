"""Per-step comparison of two training traces (ours and the public code's) and its table.

A trace is a list of steps ``{"step": int, "task": int, "loss": float, "lr": float}`` in order; the parameter
difference of a step (max |ours - public| over every floating-point tensor of the model's state after the step) is
measured while ours runs and passed in beside the traces.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StepRow:
    step: int
    task: int
    loss_ours: float
    loss_public: float
    loss_diff: float
    param_diff: float
    lr_ours: float
    lr_public: float


@dataclass(frozen=True)
class Summary:
    steps: int
    max_loss_diff: float
    max_param_diff: float
    max_lr_diff: float
    worst_loss_step: int
    worst_param_step: int


def compare_traces(ours: list[dict], public: list[dict], param_diffs: list[float]) -> tuple[list[StepRow], Summary]:
    """Rows and summary of two aligned traces; ValueError when they do not describe the same steps (count, step
    numbers, tasks) or a value is not finite (a NaN must never pass as parity)."""
    if not ours or len(ours) != len(public) or len(param_diffs) != len(ours):
        raise ValueError(f"traces must be non-empty and of equal length: ours {len(ours)} steps, public "
                         f"{len(public)}, parameter differences {len(param_diffs)}")
    rows = []
    for mine, theirs, param in zip(ours, public, param_diffs):
        if (mine["step"], mine["task"]) != (theirs["step"], theirs["task"]):
            raise ValueError(f"traces diverge in structure: ours step {mine['step']} task {mine['task']}, public "
                             f"step {theirs['step']} task {theirs['task']}")
        values = (mine["loss"], theirs["loss"], param, mine["lr"], theirs["lr"])
        if not all(math.isfinite(v) for v in values):
            raise ValueError(f"step {mine['step']}: a non-finite value among loss/param/lr {values}")
        rows.append(StepRow(mine["step"], mine["task"], mine["loss"], theirs["loss"], abs(mine["loss"] - theirs["loss"]),
                            param, mine["lr"], theirs["lr"]))
    worst_loss = max(rows, key=lambda r: r.loss_diff)
    worst_param = max(rows, key=lambda r: r.param_diff)
    summary = Summary(len(rows), worst_loss.loss_diff, worst_param.param_diff,
                      max(abs(r.lr_ours - r.lr_public) for r in rows), worst_loss.step, worst_param.step)
    return rows, summary


def format_table(rows: list[StepRow], summary: Summary, title: str) -> str:
    """The per-step table and the summary as plain text."""
    lines = [title, f"{'step':>4} {'task':>4} {'loss ours':>22} {'loss public':>22} {'|diff|':>9} "
                    f"{'max|dparam|':>11} {'lr':>9}"]
    for r in rows:
        lines.append(f"{r.step:>4} {r.task + 1:>4} {r.loss_ours:>22.17f} {r.loss_public:>22.17f} {r.loss_diff:>9.2e} "
                     f"{r.param_diff:>11.2e} {r.lr_ours:>9.2e}")
    lines.append(f"summary: {summary.steps} steps; max |loss diff| {summary.max_loss_diff:.2e} (step "
                 f"{summary.worst_loss_step}); max |param diff| {summary.max_param_diff:.2e} (step "
                 f"{summary.worst_param_step}); max |lr diff| {summary.max_lr_diff:.2e}")
    return "\n".join(lines)

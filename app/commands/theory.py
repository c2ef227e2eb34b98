"""``compat theory``: Monte Carlo check of Theorem 1 (stationarity implies compatibility, SPEC §6).

Prints one table for the same-class inequality and one for the different-class inequality, then a verdict.
Exit code 0 when every Monte Carlo inequality holds, 1 otherwise, 2 for invalid options.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from compat_core.evaluation import theory

_CASES = (
    ("same_class", "Same class: expect E[d(old,new)] <= E[d(old,old)]"),
    ("different_class", "Different classes (d-Simplex vertices, cosine -1/d): expect E[d(old,new)] >= E[d(old,old)]"),
)


def format_table(records: list[theory.Theorem1Record], case: str, title: str) -> str:
    """Text table of one case: dim, angles, samples, the two Monte Carlo means, their exact values, holds."""
    header = (
        f"{'dim':>6} {'old°':>6} {'new°':>6} {'samples':>8} {'E[d(old,new)]':>14} {'E[d(old,old)]':>14} "
        f"{'diff/se':>9} {'exact new':>10} {'exact old':>10} {'holds':>6}"
    )
    lines = [title, header, "-" * len(header)]
    for record in (r for r in records if r.case == case):
        difference = record.old_new - record.old_old
        z_score = difference / record.difference_se if record.difference_se > 0 else float("inf")
        lines.append(
            f"{record.dim:>6d} {record.old_cap_deg:>6g} {record.new_cap_deg:>6g} {record.samples:>8d} "
            f"{record.old_new:>14.6f} {record.old_old:>14.6f} {z_score:>9.1f} "
            f"{record.exact_old_new:>10.6f} {record.exact_old_old:>10.6f} {'yes' if record.holds else 'NO':>6}"
        )
    return "\n".join(lines)


def write_plot(records: list[theory.Theorem1Record], path: Path) -> None:
    """Two panels like Fig. 12 of the 2026 paper: expected cosine distance against dimension, per case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for axis, (case, title) in zip(axes, _CASES):
        case_records = [r for r in records if r.case == case]
        settings = sorted({(r.old_cap_deg, r.new_cap_deg, r.samples) for r in case_records})
        for old_deg, new_deg, samples in settings:
            rows = sorted(
                (r for r in case_records if (r.old_cap_deg, r.new_cap_deg, r.samples) == (old_deg, new_deg, samples)),
                key=lambda r: r.dim,
            )
            dims = [r.dim for r in rows]
            label = f"old {old_deg:g}°, new {new_deg:g}°"
            axis.plot(dims, [r.old_new for r in rows], "o-", label=f"E[d(old,new)] {label}")
            axis.plot(dims, [r.old_old for r in rows], "s--", label=f"E[d(old,old)] {label}")
        axis.set_xscale("log")
        axis.set_xlabel("dimension d")
        axis.set_ylabel("expected cosine distance")
        axis.set_title(title.split(":")[0])
        axis.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run(args: argparse.Namespace) -> int:
    """Run the grid, print both tables and the verdict; 0 when all inequalities hold, 1 otherwise, 2 on bad input."""
    try:
        records = theory.theorem1_monte_carlo(
            dims=args.dims, old_cap_deg=args.old_angle, new_cap_deg=args.new_angle, samples=args.samples,
            seed=args.seed,
        )
    except ValueError as error:
        print(f"compat theory: error: {error}", file=sys.stderr)
        return 2
    print("Theorem 1 Monte Carlo check: uniform points on hyperspherical caps, cosine distance d = 1 - cos.")
    print("'exact' columns: closed form 1 - m(old) m(new) <w_i, w_j>, m = mean cosine to the cap centre.")
    print("'diff/se': (E[d(old,new)] - E[d(old,old)]) / its Monte Carlo standard error.\n")
    verdicts = []
    for case, title in _CASES:
        print(format_table(records, case, title))
        case_holds = all(r.holds for r in records if r.case == case)
        verdicts.append(case_holds)
        state = "holds in every setting" if case_holds else "is VIOLATED in some setting"
        print(f"=> {case.replace('_', ' ')} inequality {state}\n")
    if args.png is not None:
        write_plot(records, args.png)
        print(f"plot written to {args.png}")
    all_hold = all(verdicts)
    print("Theorem 1: both inequalities hold" if all_hold else "Theorem 1: at least one inequality does not hold")
    return 0 if all_hold else 1

"""How long ``compat`` commands that compute nothing take, against ``python -c "import torch"`` on the same machine,
measured in one run: each command is a fresh interpreter (what a user waits for), the commands and the torch
baseline are interleaved round by round so that a machine loaded by other work slows all of them alike.

    python benchmarks/command_startup.py                       # 5 rounds, configs/demo-er.yaml
    python benchmarks/command_startup.py --rounds 9 --config configs/iam-cl2r-celeba-dinov3-t16.yaml

Prints, per command, the median wall seconds over the rounds, its ratio to the median of ``import torch`` and
whether the command's interpreter imported torch (the goal: plan and every ``--help`` at most 0.5x, no torch).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a command run through app.cli.main in a fresh interpreter; reports on stderr whether torch got imported
PROBE = ("import sys; from app.cli import main\n"
         "try:\n    code = main(sys.argv[1:])\nexcept SystemExit as end:\n    code = end.code\n"
         "sys.stderr.write('\\ntorch-imported=%s\\n' % ('torch' in sys.modules)); sys.exit(code or 0)")
HELP_COMMANDS = ("plan", "run", "status", "logs", "ui", "gate", "report", "compare", "submit", "tune")


def cases(config: str) -> dict[str, list[str]]:
    """name -> argv of the probe (None: the torch baseline)."""
    found = {"import torch": None, "compat --help": ["--help"],
             f"compat plan {config}": ["plan", config],
             f"compat plan {config} --no-cost": ["plan", config, "--no-cost"]}
    found.update({f"compat {name} --help": [name, "--help"] for name in HELP_COMMANDS})
    return found


def run_once(argv: list[str] | None) -> tuple[float, bool]:
    """(wall seconds, torch imported) of one fresh interpreter."""
    command = [sys.executable, "-c", "import torch"] if argv is None else [sys.executable, "-c", PROBE, *argv]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv or ['import torch'])} exited {done.returncode}: {done.stderr[-2000:]}")
    return seconds, argv is None or "torch-imported=True" in done.stderr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median over them)")
    parser.add_argument("--config", default="configs/demo-er.yaml", help="scenario config of the plan cases")
    args = parser.parse_args(argv)
    table = cases(args.config)
    seconds: dict[str, list[float]] = {name: [] for name in table}
    torch_seen: dict[str, bool] = {}
    run_once(None)  # warm the file cache once for everyone
    for round_index in range(args.rounds):
        for name, command in table.items():
            elapsed, imported = run_once(command)
            seconds[name].append(elapsed)
            torch_seen[name] = torch_seen.get(name, False) or imported
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    baseline = statistics.median(seconds["import torch"])
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; median of {args.rounds} rounds; "
          f"ratio = command / `python -c \"import torch\"`")
    print(f"{'case':<58} {'median s':>9} {'ratio':>6}  torch")
    for name, values in seconds.items():
        median = statistics.median(values)
        print(f"{name:<58} {median:>9.3f} {median / baseline:>6.2f}  {'yes' if torch_seen[name] else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

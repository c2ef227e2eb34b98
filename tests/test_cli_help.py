"""`compat --help` and every command's `--help` parse arguments only: they import neither torch nor Ray nor MLflow
(the command's code, app.commands.<name>, is imported only to run it). Checked in a fresh interpreter."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import contextlib, io, json, sys
from app.cli import COMMANDS, main
codes = {}
for argv in [["--help"]] + [[name, "--help"] for name in COMMANDS]:
    with contextlib.redirect_stdout(io.StringIO()) as shown:
        try:
            main(argv)
        except SystemExit as end:
            codes[" ".join(argv)] = [end.code, shown.getvalue().startswith("usage: compat")]
heavy = sorted({name.split(".")[0] for name in sys.modules} & {"torch", "ray", "mlflow", "timm", "boto3"})
commands = sorted(name for name in sys.modules if name.startswith("app.commands."))
print(json.dumps({"codes": codes, "heavy": heavy, "commands": commands}))
"""


def test_every_help_imports_neither_torch_nor_ray_nor_a_commands_code():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    from app.cli import COMMANDS

    assert set(found["codes"]) == {"--help"} | {f"{name} --help" for name in COMMANDS}
    assert all(code == [0, True] for code in found["codes"].values()), found["codes"]
    assert found["heavy"] == []
    assert found["commands"] == []  # no command's code (app.commands.<name>) was imported to show its help

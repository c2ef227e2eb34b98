"""The code version and stage keys computed from a copy of the source tree in another folder: the same as from the
checkout while the sources are the same, unchanged by an edit to a report, changed by an edit to a loss.

Each computation is a fresh interpreter whose PYTHONPATH starts at the copy, so it imports the copied packages (the
test checks where ``compat_core`` was imported from)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PACKAGES = ("compat_core", "pipelines", "cluster", "app")

# prints where compat_core came from, the code version and every stage key of the tiny scenario (compiled, not run)
PROBE = """
import json, sys
sys.path.append({here!r})
import tiny_scenario_helpers as tiny
tiny.register()
import compat_core
from pipelines.config.load import validate_config
from pipelines.graph.code_version import code_version
from pipelines.graph.compile import compile_scenario
graph = compile_scenario(validate_config(tiny.scenario("dsimplex-hoc", output={output!r})))
print(json.dumps({{"compat_core": compat_core.__file__, "code_version": code_version(),
                  "keys": [stage.key for stage in graph]}}))
"""


def copy_sources(target: Path) -> Path:
    """The four packages (sources only) copied under ``target``."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, target / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return target


def identity(source_root: Path, output: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(source_root))
    done = subprocess.run([sys.executable, "-c", PROBE.format(here=str(HERE), output=str(output))], env=env,
                          cwd=str(output.parent), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_copy_elsewhere_has_the_checkouts_identity_and_an_edited_loss_changes_every_key(tmp_path):
    output = tmp_path / "run"
    checkout = identity(ROOT, output)
    assert Path(checkout["compat_core"]).resolve().parent == (ROOT / "compat_core").resolve()
    copy = copy_sources(tmp_path / "elsewhere" / "src")
    same = identity(copy, output)
    assert Path(same["compat_core"]).resolve().parent == (copy / "compat_core").resolve()
    assert same["code_version"] == checkout["code_version"]
    assert same["keys"] == checkout["keys"] and len(same["keys"]) > 10

    report = copy / "pipelines" / "reports" / "run_report.py"
    report.write_text(report.read_text() + "\n# presentation only\n")
    assert identity(copy, output)["code_version"] == checkout["code_version"]

    losses = copy / "compat_core" / "losses.py"
    text = losses.read_text()
    edited = text.replace("return F.cross_entropy(_at_least_fp32(logits), labels.to(logits.device).long())",
                          "return 0.5 * F.cross_entropy(_at_least_fp32(logits), labels.to(logits.device).long())")
    assert edited != text
    losses.write_text(edited)
    changed = identity(copy, output)
    assert changed["code_version"] != checkout["code_version"]
    assert not set(changed["keys"]) & set(checkout["keys"])  # every stage's key holds the code version

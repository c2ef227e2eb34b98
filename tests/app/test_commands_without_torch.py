"""Commands that compute nothing import no torch: importing their code, and running ``compat plan`` on a shipped
config (graph, feature way, cost from the data's labels), leave torch out of the interpreter. Checked in fresh
interpreters; behaviour only (the timings are benchmarks/command_startup.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "torchvision", "timm", "ray", "mlflow")
TORCH_FREE_COMMANDS = ("plan", "status", "logs", "ui", "gate", "report", "submit", "cluster", "theory")

IMPORT_PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules} & set(sys.argv[2:]))))
"""

RUN_PROBE = """
import contextlib, io, json, sys
from app.cli import main
with contextlib.redirect_stdout(io.StringIO()) as shown:
    code = main(sys.argv[1:])
print(json.dumps({"code": code, "torch": "torch" in sys.modules, "out": shown.getvalue()}))
"""


def _python(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("command", TORCH_FREE_COMMANDS)
def test_importing_the_code_of_a_command_that_computes_nothing_imports_no_torch(command):
    assert json.loads(_python("-c", IMPORT_PROBE, f"app.commands.{command}", *HEAVY)) == []


def test_compat_plan_of_a_shipped_config_runs_without_torch():
    found = json.loads(_python("-c", RUN_PROBE, "plan", "configs/demo-dsimplex-hoc.yaml"))
    assert found["code"] == 0 and found["torch"] is False
    lines = found["out"].splitlines()
    # the demo: 3 third-party models, 7 tasks with replacements at tasks 3 and 5 (hand-counted from the config:
    # 5 finetune + 2 replace stages, 2 extracts per model, T(T+1)/2 = 28 entries, one evaluate row per task)
    assert lines[0].startswith("scenario demo-dsimplex-hoc: 7 tasks (10+6x15), method dsimplex-hoc, K=1024")
    assert lines[1] == "stages: 3 pretrain, 5 finetune, 2 replace, 14 extract, 28 entry, 7 evaluate (59 in all)"
    # the card's width of cnn4 at width 16 is 8 * 16 = 128 (m), d = K - 1 = 1023: the bridge stores m values
    assert any(line.startswith("features: bridge (d=1023 > m=128)") for line in lines), lines
    assert any(line.startswith("cost: images per stage") for line in lines)


def test_gate_history_of_a_model_without_decisions_runs_without_torch(tmp_path):
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    found = json.loads(_python("-c", RUN_PROBE, "gate", "history", "my-model", "--tracking-uri", store))
    assert found["code"] == 0 and found["torch"] is False
    assert found["out"].strip() == "alias 'champion' of my-model: 0 recorded decisions (oldest first)"


def test_method_and_backbone_registries_load_without_torch():
    probe = ("import json, sys; from pipelines.methods import METHODS; from compat_core.models.backbones import "
             "BACKBONES, embedding_width; print(json.dumps([METHODS.names(), embedding_width('cnn4', {'width': 8}), "
             "'torch' in sys.modules]))")
    methods, width, imported = json.loads(_python("-c", probe))
    assert "dsimplex-hoc" in methods and "er" in methods
    assert width == 64 and imported is False  # cnn4: m = 8 * width

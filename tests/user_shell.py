"""`compat` run as a user types it, in a subprocess with a user's own environment, and the tiny glyph scenario that
such tests submit, run and serve (tests/cluster/test_local_head.py, tests/cluster/serving/test_serve_processes.py).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PYTHON = sys.executable
ROOT = Path(__file__).resolve().parents[1]


def glyph_scenario(name: str, num_slots: int, feature_dtype: str | None = None) -> str:
    """YAML of a two-task scenario on the offline glyph set, small enough to run as a Ray Job in tens of seconds."""
    dtype = f"\n  feature_dtype: {feature_dtype}" if feature_dtype else ""
    return f"""\
name: {name}
seed: 0
device: cpu
data: {{dataset: glyphs, split: finetune, options: {{style: target}}, per_class: 4}}
tasks: {{spec: "2+2"}}
model: {{backbone: cnn4, backbone_config: {{in_chans: 1, width: 4}}, num_slots: {num_slots}}}
method: {{name: er, params: {{}}}}
training: {{optimizer: {{name: sgd, lr: 0.01}}, epochs: 1, batch_size: 8, autocast: false}}
replay: {{per_class: 2}}
evaluation:
  query_set: {{dataset: glyphs, split: test-query, options: {{style: target}}, per_class: 1}}
  gallery_set: {{dataset: glyphs, split: test-gallery, options: {{style: target}}, per_class: 1}}
  label_level: coarse{dtype}
"""


def user_env(home: Path, **extra: str) -> dict:
    """A user's shell: its own HOME (Ray's standard token file lives there), this checkout on PYTHONPATH, and none
    of the test run's Ray or MLflow variables; ``extra`` adds or overrides variables."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("RAY_AUTH", "RAY_ADDRESS", "MLFLOW_TRACKING_URI"))}
    env.update(HOME=str(home), PYTHONPATH=str(ROOT), **extra)
    return env


def compat(*args: str, env: dict, cwd: Path | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m app.cli ARGS`` (the checkout's code, not an installed ``compat``), output captured."""
    return subprocess.run([PYTHON, "-m", "app.cli", *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)

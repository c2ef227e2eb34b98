"""A Tune trial's pipeline (``cluster.tune.trial.run_trial_pipeline``, the body Tune runs in a trial process) and
``compat run`` of the same scenario from this checkout commit the same stage keys, with the same code version,
precision and bytes; ``training.autocast: auto`` is resolved in both before any stage."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "pipelines" / "tiny_scenario_helpers.py"
sys.path.insert(0, str(TINY.parent))
import tiny_scenario_helpers as tiny  # noqa: E402

from app.cli import main  # noqa: E402
from cluster.tune.spec import SearchSpec  # noqa: E402
from cluster.tune.trial import run_trial_pipeline  # noqa: E402
from pipelines.graph.code_version import code_version  # noqa: E402

SPACE = {"parameters": {"method.params.lam": {"type": "categorical", "values": [0.1, 1.0]}}}


def _manifests(run_dir: Path) -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in (run_dir / "manifests").glob("*.json")}


def test_a_tune_trial_and_a_local_run_commit_the_same_stages(tmp_path):
    tiny.register()
    base = tiny.scenario("dsimplex-hoc", {"lam": 0.1, "rho": 10.0}, output=str(tmp_path / "unused"))
    base["training"]["autocast"] = "auto"  # COMPAT_CALIBRATION=off in tests: resolved to off (fp32) in both
    spec = SearchSpec(name="identity", base_config=base, space=SPACE, objective="AA", samples=1, scheduler="none",
                      storage=str(tmp_path / "searches"), plugins=[f"{TINY}:register"])
    run_trial_pipeline(spec, {"method.params.lam": 0.1}, "t1", report=lambda metrics, tasks: None)
    trial = _manifests(tmp_path / "searches" / "identity" / "runs" / "t1")

    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(base))
    local_dir = tmp_path / "local"
    assert main(["run", str(path), "--output", str(local_dir), "--no-progress", "--tracking-uri", "none"]) == 0
    local = _manifests(local_dir)

    assert len(local) == 19 and sorted(trial) == sorted(local)
    for key, manifest in local.items():
        assert trial[key]["code_version"] == manifest["code_version"] == code_version(), key
        assert trial[key].get("precision") == manifest.get("precision"), key
        assert {name: blob["sha256"] for name, blob in trial[key]["blobs"].items()} == \
            {name: blob["sha256"] for name, blob in manifest["blobs"].items()}, key
    assert {manifest.get("precision") for manifest in local.values()} == {None, "fp32"}
    recorded = yaml.safe_load((tmp_path / "searches" / "identity" / "runs" / "t1" / "config.yaml").read_text())
    assert recorded["training"]["autocast"] == "off"

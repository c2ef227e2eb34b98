"""`compat demo` (shrunk): both scenarios run on ONE embedded Ray instance, the third-party model is trained once
for both (a shared store), and each run is identical (same stage keys, same artifact bytes, same matrix) to the
scenario run on its own with `compat run`, which trains its own copy."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from app.cli import main
from app.commands.demo import DEMOS, configs_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_shrink import SHRINK  # noqa: E402


def _sets() -> list[str]:
    return [argument for value in SHRINK for argument in ("--set", value)]


def _manifests(run_dir: Path) -> dict[str, dict]:
    """stage key -> {blob name: sha256} of every committed stage of a run folder."""
    from pipelines.store.run_store import RunStore

    store = RunStore(run_dir)
    return {key: {name: info["sha256"] for name, info in store.load_manifest(key)["blobs"].items()}
            for key in store.stage_keys()}


@pytest.mark.timeout(900)
def test_demo_runs_both_scenarios_on_one_ray_instance_identical_to_separate_runs(tmp_path, capsys):
    import ray

    output = tmp_path / "demo"
    assert main(["demo", "--output", str(output), "--tracking-uri", "none", "--no-progress", *_sets()]) == 0
    printed = capsys.readouterr().out
    addresses = {line.rsplit("Ray instance ", 1)[1].rstrip(") =") for line in printed.splitlines()
                 if line.startswith("== ") and "Ray instance " in line}
    assert len(addresses) == 1, printed        # both scenarios' stages ran on the same instance
    assert f"one embedded local Ray instance ({addresses.pop()})" in printed
    assert not ray.is_initialized()           # the demo shut its instance down
    assert "calibration: off (COMPAT_CALIBRATION=off), so every auto precision was fp32" in printed

    # the third-party model: one key in both runs, trained by one of them, copied by the other
    lines = {name: next(line for line in printed.splitlines() if line.startswith(f"== {name}: "))
             for name, _ in DEMOS}
    roles = sorted("1 third-party model(s) trained and shared, 0 taken" in line for line in lines.values())
    assert roles == [False, True], lines
    assert any("0 third-party model(s) trained and shared, 1 taken from the shared store" in line
               for line in lines.values()), lines
    pretrain_keys = {name: [key for key in _manifests(output / name) if key.startswith("pretrain-")]
                     for name, _ in DEMOS}
    assert pretrain_keys["er"] == pretrain_keys["dsimplex-hoc"] and len(pretrain_keys["er"]) == 1
    assert list(_manifests(output / "third-party")) == pretrain_keys["er"]
    for name, _ in DEMOS:  # the run directory contract, and both matrices side by side
        assert {"config.yaml", "matrix.json", "metrics.json", "report.md", "matrix.png"} <= {
            path.name for path in (output / name).iterdir()}, name
    assert (output / "matrices.png").is_file()

    for name, file_name in DEMOS:
        alone = tmp_path / "alone" / name
        assert main(["run", str(configs_dir() / file_name), "--output", str(alone), "--tracking-uri", "none",
                     "--no-progress", *_sets(), "--set", "output.shared_store=null"]) == 0
        shared = output / name
        assert json.loads((shared / "matrix.json").read_text()) == json.loads((alone / "matrix.json").read_text())
        # the same stage keys with the same bytes: nothing depends on sharing the instance or the third-party
        # model with the other scenario (each alone run trained its own, bit for bit the shared one)
        assert _manifests(shared) == _manifests(alone) and _manifests(alone)


def test_demo_prints_the_calibration_its_stages_used(tmp_path, monkeypatch):
    """The stages' cached calibration (one torch thread each, from the config), or where none is cached yet."""
    import torch

    from app.commands.demo import _calibration_used, _training_threads
    from compat_core.hardware import calibration

    assert _training_threads(str(configs_dir() / "demo-er.yaml"), []) == 1
    monkeypatch.setenv(calibration.MODE_ENV, "on")
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path))
    threads = torch.get_num_threads()
    text = _calibration_used(1)
    assert torch.get_num_threads() == threads  # restored
    assert text.startswith("stages' no calibration cached at ") and "-t1-" in text and str(tmp_path) in text

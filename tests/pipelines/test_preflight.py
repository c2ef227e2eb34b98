"""Every input is checked before any compute: strict external weights (the issue's reproduction), weights files keyed
by content, numeric ranges at config load, unreadable sources and devices, each failure naming its config key."""
from __future__ import annotations

import json
import time

import pytest
import tiny_scenario_helpers as tiny
import torch
import yaml
from safetensors.torch import save_file

from app.cli import main


def _config(tmp_path, **changes) -> str:
    tiny.register()
    document = tiny.scenario("dsimplex-hoc", output=str(tmp_path / "run"))
    document.update(changes)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(document))
    return str(path)


def _tiny_model_file(path, seed: int = 5) -> str:
    """Weights of exactly the model a tiny-scenario stage builds (cnn4 width 4, 1 channel, K = 10)."""
    from compat_core.models.compat_model import create_model

    torch.manual_seed(seed)
    model = create_model("cnn4", 10, backbone_config={"in_chans": 1, "width": 4})
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return str(path)


def test_unrelated_replacement_weights_are_refused_before_any_stage(tmp_path, capsys):
    """The issue's reproduction: a replacement source holding unrelated keys stops the run before anything trains,
    naming the config key, the counts and the keys."""
    unrelated = tmp_path / "unrelated.safetensors"
    save_file({"totally.unrelated": torch.zeros(3)}, str(unrelated))
    config = _config(tmp_path)
    code = main(["run", config, "--no-progress", "--tracking-uri", "none",
                 "--set", f"replacements=[{{at_task: 3, source: {unrelated}}}]"])
    err = capsys.readouterr().err
    assert code == 2
    assert "replacements[0].source:" in err and "1 unexpected: totally.unrelated" in err
    assert "0 of " in err and " missing: backbone." in err
    assert not (tmp_path / "run" / "manifests").exists() or not list((tmp_path / "run" / "manifests").iterdir())

    third = tmp_path / "third.safetensors"  # a third of the keys
    from safetensors.torch import load_file

    state = load_file(_tiny_model_file(tmp_path / "full.safetensors"))
    save_file({k: v for i, (k, v) in enumerate(sorted(state.items())) if i % 3 == 0}, str(third))
    code = main(["run", config, "--no-progress", "--tracking-uri", "none",
                 "--set", f"replacements=[{{at_task: 3, source: {third}}}]"])
    assert code == 2 and "replacements[0].source:" in capsys.readouterr().err


def test_external_weights_report_is_in_the_stage_record_and_mlflow(tmp_path, capsys):
    from mlflow import MlflowClient

    source = _tiny_model_file(tmp_path / "third-party.safetensors")
    # a training checkpoint's extra head: refused until it is listed, then recorded as ignored
    from safetensors.torch import load_file

    state = load_file(source)
    state["dino_head.weight"] = torch.ones(2)
    save_file(state, source)
    config = _config(tmp_path)
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    replacement = f"replacements=[{{at_task: 3, source: {source}}}]"
    assert main(["run", config, "--no-progress", "--tracking-uri", tracking, "--set", replacement]) == 2
    assert "1 unexpected: dino_head.weight" in capsys.readouterr().err
    replacement = f"replacements=[{{at_task: 3, source: {source}, ignore_keys: ['dino_head.*']}}]"
    assert main(["run", config, "--no-progress", "--tracking-uri", tracking, "--set", replacement]) == 0
    manifests = [json.loads(p.read_text()) for p in (tmp_path / "run" / "manifests").glob("replace-*.json")]
    assert len(manifests) == 1
    report = manifests[0]["record"]["weights"]
    from compat_core.models.compat_model import create_model

    target_keys = len(create_model("cnn4", 10, backbone_config={"in_chans": 1, "width": 4}).state_dict())
    assert report["key"] == "replacements[0].source" and report["loaded"] == report["target_keys"] == target_keys
    assert report["missing_count"] == report["unexpected_count"] == 0 and report["ignored"] == ["dino_head.weight"]
    import hashlib

    assert report["sha256"] == hashlib.sha256(open(source, "rb").read()).hexdigest()
    client = MlflowClient(tracking_uri=tracking)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              "tags.stage_kind = 'replace'")
    assert len(runs) == 1 and runs[0].data.tags["weights_loaded"] == f"{target_keys}/{target_keys}"
    assert runs[0].data.tags["weights_sha256"] == report["sha256"]
    artifacts = [a.path for a in client.list_artifacts(runs[0].info.run_id, "weights")]
    assert artifacts == ["weights/load_report.json"]


def test_file_sources_are_keyed_by_content_not_path(tmp_path):
    from pipelines.config.load import load_config
    from pipelines.graph.compile import compile_scenario

    first = _tiny_model_file(tmp_path / "a.safetensors", seed=1)
    config = _config(tmp_path)

    def keys(source: str) -> dict:
        graph = compile_scenario(load_config(config, [f"replacements=[{{at_task: 3, source: {source}}}]"]),
                                 version="fixed")
        return {stage.label: stage.key for stage in graph if stage.kind in ("finetune", "replace")}

    before = keys(first)
    copy = tmp_path / "elsewhere.safetensors"
    copy.write_bytes(open(first, "rb").read())
    assert keys(str(copy)) == before  # same bytes at another path: same keys
    time.sleep(0.01)
    _tiny_model_file(tmp_path / "a.safetensors", seed=2)  # other bytes at the same path: new keys
    after = keys(first)
    assert after["replace[t=2]"] != before["replace[t=2]"] and after["finetune[t=0]"] == before["finetune[t=0]"]


@pytest.mark.parametrize("assignment, key", [
    ("seed=-1", "seed"), (f"seed={2 ** 63}", "seed"), ("training.optimizer.lr=1e300", "training.optimizer.lr"),
    ("training.optimizer.lr=.nan", "training.optimizer.lr"), ("training.input_workers=10000", "training.input_workers"),
    ("tasks.spec=1000000000x1", "tasks.spec"), ("pretrain.0.seed=-5", "pretrain"),
])
def test_out_of_range_values_are_refused_at_config_load(tmp_path, capsys, assignment, key):
    started = time.monotonic()
    assert main(["run", _config(tmp_path), "--no-progress", "--tracking-uri", "none", "--set", assignment]) == 2
    err = capsys.readouterr().err
    assert key in err and "Traceback" not in err and "MemoryError" not in err
    assert time.monotonic() - started < 30
    assert not (tmp_path / "run").exists()


def test_unreadable_sources_missing_data_and_devices_are_named(tmp_path, capsys):
    config = _config(tmp_path)
    started = time.monotonic()
    assert main(["run", config, "--no-progress", "--tracking-uri", "none", "--set", "initial_model=/dev/zero"]) == 2
    err = capsys.readouterr().err
    assert "initial_model: weights source '/dev/zero'" in err and "not a regular file" in err
    assert time.monotonic() - started < 60
    missing = tmp_path / "nowhere.safetensors"
    assert main(["run", config, "--no-progress", "--tracking-uri", "none",
                 "--set", f"replacements=[{{at_task: 3, source: {missing}}}]"]) == 2
    assert f"replacements[0].source: weights source '{missing}'" in capsys.readouterr().err
    # a training pool whose data root is missing (no evaluation set shares its dataset)
    assert main(["run", config, "--no-progress", "--tracking-uri", "none",
                 "--set", f"pretrain.0.pool={{dataset: cub200, root: {tmp_path / 'no-cub'}, split: train}}"]) == 2
    assert "pretrain[0].pool" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["run", config, "--no-progress", "--tracking-uri", "none", "--set", "device=cuda"]) == 2
        assert "device: 'cuda' but this machine has no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "run" / "manifests").exists()


def test_a_huge_num_slots_is_refused_before_compute_naming_the_key_and_the_estimate(tmp_path, capsys):
    config = _config(tmp_path)
    code = main(["run", config, "--no-progress", "--tracking-uri", "none", "--set", "model.num_slots=100000000"])
    err = capsys.readouterr().err
    assert code == 2
    assert "model.num_slots=100000000 with training.batch_size=8" in err
    # junction 32 x 99999999 fp32 floats alone: 99999999 * 32 * 4 bytes = 11.92 GiB of parameters
    assert "parameters 11.92" in err and "GiB of available host RAM" in err
    assert not (tmp_path / "run" / "manifests").exists() or not list((tmp_path / "run" / "manifests").iterdir())


def test_the_memory_estimate_counts_the_parameters_of_the_model_a_stage_builds(tmp_path):
    from compat_core.models.compat_model import create_model
    from pipelines.config.load import load_config
    from pipelines.config.memory import training_memory
    from pipelines.config.preflight import memory_problems

    config = load_config(_config(tmp_path), [])
    assert memory_problems(config) == []  # the tiny scenario fits
    model = create_model("cnn4", 10, backbone_config={"in_chans": 1, "width": 4})
    parameters = sum(p.numel() for p in model.parameters())
    estimate = training_memory("cnn4", {"in_chans": 1, "width": 4}, 10, "simplex", "junction", 8, (16, 16, 1))
    assert estimate.parts["parameters"] == 4 * parameters
    assert estimate.parts["optimizer state"] == 8 * parameters
    assert estimate.parts["logits and features"] == 3 * 8 * (10 + 9) * 4
    # every module output of a batch of 8, once kept and once as a gradient (counted here on real tensors)
    outputs = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: outputs.append(out.numel())) for m in model.backbone.modules()]
    model.backbone(torch.zeros(8, 1, 16, 16))
    for hook in hooks:
        hook.remove()
    assert estimate.parts["activations"] == 2 * 4 * sum(outputs)


@pytest.mark.parametrize("damage, expected", [
    ("int8", "tensor 'junction.weight' has dtype int8; expected floating-point weights"),
    ("nan", "tensor 'junction.weight' holds 3 non-finite value(s) (NaN or inf)"),
])
def test_quantised_or_non_finite_replacement_weights_are_refused_naming_file_and_key(damage, expected, tmp_path,
                                                                                      capsys):
    """int8 weights passed the shape-only check and failed 15 stages later with a norm error; NaN weights got the
    advice to lower the learning rate. Both are refused before any stage, naming the config key, file and key."""
    from safetensors.torch import load_file

    path = _tiny_model_file(tmp_path / "replacement.safetensors")
    state = load_file(path)
    if damage == "int8":
        state["junction.weight"] = (state["junction.weight"] * 100).to(torch.int8)
    else:
        state["junction.weight"][0, :3] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    save_file(state, path)
    config = _config(tmp_path)
    code = main(["run", config, "--no-progress", "--tracking-uri", "none",
                 "--set", f"replacements=[{{at_task: 3, source: {path}}}]"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"replacements[0].source: weights file {path}: {expected}" in err
    assert "training.optimizer.lr" not in err
    assert not (tmp_path / "run" / "manifests").exists() or not list((tmp_path / "run" / "manifests").iterdir())

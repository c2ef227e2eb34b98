"""The public IAM-CL2R code's protocol selectable in a config: ``model.simplex_norm: row_eps`` builds the public
d-Simplex, and the ``protocol: public-code`` preset writes every setting that follows the public script."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from app.cli import main
from pipelines.config.load import ConfigError, config_hash, config_to_dict, load_config, validate_config
from pipelines.config.local_paths import absolute_config
from pipelines.stages.inputs import ModelShape
from pipelines.stages.model_io import initial_model

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "iam-cl2r-cifar100r-10-t7.yaml"
PUBLIC_STATS = {"mean": [0.5071, 0.4867, 0.4408], "std": [0.2675, 0.2565, 0.2761]}
# the same settings written out key by key, as a user would without the preset
BUNDLE = ["model.backbone=resnet18", "model.simplex_norm=row_eps", "method.params.masking=reference",
          "tasks.order=given", "training.schedule={name: cosine, min_lr: 1.0e-5, interval: epoch}",
          "training.optimizer.weight_decay_exclude=norm_and_bias", "training.drop_last=true",
          "replay.epoch_length=reference", f"data.normalize={PUBLIC_STATS}",
          f"evaluation.query_set.normalize={PUBLIC_STATS}", f"evaluation.gallery_set.normalize={PUBLIC_STATS}",
          "evaluation.gallery=class_means"]


def _public_dsimplex(K: int) -> torch.Tensor:
    """The public code's construction written out in fp64: identity rows, a last row of (1 - sqrt(1 + n)) / n,
    columns centred, each row divided by its L2 norm + 1e-8."""
    n = K - 1
    t = torch.zeros(K, n, dtype=torch.float64)
    t[:n] = torch.eye(n, dtype=torch.float64)
    t[n] = (1.0 - math.sqrt(1.0 + n)) / n
    t -= t.mean(dim=0)
    return t / (t.norm(dim=1, keepdim=True) + 1e-8)


def _prototypes(config) -> torch.Tensor:
    """The prototypes of the model a training stage builds from ``config``: logits of the identity projection."""
    model = initial_model(ModelShape.of(config, "simplex"), "simplex", seed=0)
    K = config.model.num_slots
    return model.logits_from_projection(torch.eye(K - 1, dtype=torch.float64)).T


def test_simplex_norm_row_eps_builds_the_public_d_simplex_from_the_config():
    config = load_config(CONFIG, ["model.simplex_norm=row_eps"])
    public = _public_dsimplex(1024)
    torch.testing.assert_close(_prototypes(config), public, rtol=0, atol=1e-15)
    default = _prototypes(load_config(CONFIG))
    difference = (default - public).abs().max().item()
    assert 1e-10 < difference < 1e-7  # the default's exact unit rows differ from the public form by ~1e-8
    torch.testing.assert_close(default.norm(dim=1), torch.ones(1024, dtype=torch.float64), rtol=0, atol=1e-12)


def test_simplex_norm_enters_keys_only_when_not_the_default():
    plain, explicit = load_config(CONFIG), load_config(CONFIG, ["model.simplex_norm=row"])
    eps = load_config(CONFIG, ["model.simplex_norm=row_eps"])
    assert config_hash(plain) == config_hash(explicit) != config_hash(eps)
    shape = ModelShape.of(plain, "simplex").model_dump(mode="json")
    assert "simplex_norm" not in shape  # the stage inputs of configs without the key are as before
    assert ModelShape.of(eps, "simplex").model_dump(mode="json") == {**shape, "simplex_norm": "row_eps"}
    from pipelines.graph.compile import compile_scenario

    def norms_in_inputs(config) -> list[bool]:
        return ["simplex_norm" in str(stage.inputs.model_dump(mode="json")) for stage in compile_scenario(config)]

    assert not any(norms_in_inputs(plain))  # nested in every training stage's inputs, and left out there too
    with_eps = norms_in_inputs(eps)
    assert any(with_eps) and not all(with_eps)  # training stages carry it; extract / entry stages do not
    with pytest.raises(ConfigError, match=r"model\.simplex_norm"):
        load_config(CONFIG, ["model.simplex_norm=frobenius"])


def test_plan_names_a_simplex_norm_other_than_the_default(capsys):
    assert main(["plan", str(CONFIG), "--no-cost", "--set", "model.simplex_norm=row_eps"]) == 0
    assert "model.simplex_norm row_eps: d-Simplex rows divided by norm + 1e-8" in capsys.readouterr().out
    assert main(["plan", str(CONFIG), "--no-cost"]) == 0
    assert "simplex_norm" not in capsys.readouterr().out.splitlines()[0]


def test_public_code_preset_equals_its_settings_written_out():
    preset = load_config(CONFIG, ["protocol=public-code"])
    by_hand = load_config(CONFIG, BUNDLE)
    assert config_to_dict(preset) == config_to_dict(by_hand)
    assert config_hash(preset) == config_hash(by_hand) != config_hash(load_config(CONFIG))
    assert preset.protocol == "public-code" and by_hand.protocol is None
    schedule = preset.training.schedule
    assert (schedule.name, schedule.min_lr, schedule.interval, schedule.milestones) == ("cosine", 1e-5, "epoch", [])
    assert preset.data.normalize.mean == PUBLIC_STATS["mean"] and preset.evaluation.gallery_set.normalize.std == \
        PUBLIC_STATS["std"]


def test_public_code_preset_in_the_file_then_set_overrides_it(tmp_path):
    document = yaml.safe_load(CONFIG.read_text())
    path = tmp_path / "public.yaml"
    path.write_text(yaml.safe_dump({**document, "protocol": "public-code"}, sort_keys=False))
    from_file = load_config(path, ["training.drop_last=false"])
    assert from_file.protocol == "public-code" and from_file.training.drop_last is False
    assert from_file.training.optimizer.weight_decay_exclude == "norm_and_bias"
    # the saved config (no preset name, its values written out) validates to the same config
    saved = yaml.safe_load(yaml.safe_dump(config_to_dict(from_file)))
    assert "protocol" not in saved
    assert config_hash(validate_config(saved)) == config_hash(from_file)
    assert validate_config({**saved, "protocol": None}).protocol is None
    direct = absolute_config(validate_config({**document, "protocol": "public-code"}))
    assert config_hash(direct) == config_hash(load_config(path))  # a document validated directly gets it too
    # --set protocol=null drops the file's preset
    assert load_config(path, ["protocol=null"]).training.drop_last is False
    assert config_hash(load_config(path, ["protocol=null"])) == config_hash(load_config(CONFIG))


def test_public_code_preset_refuses_unknown_names_and_other_scenarios():
    with pytest.raises(ConfigError, match="unknown protocol 'public'; valid: public-code"):
        load_config(CONFIG, ["protocol=public"])
    with pytest.raises(ConfigError, match=r"method\.name is 'lce-er'"):
        load_config(CONFIG, ["protocol=public-code", "method.name=lce-er", "method.params={}"])
    cub = CONFIG.parent / "cl2r-cub180-20-t7.yaml"
    with pytest.raises(ConfigError, match=r"data\.dataset is 'cub180'"):
        load_config(cub, ["protocol=public-code"])
    er = load_config(CONFIG, ["protocol=public-code", "method.name=er", "method.params={}"])
    assert er.model.backbone == "resnet18" and er.training.drop_last  # no masking key for er


def test_plan_prints_what_the_preset_set(capsys):
    assert main(["plan", str(CONFIG), "--no-cost", "--set", "protocol=public-code", "--set",
                 "training.drop_last=false"]) == 0
    out = capsys.readouterr().out
    assert "protocol: public-code" in out
    for key in ("model.backbone", "model.simplex_norm", "method.params.masking", "tasks.order", "training.schedule",
                "training.optimizer.weight_decay_exclude", "replay.epoch_length", "data.normalize",
                "evaluation.query_set.normalize", "evaluation.gallery_set.normalize", "evaluation.gallery"):
        assert f"    - {key} = " in out, key
    assert "training.drop_last = true (DataLoader(drop_last=True)" in out and "--set changed it to false" in out
    assert "not set by public-code" in out and "fp16 autocast" in out


@pytest.mark.parametrize("path", sorted(CONFIG.parent.glob("iam-cl2r-cifar100r-10-t*.yaml")), ids=lambda p: p.name)
def test_every_iam_cifar_config_plans_with_the_preset_and_its_label_says_how(path, capsys):
    assert main(["plan", str(path), "--no-cost", "--set", "protocol=public-code"]) == 0
    assert "protocol: public-code" in capsys.readouterr().out
    differences = yaml.safe_load(path.read_text())["paper"]["public_code_differences"]
    assert any("--set protocol=public-code" in item for item in differences), path.name
    assert not any("no config key selects" in item or "is refused" in item for item in differences), path.name


@pytest.mark.slow
def test_a_run_under_the_preset_trains_public_d_simplex_models(tmp_path, tmp_path_factory, monkeypatch, capsys):
    """The 7-task IAM config made tiny (tests/pipelines/paper_fixtures.py), under protocol: public-code with a --set
    for a small backbone, runs end to end; its saved config and every trained model carry the preset's values."""
    import json

    import paper_fixtures as papers

    data_dir = tmp_path_factory.mktemp("public-code-data")
    papers.write_all(data_dir)
    monkeypatch.chdir(data_dir)
    torch.set_num_threads(1)
    tiny = papers.shrink(yaml.safe_load(CONFIG.read_text()), str(tmp_path / "run"))
    config_path = tmp_path / "public.yaml"
    config_path.write_text(yaml.safe_dump({**tiny, "protocol": "public-code"}, sort_keys=False))
    assert main(["run", str(config_path), "--no-progress", "--tracking-uri", "none", "--set", "model.backbone=cnn4"]) \
        == 0, capsys.readouterr().err
    run = tmp_path / "run"
    assert len(json.loads((run / "matrix.json").read_text())["values"]) == 3
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["simplex_norm"] == "row_eps" and saved["model"]["backbone"] == "cnn4"
    assert saved["data"]["normalize"] == PUBLIC_STATS and saved["training"]["drop_last"] is True
    model_configs = [json.loads(path.read_text()) for path in run.rglob("config.json")]
    norms = {entry.get("simplex_norm") for entry in model_configs if "num_slots" in entry}
    assert norms == {"row_eps"}, norms

"""Scenario config validation: errors name the key path and the fix; --set overrides; shipped configs validate."""
from pathlib import Path

import pytest
import yaml

from pipelines.config.load import (
    ConfigError,
    apply_override,
    config_to_dict,
    load_config,
    validate_config,
)
from pipelines.config.schema import parse_increments
from pipelines.graph.compile import compile_scenario

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _demo() -> dict:
    return yaml.safe_load((CONFIGS / "demo-dsimplex-hoc.yaml").read_text())


def test_parse_increments_hand_worked():
    assert parse_increments("10+6x15") == [10, 15, 15, 15, 15, 15, 15]
    assert parse_increments("16x512") == [512] * 16
    assert sum(parse_increments("10+30x3")) == 100 and len(parse_increments("10+30x3")) == 31
    with pytest.raises(ValueError, match="tasks.spec"):
        parse_increments("10+x3")


def test_parse_increments_agrees_with_data_package():
    tasks = pytest.importorskip("compat_core.data.tasks")
    for spec in ("10+6x15", "10+30x3", "50+6x25", "60+30x4", "16x512", "10x10", "5x20"):
        assert tasks.parse_increments(spec) == parse_increments(spec)


def test_replacement_outside_sequence_names_key_and_range():
    document = _demo()
    document["replacements"][0]["at_task"] = 9
    with pytest.raises(ConfigError) as error:
        validate_config(document)
    assert "replacements[0].at_task: must be in 2..7 (1-based task number) for a 7-task sequence, got 9" in str(error.value)


def test_unknown_key_is_named():
    document = _demo()
    document["training"]["epoch"] = 3
    with pytest.raises(ConfigError, match=r"training\.epoch: unknown key"):
        validate_config(document)


def test_too_few_slots_gives_needed_k():
    document = _demo()
    document["model"]["num_slots"] = 650
    # 100 fine-tuning classes + 600 third-party slots (largest pool) = 700
    with pytest.raises(ConfigError, match=r"model\.num_slots: K=650 is too small.*K >= 700"):
        validate_config(document)


def test_open_set_guard_on_same_split():
    document = _demo()
    document["evaluation"]["query_set"] = {"dataset": "glyphs", "split": "finetune", "options": {"style": "target"}}
    with pytest.raises(ConfigError, match=r"evaluation\.query_set: draws from the same dataset split as data"):
        validate_config(document)
    document["data"]["classes"] = list(range(100))
    document["evaluation"]["query_set"]["classes"] = [99, 100, 101]
    with pytest.raises(ConfigError, match=r"evaluation\.query_set\.classes: overlap with data\.classes on \[99\]"):
        validate_config(document)


def test_unknown_pretrain_source_and_method_params():
    document = _demo()
    document["replacements"][1]["source"] = "pretrain:p9"
    with pytest.raises(ConfigError, match=r"replacements\[1\]\.source: 'pretrain:p9' names no pretrain entry"):
        validate_config(document)
    document = _demo()
    document["method"]["params"]["lambda_"] = 0.5
    with pytest.raises(ConfigError, match=r"method\.params\.lambda_: unknown key; valid: lam, masking, rho"):
        validate_config(document)
    document = _demo()
    document["method"]["name"] = "hoc"
    with pytest.raises(ConfigError, match=r"method\.name: unknown method 'hoc'; valid: .*dsimplex-hoc"):
        validate_config(document)


def test_overrides_are_yaml_parsed(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text((CONFIGS / "demo-er.yaml").read_text())
    config = load_config(path, ["training.epochs=3", "replacements.1.at_task=6", "training.optimizer.lr=1e-3",
                                "evaluation.gallery=class_means", "data.classes=null"])
    assert config.training.epochs == 3 and isinstance(config.training.epochs, int)
    assert config.replacements[1].at_task == 6
    assert config.training.optimizer.lr == pytest.approx(0.001)
    assert config.evaluation.gallery == "class_means"
    with pytest.raises(ConfigError, match=r"replacements\[0\]\.at_task: must be in 2\.\.7"):
        load_config(path, ["replacements[0].at_task=1"])
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        apply_override({}, "training.epochs")


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_configs_validate_without_data(path):
    config = load_config(path)
    assert config.num_tasks == len(parse_increments(config.tasks.spec))
    for replacement in config.replacements:
        assert 2 <= replacement.at_task <= config.num_tasks


def _with(path: str, value) -> dict:
    document = _demo()
    apply_override(document, f"{path}={value}")
    return document


def test_batch_size_one_fails_at_load_with_its_key():
    with pytest.raises(ConfigError, match=r"training\.batch_size.*greater than or equal to 2"):
        validate_config(_with("training.batch_size", 1))
    with pytest.raises(ConfigError, match=r"pretrain\[0\]\.batch_size.*greater than or equal to 2"):
        validate_config(_with("pretrain.0.batch_size", 1))


def test_unknown_backbone_fails_at_load_with_key_and_valid_names():
    from compat_core.models.backbones import BACKBONES

    with pytest.raises(ConfigError, match=r"model\.backbone: unknown backbone 'resnet19'; valid: .*"
                                          + BACKBONES.names()[0]):
        validate_config(_with("model.backbone", "resnet19"))
    with pytest.raises(ConfigError, match=r"replacements\[0\]\.backbone: unknown backbone 'vit_giant'"):
        validate_config(_with("replacements.0.backbone", "vit_giant"))


def test_unknown_dataset_split_and_option_fail_at_load():
    with pytest.raises(ConfigError, match=r"evaluation\.gallery_set\.dataset: unknown dataset 'cifar1000'; valid: "
                                          r".*cifar100"):
        validate_config(_with("evaluation.gallery_set.dataset", "cifar1000"))
    with pytest.raises(ConfigError, match=r"data\.split: dataset 'glyphs' has no split 'tset'; valid: "):
        validate_config(_with("data.split", "tset"))
    with pytest.raises(ConfigError, match=r"data\.options: 'glyphs' has no option\(s\) \['colour_depth'\]"):
        validate_config(_with("data.options", "{colour_depth: 3}"))


def test_bad_models_uri_fails_at_load_and_good_ones_pass():
    with pytest.raises(ConfigError, match=r"replacements\[1\]\.source: 'models:/my-model:task-3' is not an MLflow "
                                          r"model URI; expected models:/NAME@ALIAS"):
        validate_config(_with("replacements.1.source", "models:/my-model:task-3"))
    for uri in ("models:/my-model@task-3", "models:/my-model/4", "models:/my-model/latest"):
        assert validate_config(_with("replacements.1.source", uri)).replacements[1].source == uri


def test_baseline_head_refuses_replacements_of_another_width():
    """ER retrieves on the backbone output (model.head auto): a replacement with another architecture would give
    features of another width, so the config is refused at load with the key and the fix."""
    document = yaml.safe_load((CONFIGS / "demo-er.yaml").read_text())
    document["replacements"][0]["backbone"] = "resnet18_cifar"
    with pytest.raises(ConfigError, match=r"replacements\[0\]\.backbone: .*model.head: junction"):
        validate_config(document)
    document["model"]["head"] = "junction"
    assert validate_config(document).model.head == "junction"
    hoc = _demo()
    hoc["model"]["head"] = "backbone"
    with pytest.raises(ConfigError, match="model.head: 'backbone' needs a learnable-classifier method"):
        validate_config(hoc)


def test_stages_train_with_the_training_section_and_the_values_other_sections_own():
    """One schema: the loop's TrainConfig is the config's training section, with seed/device/evaluation/replay
    values bound in by the stage; those bound values are refused in the training section and never dumped."""
    from pipelines.config.load import config_to_dict
    from pipelines.training.settings import TrainConfig

    document = _with("training.model_selection", "compatibility")
    document["evaluation"]["batch_size"] = 64
    document["pretrain"][0]["epochs"] = 7
    config = validate_config(document)
    assert isinstance(config.training, TrainConfig)
    task = config.train_config(1003, "cpu")
    assert (task.seed, task.device, task.eval_batch_size, task.epoch_length) == (1003, "cpu", 64, "reference")
    assert task.epochs == config.training.epochs and task.model_selection == "compatibility"
    assert task.optimizer == config.training.optimizer
    pretrain = config.train_config(5, "cpu", config.pretrain[0])
    assert (pretrain.epochs, pretrain.model_selection, pretrain.seed) == (7, "last", 5)
    assert "seed" not in config_to_dict(config)["training"] and "device" not in config_to_dict(config)["training"]
    with pytest.raises(ConfigError, match=r"training\.seed: set by 'seed'.*not in the training section"):
        validate_config(_with("training.seed", 4))
    with pytest.raises(ConfigError, match=r"training\.eval_batch_size: set by 'evaluation\.batch_size'"):
        validate_config(_with("training.eval_batch_size", 4))
    with pytest.raises(ValueError, match=r"device\n  Value error, must be a torch device string"):
        config.train_config(0, "gpu0")


def test_method_params_are_the_methods_pydantic_model_checked_at_load():
    """method.params is validated by the Params model the method registered: unknown names, wrong types and
    out-of-range values fail at load with the key path; the loaded params carry the method's defaults."""
    with pytest.raises(ConfigError, match=r"method\.params\.lam: Input should be less than or equal to 1 "
                                          r"\(got 1\.5\)"):
        validate_config(_with("method.params.lam", 1.5))
    with pytest.raises(ConfigError,
                       match=r"method\.params\.masking: Input should be 'standard', 'reference' or 'paper' "
                             r"\(got 'zero'\)"):
        validate_config(_with("method.params.masking", "zero"))
    with pytest.raises(ConfigError, match=r"method\.params\.rho: Input should be a valid number \(got '5'\)"):
        validate_config(_with("method.params.rho", "'5'"))
    document = _with("method.name", "fan")  # the demo's HOC params belong to another method
    with pytest.raises(ConfigError, match=r"method\.params\.lam: unknown key; valid: adapter_epochs, adapter_hidden, "
                                          r"adapter_lr, lam_distill"):
        validate_config(document)
    document["method"]["params"] = {"adapter_hidden": 8}
    params = validate_config(document).method.params
    assert params.model_dump() == {"lam_distill": 1.0, "adapter_hidden": 8, "adapter_epochs": 30, "adapter_lr": 1e-3}
    assert config_to_dict(validate_config(document))["method"]["params"]["adapter_hidden"] == 8


def test_omitted_method_params_are_the_methods_defaults_and_keep_the_stage_keys():
    """A config without method.params and the same config with the method's defaults written out are one piece of
    work: one validated config, one config hash, the same stage keys (config.yaml writes the defaults out, and
    running it must reproduce the run's keys)."""
    omitted = _demo()
    omitted["method"].pop("params", None)
    written = yaml.safe_load(yaml.safe_dump(omitted))
    written["method"]["params"] = {"lam": 0.1, "rho": 10.0, "masking": "standard"}  # HOCParams' defaults
    configs = validate_config(omitted), validate_config(written)
    assert configs[0].method.params.model_dump() == {"lam": 0.1, "rho": 10.0, "masking": "standard"}
    assert config_to_dict(configs[0]) == config_to_dict(configs[1])
    keys = [[stage.key for stage in compile_scenario(config)] for config in configs]
    assert keys[0] == keys[1]


def test_unknown_key_lists_the_valid_keys_of_its_section():
    with pytest.raises(ConfigError, match=r"training\.optimizer\.learning_rate: unknown key; valid: lr, momentum, "
                                          r"name, weight_decay"):
        validate_config(_with("training.optimizer.learning_rate", 0.1))
    with pytest.raises(ConfigError, match=r"pretrain\[0\]\.pool\.root_dir: unknown key; valid: classes, dataset, "):
        validate_config(_with("pretrain.0.pool.root_dir", "x"))

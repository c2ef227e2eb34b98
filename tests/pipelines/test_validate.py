"""The one validation pass: every cross-field rule runs at load, each problem on its own line with its key path."""
from pathlib import Path

import pytest
import yaml

from pipelines.config.load import ConfigError, validate_config
from pipelines.config.validate import config_problems

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _document(name: str = "demo-dsimplex-hoc.yaml") -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


def _problems(document: dict) -> list[str]:
    with pytest.raises(ConfigError) as error:
        validate_config(document)
    return str(error.value).splitlines()[1:]


def test_every_problem_is_listed_at_once_with_its_key():
    document = _document()
    document["replacements"][0]["at_task"] = 9
    document["model"]["num_slots"] = 650
    document["model"]["backbone"] = "resnet19"
    document["pretrain"][1]["name"] = "p1"
    lines = [line.strip() for line in _problems(document)]
    assert [line.split(":")[0] for line in lines] == ["pretrain", "replacements[0].source", "replacements[0].at_task",
                                                      "model.num_slots", "model.backbone"]
    assert lines[0] == "pretrain: names must be unique, ['p1'] appear more than once"
    assert lines[1].startswith("replacements[0].source: 'pretrain:p2' names no pretrain entry")


def test_anchor_replaced_needs_a_simplex_method():
    document = _document("demo-er.yaml")
    document["replacements"][0]["anchor"] = "replaced"
    (line,) = _problems(document)
    assert line.strip().startswith("replacements[0].anchor: 'replaced' needs a d-Simplex method")


def test_a_learnable_pretrain_cannot_feed_a_simplex_method():
    document = _document()
    document["pretrain"][2]["classifier"] = "learnable"
    (line,) = _problems(document)
    assert line.strip().startswith("pretrain[2].classifier: 'learnable' cannot feed method 'dsimplex-hoc'")


def test_adapters_need_a_retrieval_metric():
    document = _document()
    document["replacements"][0]["adapters"] = ["procrustes"]
    document["evaluation"]["metric"] = "verification"
    (line,) = _problems(document)
    assert line.strip() == ("replacements[0].adapters: adapters are evaluated with recall_at_1 or map retrieval; "
                            "evaluation.metric is 'verification' (remove the adapters or change the metric)")
    document["evaluation"]["metric"] = "map"
    assert validate_config(document).replacements[0].adapters == ["procrustes"]


def test_a_pretrain_entrys_epochs_leave_room_for_the_warmup():
    document = _document()
    document["training"]["warmup_epochs"] = 6  # the pretrain entries train 5 epochs each, fine-tuning 8
    lines = _problems(document)
    assert [line.strip().split(":")[0] for line in lines] == ["pretrain[0].epochs", "pretrain[1].epochs",
                                                              "pretrain[2].epochs"]


def test_the_bridge_is_refused_where_it_is_not_exact():
    document = _document("demo-er.yaml")  # ER retrieves on the backbone output: no junction
    document["evaluation"]["features"] = "bridge"
    (line,) = _problems(document)
    assert "evaluation.features: 'bridge' is not possible here: the model has no junction" in line


def test_methods_that_retrain_from_scratch_take_no_third_party_start():
    document = _document()
    document["method"] = {"name": "cores", "params": {}}
    document.pop("replacements")
    (line,) = _problems(document)
    assert line.strip().startswith("initial_model: method 'cores' retrains every model from the same initial weights")


def test_only_training_stages_run_data_parallel():
    document = _document()
    document["resources"] = {"extract": {"num_workers": 2}}
    (line,) = _problems(document)
    assert line.strip() == ("resources.extract.num_workers must be 1 (only pretrain and finetune train "
                            "data-parallel), got 2")


def test_a_seed_too_large_for_the_task_seeds():
    document = _document()
    document["seed"] = 2 ** 63 - 1
    (line,) = _problems(document)
    assert line.strip().startswith("seed: 9223372036854775807 is too large: task t trains with seed*1000+t")


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_configs_break_no_rule(path):
    from pipelines.config.schema import ScenarioConfig

    assert config_problems(ScenarioConfig.model_validate(yaml.safe_load(path.read_text()))) == []


def test_a_pinned_init_digest_needs_its_file():
    document = _document()
    document["pretrain"][0]["init_sha256"] = "0" * 64
    (line,) = _problems(document)
    assert line.strip() == ("pretrain[0].init_sha256: set but init is not; give the weights file the digest belongs "
                            "to (pretrain[0].init)")

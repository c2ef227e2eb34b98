"""The open-set guard's named override, ``evaluation.closed_set``: PSP/LSP evaluate on the CIFAR100 test set as
their Tab. 1(a) (classes seen in training). Without the override the guard refuses such a run, naming the override;
with it the run is accepted and `compat plan` says so. The data-level guard compares the pools of one class space
(CIFAR100R training data against a CIFAR-100 test pool), not only pools of one registry name."""
from __future__ import annotations

import copy
from pathlib import Path

import paper_fixtures as papers
import pytest
import yaml

from app.cli import main
from app.commands.plan import CLOSED_SET_LINE
from compat_core.data.datasets import dataset_info
from pipelines.config.load import ConfigError, validate_config
from pipelines.stages.pools import check_pools_open_set

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TABLE_1A = ("psp-cifar100-10-t5.yaml", "lsp-cifar100-10-t5.yaml")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cifar-data")
    papers.write_all(root)
    return root


def _document(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


@pytest.mark.parametrize("name", TABLE_1A)
def test_table_1a_configs_evaluate_on_the_cifar100_test_set_through_the_override(name):
    evaluation = validate_config(_document(name)).evaluation
    assert evaluation.closed_set is True
    for pool, take in ((evaluation.query_set, "first"), (evaluation.gallery_set, "second")):
        assert (pool.dataset, pool.split, pool.portion.take, pool.portion.fraction) == ("cifar100", "test", take, 0.5)


def test_cifar100r_and_cifar100_share_one_class_space():
    assert dataset_info("cifar100r").space == dataset_info("cifar100").space == "cifar100"
    assert dataset_info("cifar10").space == "cifar10"


@pytest.mark.parametrize("training", [{"dataset": "cifar100", "root": "data/cifar100", "split": "train"},
                                      {"dataset": "cifar100r", "root": "data/cifar100", "split": "train"}])
def test_data_level_guard_refuses_cifar100_test_without_the_override_and_names_it(training, data_dir, monkeypatch):
    monkeypatch.chdir(data_dir)
    document = _document("psp-cifar100-10-t5.yaml")
    document["data"] = training
    document["evaluation"]["closed_set"] = False
    for key in ("query_set", "gallery_set"):
        document["evaluation"][key]["num_samples"] = None
    with pytest.raises(ValueError, match=r"open-set violation: 100 class\(es\) of class space 'cifar100' appear in "
                                         r"both data \(" + training["dataset"] + r"\) and evaluation\.query_set "
                                         r"\(cifar100\).*evaluation\.closed_set: true"):
        check_pools_open_set(validate_config(document))
    document["evaluation"]["closed_set"] = True
    check_pools_open_set(validate_config(document))  # the override: accepted


def test_data_level_guard_still_passes_cifar100_training_against_cifar10_tests(data_dir, monkeypatch):
    monkeypatch.chdir(data_dir)
    document = _document("cl2r-cifar100-10-t7.yaml")
    for key in ("query_set", "gallery_set"):
        document["evaluation"][key]["num_samples"] = None
    check_pools_open_set(validate_config(document))  # different class spaces: nothing to compare


def test_config_level_guard_names_the_override():
    document = _document("psp-cifar100-10-t5.yaml")
    document["evaluation"]["closed_set"] = False
    document["evaluation"]["query_set"] = copy.deepcopy(document["data"])  # the training split itself
    with pytest.raises(ConfigError, match=r"evaluation\.query_set: draws from the same dataset split as data.*"
                                          r"evaluation\.closed_set: true"):
        validate_config(document)
    document["evaluation"]["closed_set"] = True
    assert validate_config(document).evaluation.closed_set


def test_plan_prints_the_override_for_table_1a_configs_only(capsys):
    for name in TABLE_1A + ("cl2r-cifar100-10-t7.yaml", "iam-cl2r-cifar100r-10-t7.yaml"):
        assert main(["plan", str(CONFIGS / name)]) == 0
        out = capsys.readouterr().out
        assert (CLOSED_SET_LINE in out) == (name in TABLE_1A), name

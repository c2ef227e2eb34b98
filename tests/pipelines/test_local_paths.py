"""Local paths of a config and of --output are made absolute where the command is typed; URIs stay as they are."""
from __future__ import annotations

import os
from pathlib import Path

from pipelines.config.load import load_config
from pipelines.config.local_paths import absolute_location, is_local_path, local_config_paths

CONFIG = """\
name: paths
data: {dataset: glyphs, split: finetune, root: data/glyphs}
tasks: {spec: "2+2"}
model: {backbone: cnn4, num_slots: 8}
method: {name: er}
pretrain:
  - {name: p1, pool: {dataset: glyphs, split: pretrain-1, root: ~/pools}, num_classes: 2, init: weights/p1.safetensors}
initial_model: "pretrain:p1"
replacements: [{at_task: 2, source: models:/other@task-1}]
evaluation:
  query_set: {dataset: glyphs, split: test-query, root: s3://bucket/glyphs}
  gallery_set: {dataset: glyphs, split: test-gallery}
output: {shared_store: shared/third-party}
"""


def test_config_paths_become_absolute_against_the_current_folder(tmp_path, monkeypatch):
    (tmp_path / "c.yaml").write_text(CONFIG)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config("../c.yaml", ["output.dir=out/{name}"])
    assert config.data.root == str(elsewhere / "data" / "glyphs")
    assert config.pretrain[0].pool.root == os.path.expanduser("~/pools")
    assert config.pretrain[0].init == str(elsewhere / "weights" / "p1.safetensors")
    assert config.initial_model == "pretrain:p1"
    assert config.replacements[0].source == "models:/other@task-1"
    assert config.evaluation.query_set.root == "s3://bucket/glyphs"
    assert config.evaluation.gallery_set.root is None
    assert config.output_dir() == str(elsewhere / "out" / "paths")
    assert config.output.shared_store == str(elsewhere / "shared" / "third-party")
    assert set(local_config_paths(config)) == {"data.root", "pretrain[0].pool.root", "pretrain[0].init",
                                               "output.dir", "output.shared_store"}


def test_absolute_location_leaves_uris_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert absolute_location("runs/x") == str(tmp_path / "runs" / "x")
    assert absolute_location(Path("/abs/y")) == "/abs/y"
    for uri in ("s3://b/k", "models:/m/1", "runs:/abc/model", "pretrain:p1", "http://h:1/x"):
        assert absolute_location(uri) == uri and not is_local_path(uri)
    assert absolute_location(None) is None


def test_a_root_override_no_stage_reads_is_refused_naming_the_key(tmp_path, monkeypatch):
    import pytest

    from pipelines.config.load import ConfigError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(CONFIG.replace("root: data/glyphs", "options: {style: target}"))
    with pytest.raises(ConfigError, match=r"--set data\.root=/nonexistent: no stage reads data from it: dataset "
                                          r"'glyphs' generates its images"):
        load_config("c.yaml", ["data.root=/nonexistent"])
    with pytest.raises(ConfigError, match=r"--set evaluation\.gallery_set\.root=/elsewhere"):
        load_config("c.yaml", ["evaluation.gallery_set.root=/elsewhere"])
    assert not os.path.exists("/nonexistent")
    # a dataset read from its root takes the override (whether the folder exists is the data check's job)
    config = load_config("c.yaml", ["data={dataset: cifar100, split: train, root: cifar}"])
    assert config.data.root == str(tmp_path / "cifar")

"""Every shipped paper config runs end to end on tiny data written in the published formats (CIFAR pickles,
ImageNet32 batches, Tiny ImageNet / ImageNet folders, CUB-200-2011 text files, CelebA lists, CASIA-WebFace
folders), through the `compat run` command, and produces matrix.json; `compat plan` names the paper table and the
divergences of each; the IAM-CL2R 7-task config's HOC loss (reference masking) and sampler epoch length match the
reference formulas computed here."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import paper_fixtures as papers
import pytest
import torch
import yaml

from app.cli import main

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PAPER_CONFIGS = sorted(p.name for p in CONFIGS.glob("*.yaml") if not p.name.startswith("demo-"))
INIT_PATH = "data/dinov3/dinov3_vitb16_pretrain_lvd1689m.pth"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("paper-data")
    papers.write_all(root)
    papers.write_init_checkpoint(root / INIT_PATH, papers.TINY_BACKBONE)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_every_paper_config_reaches_a_matrix_on_published_format_data(name, data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(data_dir)  # the configs name relative roots (data/cifar100, ...)
    torch.set_num_threads(1)
    document = yaml.safe_load((CONFIGS / name).read_text())
    tiny = papers.shrink(document, str(tmp_path / "run"))
    config_path = tmp_path / name
    config_path.write_text(yaml.safe_dump(tiny, sort_keys=False))
    assert main(["run", str(config_path), "--no-progress", "--tracking-uri", "none"]) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    # --no-progress (and any non-terminal stream) gives flushed stage lines, never bars drawn into a file
    assert "] finetune[t=0]: started" in err and "] finetune[t=0]: done in " in err and "\r" not in err
    matrix = json.loads((tmp_path / "run" / "matrix.json").read_text())
    values = matrix["values"]
    assert len(values) == 3  # three tasks
    assert matrix["metric"] == document["evaluation"].get("metric", "recall_at_1")
    for row in range(3):
        for column in range(3):
            if column > row:
                assert values[row][column] is None
            else:
                assert 0.0 <= values[row][column] <= 1.0


def test_plan_names_the_table_and_the_divergences_of_every_paper_config(capsys):
    for name in PAPER_CONFIGS:
        assert main(["plan", str(CONFIGS / name)]) == 0
        out = capsys.readouterr().out
        document = yaml.safe_load((CONFIGS / name).read_text())
        paper = document["paper"]
        assert f"paper: reproduces {paper['reproduces']}" in out, name
        for item in (paper["divergences"] + paper.get("public_code", []) + paper.get("choices", [])
                     + paper.get("public_code_differences", [])):
            assert f"- {item}" in out, (name, item)


def test_cl2r_hyper_parameters_follow_the_paper():
    """2026 paper Sec. 6 (Hyper-parameters Values): (0.1, 5) CIFAR100/10, (0.1, 10) TinyImageNet200/20, (0.5, 10)
    CUB180/20 in Sec. 5.2; (0.1, 10) CIFAR100R/10 and CelebA in Sec. 5.3."""
    expected = {"cl2r-cifar100": (0.1, 5.0), "cl2r-tinyimagenet200": (0.1, 10.0), "cl2r-cub180": (0.5, 10.0),
                "iam-cl2r": (0.1, 10.0)}
    for name in PAPER_CONFIGS:
        params = yaml.safe_load((CONFIGS / name).read_text())["method"]["params"]
        for prefix, (lam, rho) in expected.items():
            if name.startswith(prefix):
                assert (params["lam"], params["rho"]) == (lam, rho), name


def test_celeba_replacements_follow_figure_8_and_pretraining_starts_from_dinov3():
    document = yaml.safe_load((CONFIGS / "iam-cl2r-celeba-dinov3-t16.yaml").read_text())
    # 2560 and 5120 CelebA classes = 5 and 10 tasks of 512: the boxed first tasks after replacement in Fig. 8
    assert [r["at_task"] for r in document["replacements"]] == [2560 // 512, 5120 // 512]
    assert all(entry["init"].endswith(".pth") for entry in document["pretrain"])


def test_architecture_upgrade_at_31_tasks_is_table_vii_and_the_7_task_one_is_labelled_reduced():
    """2026 paper Table VII: 10+30x3 tasks, ResNet18 replaced by SENet18 at task 11 and RegNetY_400MF at task 21."""
    document = yaml.safe_load((CONFIGS / "iam-cl2r-cifar100r-10-t31-arch.yaml").read_text())
    assert document["tasks"]["spec"] == "10+30x3" and document["model"]["backbone"] == "resnet18_cifar"
    assert [(r["at_task"], r["backbone"]) for r in document["replacements"]] == [(11, "senet18"),
                                                                                 (21, "regnety_400mf")]
    assert "Table VII" in document["paper"]["reproduces"]
    reduced = yaml.safe_load((CONFIGS / "iam-cl2r-cifar100r-10-t7-arch.yaml").read_text())
    assert reduced["tasks"]["spec"] == "10+6x15"
    assert reduced["paper"]["reproduces"].startswith("no published number: a reduced variant")


def test_demo_runs_the_papers_anchor_and_plan_labels_the_extension(capsys):
    document = yaml.safe_load((CONFIGS / "demo-dsimplex-hoc.yaml").read_text())
    assert [r["anchor"] for r in document["replacements"]] == ["loaded", "loaded"]
    assert main(["plan", str(CONFIGS / "demo-dsimplex-hoc.yaml")]) == 0
    out = capsys.readouterr().out
    assert "paper: none" not in out and "paper: reproduces no published number: the papers' IAM-CL2R" in out
    assert "this project's extension" not in out
    replaced = ('replacements=[{at_task: 3, source: "pretrain:p2", anchor: replaced}, '
                '{at_task: 5, source: "pretrain:p3", anchor: replaced}]')
    assert main(["plan", str(CONFIGS / "demo-dsimplex-hoc.yaml"), "--set", replaced]) == 0
    out = capsys.readouterr().out
    assert out.count("anchor: replaced (this project's extension, not the papers' method") == 2


def test_pretrain_init_is_loaded_and_its_digest_checked(data_dir, tmp_path, monkeypatch, caplog):
    """The pre-training stage starts from the init checkpoint (its backbone weights, not a random draw); without
    init_sha256 it logs the file's digest for the user to pin, and a wrong sha256 stops the stage naming the key."""
    from pipelines.config.load import validate_config
    from pipelines.engine.runner import LocalExecutor
    from pipelines.graph.compile import compile_scenario
    from pipelines.store.run_store import RunStore

    monkeypatch.chdir(data_dir)
    document = papers.shrink(yaml.safe_load((CONFIGS / "iam-cl2r-celeba-dinov3-t16.yaml").read_text()),
                             str(tmp_path / "run"))
    checkpoint = torch.load(data_dir / INIT_PATH, weights_only=True)
    import hashlib

    digest = hashlib.sha256((data_dir / INIT_PATH).read_bytes()).hexdigest()
    document["pretrain"] = document["pretrain"][:1]
    document["pretrain"][0].update({"optimizer": {"name": "sgd", "lr": 1e-9}})
    assert "init_sha256" not in document["pretrain"][0]  # the shipped config leaves the digest for the user to pin
    document["replacements"] = []
    config = validate_config(document)
    graph = compile_scenario(config)
    store = RunStore(str(tmp_path / "run"))
    with caplog.at_level("WARNING", logger="pipelines.stages.training_stages"):
        LocalExecutor(progress=False).run(graph, store)
    assert f"pretrain[casia-3525].init: no init_sha256 set; {INIT_PATH} has sha256 {digest}" in caplog.text
    from compat_core.models.compat_model import load_model

    key = graph.pretrain_stages[config.pretrain[0].name]
    model = load_model(str(tmp_path / "run" / "artifacts" / key))
    name = next(k for k in checkpoint if k.endswith("weight") and checkpoint[k].dim() == 4)  # first conv
    # lr 1e-9 for one epoch: the weights are the checkpoint's up to the tiny step
    assert torch.allclose(model.backbone.state_dict()[name], checkpoint[name], atol=1e-6)

    document["pretrain"][0]["init_sha256"] = "0" * 64
    document["output"]["dir"] = str(tmp_path / "run2")
    with pytest.raises(ValueError, match=r"pretrain\[casia-3525\]\.init: .*sha256"):
        LocalExecutor(progress=False).run(compile_scenario(validate_config(document)), RunStore(str(tmp_path / "run2")))


def test_plan_check_data_prints_the_init_digest_to_pin(data_dir, tmp_path, monkeypatch, capsys):
    import hashlib

    monkeypatch.chdir(data_dir)
    document = papers.shrink(yaml.safe_load((CONFIGS / "iam-cl2r-celeba-dinov3-t16.yaml").read_text()),
                             str(tmp_path / "run"))
    config_path = tmp_path / "celeba.yaml"
    config_path.write_text(yaml.safe_dump(document, sort_keys=False))
    assert main(["plan", str(config_path), "--check-data"]) == 0
    digest = hashlib.sha256((data_dir / INIT_PATH).read_bytes()).hexdigest()
    out = capsys.readouterr().out
    for index in range(len(document["pretrain"])):
        # the path as the run will use it: made absolute where the command is typed
        assert (f"pretrain[{index}].init: no init_sha256 set; {data_dir / INIT_PATH} has sha256 {digest}: pin it "
                f"with pretrain[{index}].init_sha256") in out


# ---- IAM-CL2R 7 tasks: reference masking and the reference epoch length ----------------------------------------
def reference_hoc_info_nce(new: np.ndarray, old: np.ndarray, labels: np.ndarray, rho: float) -> float:
    """The public IAM-CL2R code's contrastive term (HocLoss._loss), written out in fp64 with a loop: anchor i is the
    old feature, s_ij = rho cos(old_i, new_j); loss_i = -s_ii + log sum_j exp(s_ij * [y_j != y_i]), so every
    same-class entry, the positive included, adds exp(0) = 1 to the denominator; the mean over the batch."""
    new = new / np.linalg.norm(new, axis=1, keepdims=True)
    old = old / np.linalg.norm(old, axis=1, keepdims=True)
    total = 0.0
    for i in range(len(labels)):
        terms = [math.exp(rho * float(old[i] @ new[j]) if labels[j] != labels[i] else 0.0) for j in range(len(labels))]
        total += -rho * float(old[i] @ new[i]) + math.log(sum(terms))
    return total / len(labels)


def test_iam_cl2r_t7_hoc_uses_the_reference_masking_formula():
    from compat_core.losses import compatibility_info_nce
    from pipelines.config.load import load_config

    config = load_config(CONFIGS / "iam-cl2r-cifar100r-10-t7.yaml")
    params = config.method.params.model_dump()
    assert params["masking"] == "reference"
    rng = np.random.default_rng(5)
    new, old = rng.normal(size=(12, 7)), rng.normal(size=(12, 7))
    labels = rng.integers(0, 4, size=12)
    got = compatibility_info_nce(torch.tensor(new), torch.tensor(old), torch.tensor(labels), rho=params["rho"],
                                 masking=params["masking"])
    assert float(got) == pytest.approx(reference_hoc_info_nce(new, old, labels, params["rho"]), rel=1e-9)


def test_iam_cl2r_t7_sampler_steps_per_epoch_are_task_plus_memory_over_batch():
    from pipelines.config.load import load_config
    from pipelines.methods import get_method
    from pipelines.training.task_data import TaskData, _steps_per_epoch

    config = load_config(CONFIGS / "iam-cl2r-cifar100r-10-t7.yaml")
    assert config.replay.epoch_length == "reference"
    train = config.train_config(0, "cpu")
    num_task, num_memory = 15 * 300, 25 * 20  # task 3: 15 classes x 300 images; memory: 25 classes x 20
    from compat_core.data.source import ArraySource

    total = num_task + num_memory
    source = ArraySource("counts", np.zeros((total, 1, 1, 1), np.uint8), np.zeros(total, np.int64), ["c"])
    data = TaskData(source=source, indices=np.arange(num_task), slots=np.zeros(num_task, dtype=np.int64), task=2,
                    num_old_classes=25, num_new_classes=15, memory_indices=np.arange(num_memory) + num_task,
                    memory_slots=np.zeros(num_memory, dtype=np.int64))
    method = get_method(config.method.name, **dict(config.method.params))
    assert _steps_per_epoch(data, method, train) == (num_task + num_memory) // config.training.batch_size


def test_plan_check_data_lists_every_missing_root_at_once(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no data here at all
    assert main(["plan", str(CONFIGS / "iam-cl2r-cifar100r-10-t7.yaml"), "--check-data"]) == 1
    out = capsys.readouterr().out
    assert "data: 6 problem(s):" in out
    for key in ("data", "evaluation.query_set", "evaluation.gallery_set"):
        assert f"\n  {key}: " in out, key
    # the three pre-training pools on one missing root: one line naming the three keys, the format described once
    assert "\n  pretrain[0].pool, pretrain[1].pool, pretrain[2].pool: data of 'imagenet32'" in out
    assert out.count("train_data_batch_1 .. train_data_batch_10") == 1 + ("cost: unknown" in out)


def test_plan_check_data_passes_on_the_published_layouts(data_dir, monkeypatch, capsys):
    monkeypatch.chdir(data_dir)
    assert main(["plan", str(CONFIGS / "cl2r-cub180-20-t7.yaml"), "--check-data",
                 "--set", "evaluation.query_set.num_samples=null", "--set", "evaluation.gallery_set.num_samples=null"]) == 0
    assert "data: every pool opened" in capsys.readouterr().out


def test_version_and_missing_data_without_traceback(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith("compat ")
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(CONFIGS / "cl2r-cifar100-10-t2.yaml"), "--output", str(tmp_path / "run"),
                 "--tracking-uri", "none", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "problem(s) before any compute:\n  data: data of 'cifar100'" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "manifests").exists()  # detected before any stage


def test_iam_and_cl2r_configs_label_order_anchor_decay_and_normalisation_with_their_sources():
    """Class order, first-task anchor, weight decay and normalisation are each labelled with where they come from:
    the public code's file:line, a paper sentence, or a choice; the per-pool normalisation is listed as a
    difference from the public code (it is not the public code's behaviour)."""
    for name in PAPER_CONFIGS:
        if not name.startswith(("iam-cl2r-", "cl2r-")):
            continue
        document = yaml.safe_load((CONFIGS / name).read_text())
        paper, order = document["paper"], document["tasks"].get("order", "seeded")
        public, choices = " ".join(paper.get("public_code", [])), " ".join(paper.get("choices", []))
        differences = " ".join(paper.get("public_code_differences", []))
        everything = " ".join([public, choices, differences, " ".join(paper["divergences"])])
        assert "normalises each dataset with its own" not in everything, name
        if name.startswith("iam-cl2r-cifar100r") or name.startswith("cl2r-cifar100"):
            assert order == "given" and "tasks.order: given" in public and "ClassIncremental" in public, name
            assert "normalisation" in differences and "0.2675" in differences, name
        else:
            assert order == "seeded" or "celeba" in name, name
        if name.startswith("cl2r-cub") or name.startswith("cl2r-tinyimagenet"):
            assert "class order seeded" in choices, name
        if name.startswith("iam-cl2r-"):
            assert "anchored" in public and "main.py:79-80" in public and "anchored" not in choices, name
        if name.startswith("cl2r-"):
            assert document["training"]["optimizer"]["weight_decay"] == 0.0002
            assert "weight decay 2e-4" in choices and "TOMM 2023" in choices, name


def test_plan_prints_what_a_baseline_takes_from_its_paper(capsys):
    from pipelines.methods import METHODS

    assert main(["plan", str(CONFIGS / "cl2r-cifar100-10-t7.yaml"), "--set", "method.name=bct-er",
                 "--set", "method.params={}"]) == 0
    out = capsys.readouterr().out
    assert "  method bct-er, from its paper:" in out
    for item in METHODS.get("bct-er").paper:
        assert f"    - {item}" in out

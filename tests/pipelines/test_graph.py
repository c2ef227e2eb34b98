"""Stage graph: shape of the demo scenario, key stability and sensitivity, plan estimates."""
from pathlib import Path

import pytest

from pipelines.config.load import load_config
from pipelines.graph.compile import compile_scenario, describe, estimate

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module")
def demo():
    return load_config(CONFIGS / "demo-dsimplex-hoc.yaml")


def test_demo_graph_shape(demo):
    graph = compile_scenario(demo, version="test")
    # 3 third-party models; 7 tasks of which tasks 3 and 5 (1-based) are replacements; 2 splits x 7 models;
    # 7 * 8 / 2 = 28 matrix entries; 7 rows
    assert graph.count_by_kind() == {"pretrain": 3, "finetune": 5, "replace": 2, "extract": 14, "entry": 28,
                                     "evaluate": 7}
    kinds = [graph[key].kind for key in graph.model_stages]
    assert kinds == ["finetune", "finetune", "replace", "finetune", "replace", "finetune", "finetune"]
    replace_3 = graph[graph.model_stages[2]]
    assert replace_3.parents == (graph.model_stages[1], graph.pretrain_stages["p2"])
    assert graph[graph.model_stages[0]].parents == (graph.pretrain_stages["p1"],)
    row_6 = graph[graph.evaluate_stages[6]]
    assert [graph[key].kind for key in row_6.parents] == ["entry"] * 7  # C[6, 0..6]
    entry_6_2 = graph[row_6.parents[2]]
    # its query features + the galleries of models 0..6 (those of 3..6 carry the FAN adapters of C[6, 2])
    assert entry_6_2.parents == (graph.extract_stages[(6, "query")],) + tuple(
        graph.extract_stages[(k, "gallery")] for k in range(7))
    positions = {stage.key: i for i, stage in enumerate(graph)}
    for stage in graph:  # topological order
        assert all(positions[p] < positions[stage.key] for p in stage.parents)


def test_keys_are_stable_and_sensitive(demo):
    first = compile_scenario(demo, version="v1")
    again = compile_scenario(load_config(CONFIGS / "demo-dsimplex-hoc.yaml"), version="v1")
    assert [s.key for s in first] == [s.key for s in again]

    later = compile_scenario(load_config(CONFIGS / "demo-dsimplex-hoc.yaml", ["replacements.1.at_task=6"]),
                             version="v1")
    same = [a == b for a, b in zip(first.model_stages, later.model_stages)]
    # tasks before the moved replacement keep their keys; task 5 (0-based 4) and everything after change
    assert same == [True, True, True, True, False, False, False]
    assert first.pretrain_stages == later.pretrain_stages

    new_code = compile_scenario(demo, version="v2")
    assert not set(s.key for s in first) & set(s.key for s in new_code)

    # the output location and ECC strictness do not change any artifact
    moved = compile_scenario(load_config(CONFIGS / "demo-dsimplex-hoc.yaml",
                                         ["output.dir=/elsewhere", "evaluation.strict=false"]), version="v1")
    assert [s.key for s in first] == [s.key for s in moved]
    # nor how many processes decode the input (the same batches in the same order: bit-identical training)
    streamed = load_config(CONFIGS / "demo-dsimplex-hoc.yaml",
                           ["training.input_workers=3", "training.prefetch_batches=4"])
    assert [s.key for s in first] == [s.key for s in compile_scenario(streamed, version="v1")]
    from pipelines.config.load import config_hash

    assert config_hash(streamed) == config_hash(demo)
    # the gallery protocol changes only the matrix entries and rows
    protocol = compile_scenario(load_config(CONFIGS / "demo-dsimplex-hoc.yaml", ["evaluation.gallery=instances"]),
                                version="v1")
    changed = {s.kind for a, s in zip(first, protocol) if a.key != s.key}
    assert changed == {"entry", "evaluate"}


def test_plan_estimates_hand_worked():
    config = load_config(CONFIGS / "cl2r-cifar100-10-t7.yaml")
    plan = estimate(compile_scenario(config, version="v"))
    # 7 models x (50,000 + 10,000) images x 99 dims x 2 bytes (fp16)
    assert plan.feature_bytes == 7 * 60_000 * 99 * 2 == 83_160_000
    assert plan.matrix_entries == 28
    assert plan.matrix_flops == pytest.approx(28 * 2 * 50_000 * 10_000 * 99)
    text = describe(compile_scenario(config, version="v"))
    assert "83160000 bytes" in text and "28 entries" in text


def test_plan_command_refuses_invalid_config(tmp_path, capsys):
    from app.cli import main

    path = tmp_path / "bad.yaml"
    path.write_text((CONFIGS / "demo-er.yaml").read_text().replace("at_task: 5", "at_task: 8"))
    assert main(["plan", str(path)]) == 2
    assert "replacements[1].at_task: must be in 2..7" in capsys.readouterr().err
    assert main(["plan", str(CONFIGS / "iam-cl2r-celeba-dinov3-t16.yaml")]) == 0
    assert "136 entries" in capsys.readouterr().out

"""A finished run grown by one task (`compat run --resume RUN --set tasks.spec=...`): only the new stages are computed
(counted by kind from the engine's own invocation record), no earlier stage is recomputed or rewritten, and the grown
matrix and metrics equal byte for byte those of the same longer scenario run from scratch in another folder. A late
replacement computes only the replacement and what follows; a change to an existing task is refused before any
compute, naming the config keys that differ."""
from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path

import pytest
import tiny_scenario_helpers as tiny
import yaml

from app.cli import main

NEW_TASK = {"finetune": 1, "extract": 2, "entry": 3, "evaluate": 1}  # T = 2 -> 3: 1 + 2 + 3 + 1
NEW_REPLACEMENT = {"replace": 1, "extract": 2, "entry": 3, "evaluate": 1}
QUIET = ["--no-progress", "--tracking-uri", "none"]


def short_and_long(tmp_path: Path, replacement: dict | None = None) -> tuple[Path, Path]:
    """Config files of the tiny ER scenario at 2 tasks (2+1x2) and 3 tasks (2+2x2, ``replacement`` at task 3)."""
    tiny.register()
    short = tiny.scenario("er", output=str(tmp_path / "unused"))
    short.pop("replacements")
    short["tasks"]["spec"] = "2+1x2"
    long = json.loads(json.dumps(short))
    long["tasks"]["spec"] = "2+2x2"
    if replacement is not None:
        long["replacements"] = [replacement]
    paths = tmp_path / "short.yaml", tmp_path / "long.yaml"
    for path, document in zip(paths, (short, long)):
        path.write_text(yaml.safe_dump(document))
    return paths


def invocations(run_dir: Path) -> set[Path]:
    return set((run_dir / "executions").glob("*.json"))


def executed_by_kind(run_dir: Path, known: set[Path]) -> tuple[dict[str, int], list[str]]:
    """Stage kinds the one invocation recorded since ``known`` (executions/*.json) computed, and their keys."""
    (newest,) = invocations(run_dir) - known
    executed = json.loads(newest.read_text())["executed"]
    return dict(collections.Counter(key.split("-", 1)[0] for key in executed)), executed


def manifests(run_dir: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in (run_dir / "manifests").glob("*.json")}


def test_a_grown_run_computes_only_the_new_task_and_equals_the_run_from_scratch(tmp_path):
    short, long = short_and_long(tmp_path)
    grown, scratch = tmp_path / "grown", tmp_path / "scratch"
    assert main(["run", str(short), "--output", str(grown), *QUIET]) == 0
    before = manifests(grown)
    picture = (grown / "matrix.png").read_bytes()

    known = invocations(grown)
    assert main(["run", "--resume", str(grown), "--set", "tasks.spec=2+2x2", *QUIET]) == 0
    counts, executed = executed_by_kind(grown, known)
    assert counts == NEW_TASK
    assert not set(before) & {f"{key}.json" for key in executed}  # no earlier stage computed again
    after = manifests(grown)
    assert {name: after[name] for name in before} == before  # ... nor rewritten
    assert len(after) == len(before) + sum(NEW_TASK.values())

    assert main(["run", str(long), "--output", str(scratch), *QUIET]) == 0
    for name in ("matrix.json", "metrics.json", "matrix.csv"):
        assert (grown / name).read_bytes() == (scratch / name).read_bytes(), name
    matrix = json.loads((grown / "matrix.json").read_text())
    assert len(matrix["values"]) == 3 and matrix["values"][2][2] is not None
    assert "| 3 | " in (grown / "report.md").read_text()  # the report's matrix grew by the row of task 3
    assert (grown / "matrix.png").read_bytes() != picture

    # config.yaml is the grown config, with the growth recorded (command, time, previous config digest)
    recorded = yaml.safe_load((grown / "config.yaml").read_text())
    assert recorded["tasks"]["spec"] == "2+2x2"
    assert "# grown 1 time(s) from 2 task(s)" in (grown / "config.yaml").read_text()
    growth = [json.loads(path.read_text()) for path in (grown / "extensions").glob("*.json")]
    assert len(growth) == 1
    assert growth[0]["new_stages_by_kind"] == NEW_TASK and growth[0]["differences"] == ["tasks.spec: 2+1x2 -> 2+2x2"]
    assert growth[0]["previous_tasks"] == 2 and growth[0]["tasks"] == 3 and "--resume" in growth[0]["command"]
    assert growth[0]["founding_config_hash"] == growth[0]["previous_config_hash"] != growth[0]["config_hash"]

    # the grown folder resumed again is a plain resume: nothing computed, no second growth
    known = invocations(grown)
    assert main(["run", "--resume", str(grown), *QUIET]) == 0
    assert all(json.loads(path.read_text())["executed"] == [] for path in invocations(grown) - known)
    assert len(list((grown / "extensions").glob("*.json"))) == 1


@pytest.mark.parametrize("source", ["pretrain", "weights-file"])
def test_a_late_replacement_computes_only_the_replacement_and_what_follows(tmp_path, source):
    """The third-party model p1 arrives for task 3 of a finished 2-task run: as the pipeline's own pre-trained model
    (already committed in the run) or as a weights file (its safetensors copied out of the run)."""
    tiny.register()
    run_dir = tmp_path / "run"
    short, _ = short_and_long(tmp_path)
    assert main(["run", str(short), "--output", str(run_dir), *QUIET]) == 0
    if source == "pretrain":
        replacement = "{at_task: 3, source: 'pretrain:p1'}"
    else:
        (pretrained,) = (run_dir / "artifacts").glob("pretrain-p1-*")
        weights = tmp_path / "arrived" / "p1.safetensors"
        weights.parent.mkdir()
        shutil.copyfile(pretrained / "model.safetensors", weights)
        # the file holds p1's own classifier (4 classes); ER's grows from the task's classes: left out explicitly
        replacement = f"{{at_task: 3, source: '{weights}', ignore_keys: ['classifier.weight']}}"
    before, known = manifests(run_dir), invocations(run_dir)
    assert main(["run", "--resume", str(run_dir), "--set", "tasks.spec=2+2x2",
                 "--set", f"replacements=[{replacement}]", *QUIET]) == 0
    counts, executed = executed_by_kind(run_dir, known)
    assert counts == NEW_REPLACEMENT
    assert all(key.split("-")[1] == "t002" for key in executed if not key.startswith("entry"))
    assert {name: manifests(run_dir)[name] for name in before} == before
    report = (run_dir / "report.md").read_text()
    assert "replacements at tasks (1-based): 3" in report


REFUSALS = [
    (["--set", "tasks.spec=2+2x2", "--set", "training.epochs=2"], ["training.epochs: 1 -> 2", "finetune[t=0]"]),
    (["--set", "tasks.spec=3+1x2"], ["tasks.spec: 2+1x2 -> 3+1x2", "finetune[t=0]"]),
    (["--set", "tasks.spec='2'"], ["tasks.spec: 2+1x2 -> 2", "finetune[t=1]"]),  # a task removed
    (["--set", "tasks.spec=2+2x2", "--set", "replacements=[{at_task: 2, source: 'pretrain:p1'}]"],
     ["replacements.0", "finetune[t=1]"]),  # a replacement at an existing task changes that task
]


@pytest.mark.parametrize("overrides, named", REFUSALS, ids=["setting", "task-size", "removed", "replacement"])
def test_a_change_to_an_existing_task_is_refused_before_any_compute(tmp_path, capsys, overrides, named):
    short, _ = short_and_long(tmp_path)
    run_dir = tmp_path / "run"
    assert main(["run", str(short), "--output", str(run_dir), *QUIET]) == 0
    config, stages, invocations = ((run_dir / "config.yaml").read_bytes(), manifests(run_dir),
                                   len(list((run_dir / "executions").glob("*.json"))))
    capsys.readouterr()
    assert main(["run", "--resume", str(run_dir), *overrides, *QUIET]) == 2
    error = capsys.readouterr().err
    assert "holds another scenario" in error and "give another --output" in error, error
    for text in named:
        assert text in error, (text, error)
    # nothing computed, nothing recorded
    assert (run_dir / "config.yaml").read_bytes() == config and manifests(run_dir) == stages
    assert len(list((run_dir / "executions").glob("*.json"))) == invocations
    assert not (run_dir / "extensions").exists()


def test_a_grown_config_judged_without_compute(tmp_path):
    """judge_growth on the configs alone: the new stages by kind, the differing keys; a plain resume is None."""
    from pipelines.config.load import load_config
    from pipelines.engine.growth import judge_growth

    short, long = short_and_long(tmp_path)
    before, after = load_config(short), load_config(long)
    assert judge_growth(before, before, "v1", "RUN") is None
    growth = judge_growth(before, after, "v1", "RUN")
    assert growth.new_kinds == NEW_TASK and (growth.previous_tasks, growth.tasks) == (2, 3)
    assert growth.new_stages == ("finetune[t=2]", "extract[t=2,query]", "extract[t=2,gallery]", "entry[2,0]",
                                 "entry[2,1]", "entry[2,2]", "evaluate[row=2]")
    with pytest.raises(ValueError, match=r"RUN holds another scenario: 7 of its 19 computed stages"):
        judge_growth(after, before, "v1", "RUN")  # shrinking is not growing
    renamed = after.model_copy(update={"name": "other"})
    with pytest.raises(ValueError, match=r"RUN: name: tiny-er -> other: a run keeps its name"):
        judge_growth(before, renamed, "v1", "RUN")  # its MLflow experiment and registered model follow the name


DEMO_GROWTH = [  # the demo's ER (configs/demo-er.yaml): T -> T + 1 computes 1 model, 2 extractions, T + 1 entries, 1 row
    ("10+1x15", "10+2x15", 0, {"finetune": 1, "extract": 2, "entry": 3, "evaluate": 1}),
    ("10+2x15", "10+3x15", 1, {"finetune": 1, "extract": 2, "entry": 4, "evaluate": 1}),  # after the replacement
    ("10+1x15", "10+2x15", 1, {"replace": 1, "extract": 2, "entry": 3, "evaluate": 1}),  # the replacement arrives
]


@pytest.mark.parametrize("short_spec, long_spec, replacements, kinds", DEMO_GROWTH)
def test_the_demo_er_grown_by_one_task(short_spec, long_spec, replacements, kinds):
    from compat_core.data.tasks import parse_increments
    from pipelines.config.load import validate_config
    from pipelines.engine.growth import judge_growth

    demo = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "demo-er.yaml").read_text())
    short, long = json.loads(json.dumps(demo)), json.loads(json.dumps(demo))
    short["tasks"]["spec"], long["tasks"]["spec"] = short_spec, long_spec
    long["replacements"] = demo["replacements"][:replacements]
    short["replacements"] = [r for r in long["replacements"] if r["at_task"] <= len(parse_increments(short_spec))]
    growth = judge_growth(validate_config(short), validate_config(long), "v1", "RUN")
    assert growth.new_kinds == kinds


def test_compat_submit_refuses_a_change_to_an_existing_task_before_submitting(tmp_path, capsys):
    """The run folder is readable here: the refusal comes before any job is submitted (the address answers
    nothing; it is never contacted)."""
    short, _ = short_and_long(tmp_path)
    run_dir = tmp_path / "run"
    assert main(["run", str(short), "--output", str(run_dir), *QUIET]) == 0
    capsys.readouterr()
    assert main(["submit", str(short), "--address", "http://127.0.0.1:9", "--output", str(run_dir),
                 "--set", "tasks.spec=2+2x2", "--set", "training.epochs=3"]) == 2
    error = capsys.readouterr().err
    assert "holds another scenario" in error and "training.epochs: 1 -> 3" in error, error
    # what submit accepts: the appended task, also from a config whose precision is resolved where the job runs
    from pipelines.config.load import load_config
    from pipelines.engine.growth import judge_folder
    from pipelines.graph.code_version import code_version

    grown = load_config(short, ["tasks.spec=2+2x2", "training.autocast=auto"])
    assert judge_folder(grown, str(run_dir), code_version()).new_kinds == NEW_TASK
    assert judge_folder(grown, str(tmp_path / "elsewhere"), code_version()) is None  # a new run folder

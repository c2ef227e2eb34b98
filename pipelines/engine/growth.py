"""A run folder grown by appended tasks or replacements: judged before any stage runs, recorded, never silent.

Stage keys depend only on the past (a task's stages hash what they consume, never later tasks), so a config that
appends tasks (``tasks.spec`` 10+2x15 -> 10+3x15), a replacement at an appended task or a third-party model for it
keeps every key of the run it grows: the engine then computes only the new stages. :func:`judge_growth` compiles
the run's recorded config and the new one with the same code version and accepts the new one only when every stage
of the recorded run keeps its key; anything else (a changed task, training setting, evaluation protocol, removed
task) is a new run and is refused, naming the config keys that differ and the stages that would change.

Each growth is recorded as one JSON file under ``extensions/`` (object stores cannot append to a log): when, the
command and overrides, the previous and new config hashes, the founding config hash (the config the run was
started with), task counts and the new stages by kind. The founding hash is what a tracker keys the run's identity
on, so a grown run keeps its MLflow pipeline run and its registered versions' lineage.
"""
from __future__ import annotations

import collections
import json
import time
from dataclasses import dataclass

import yaml

from compat_core import io as cio
from pipelines.config.load import config_hash, config_to_dict, validate_config
from pipelines.config.run_origin import RunOrigin
from pipelines.config.schema import ScenarioConfig
from pipelines.graph.compile import compile_scenario
from pipelines.training.settings import autocast_mode

GROWTH_FOLDER = "extensions"
IGNORED_SECTIONS = ("output", "resources", "description", "paper")  # in no config hash (see config_hash)
SHOWN = 6  # stages and config keys named in a refusal


@dataclass(frozen=True)
class Growth:
    """What a grown config adds to a run. new_stages: labels of the stages the recorded run does not have, in the
    graph's order; differences: ``key: old -> new`` of the config keys that changed."""

    previous_config_hash: str
    config_hash: str
    previous_tasks: int
    tasks: int
    new_stages: tuple[str, ...]
    new_kinds: dict[str, int]
    differences: tuple[str, ...]

    def as_json(self, founding: str, origin: RunOrigin | None, code_version: str) -> dict:
        return {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                **(origin or RunOrigin()).as_json(), "code_version": code_version,
                "founding_config_hash": founding, "previous_config_hash": self.previous_config_hash,
                "config_hash": self.config_hash, "previous_tasks": self.previous_tasks, "tasks": self.tasks,
                "new_stages": list(self.new_stages), "new_stages_by_kind": self.new_kinds,
                "differences": list(self.differences)}


def config_differences(before, after, prefix: str = "") -> list[str]:
    """``dotted.key: old -> new`` for every leaf that differs between two plain configs (lists by index; a key
    present on one side only shows ``-`` on the other). The sections that change no result are left out."""
    if isinstance(before, dict) and isinstance(after, dict):
        lines = []
        for key in list(before) + [key for key in after if key not in before]:
            if not prefix and key in IGNORED_SECTIONS:
                continue
            lines += config_differences(before.get(key, "-"), after.get(key, "-"), f"{prefix}{key}.")
        return lines
    if isinstance(before, list) and isinstance(after, list):
        lines = []
        for index in range(max(len(before), len(after))):
            lines += config_differences(before[index] if index < len(before) else "-",
                                        after[index] if index < len(after) else "-", f"{prefix}{index}.")
        return lines
    if before == after:
        return []
    return [f"{prefix.rstrip('.')}: {_short(before)} -> {_short(after)}"]


def _short(value) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def judge_growth(previous: ScenarioConfig, config: ScenarioConfig, code_version: str, where: str) -> Growth | None:
    """None when ``config`` computes what ``previous`` (a run's recorded config) computes (a plain resume), a
    :class:`Growth` when it keeps every stage key of ``previous`` and adds stages; otherwise ValueError naming
    ``where`` (the run folder), the config keys that differ and the stages that would change, before any compute.
    Both are compiled with ``code_version`` (the code that would run)."""
    before_hash, after_hash = config_hash(previous), config_hash(config)
    if before_hash == after_hash:
        return None
    differences = config_differences(config_to_dict(previous), config_to_dict(config))
    renamed = [f"{key}: {old} -> {new}" for key, old, new in (
        ("name", previous.name, config.name),
        ("output.registered_model", previous.output.registered_model, config.output.registered_model)) if old != new]
    if renamed:
        raise ValueError(f"run directory {where}: {'; '.join(renamed)}: a run keeps its name and registered model as "
                         f"it grows (its MLflow experiment, versions and aliases are found by them); give another "
                         f"--output for a run under another name")
    before = compile_scenario(previous, version=code_version)
    after = compile_scenario(config, version=code_version)
    changed = [stage.label for stage in before if stage.key not in after]
    new = [stage for stage in after if stage.key not in before]
    listed = "; ".join(differences[:SHOWN]) + (f"; ... {len(differences) - SHOWN} more" if len(differences) > SHOWN
                                               else "")
    if changed or not new:
        what = (f"{len(changed)} of its {len(before.stages)} computed stages would change "
                f"({', '.join(changed[:SHOWN])}{', ...' if len(changed) > SHOWN else ''})" if changed
                else "it adds no stage")
        raise ValueError(
            f"run directory {where} holds another scenario: {what}; config keys that differ from its config.yaml: "
            f"{listed or '(none that change results)'}. A run grows only by appending tasks (tasks.spec), "
            f"replacements at appended tasks or third-party models for them; any other change is a new run: give "
            f"another --output (or resume with the run's own config)")
    kinds = collections.Counter(str(stage.kind) for stage in new)
    return Growth(before_hash, after_hash, previous.num_tasks, config.num_tasks,
                  tuple(stage.label for stage in new), dict(sorted(kinds.items())), tuple(differences))


def judge_folder(config: ScenarioConfig, root: str, code_version: str) -> Growth | None:
    """:func:`judge_growth` of ``config`` against the config.yaml of the run folder ``root`` (None when it has none
    yet), for a caller that decides before the run starts elsewhere (``compat submit``). An unresolved
    ``training.autocast: auto``, ``training.compile: auto`` or ``training.channels_last: auto`` is judged as the
    recorded run resolved it (the run resolves them where it runs)."""
    path = cio.join(root, "config.yaml")
    if not cio.exists(path):
        return None
    previous = validate_config(yaml.safe_load(cio.read_bytes(path).decode("utf-8")), f"{path}")
    resolved = {}
    if autocast_mode(config.training.autocast) == "auto":
        resolved["autocast"] = previous.training.autocast
    if config.training.compile == "auto":  # resolved like the precision, where the run runs
        resolved["compile"] = previous.training.compile
    if config.training.channels_last == "auto":
        resolved["channels_last"] = previous.training.channels_last
    if resolved:
        config = config.model_copy(update={"training": config.training.model_copy(update=resolved)})
    return judge_growth(previous, config, code_version, root)


def read_growth(store) -> list[dict]:
    """Every growth record of a run folder (``extensions/*.json``), oldest first; [] for a run never grown."""
    folder = store.uri(GROWTH_FOLDER)
    if not cio.is_dir(folder):
        return []
    return [json.loads(store.read_text(f"{GROWTH_FOLDER}/{name}")) for name in sorted(cio.list_dir(folder))]


def founding_config_hash(store) -> str | None:
    """The config hash the run in ``store`` was started with (None for a run never grown: its own config's)."""
    records = read_growth(store)
    return records[0]["founding_config_hash"] if records else None


def record_growth(store, growth: Growth, origin: RunOrigin | None, code_version: str) -> str:
    """Write the growth record (``extensions/<UTC time>-<config hash[:8]>.json``); returns its relative path."""
    records = read_growth(store)
    founding = records[0]["founding_config_hash"] if records else growth.previous_config_hash
    name = f"{GROWTH_FOLDER}/{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{len(records) + 1:03d}-" \
           f"{growth.config_hash[:8]}.json"
    store.write_text(name, json.dumps(growth.as_json(founding, origin, code_version), indent=1))
    return name


def growth_header(store) -> str:
    """The config.yaml comment line recording how the run grew ('' for a run never grown)."""
    records = read_growth(store)
    if not records:
        return ""
    last = records[-1]
    return (f"# grown {len(records)} time(s) from {records[0]['previous_tasks']} task(s), the last at {last['time']} "
            f"from config {last['previous_config_hash'][:16]} ({GROWTH_FOLDER}/ holds each growth)\n")


__all__ = ["GROWTH_FOLDER", "Growth", "config_differences", "founding_config_hash", "growth_header",
           "judge_folder", "judge_growth", "read_growth", "record_growth"]

"""`compat plan CONFIG [--set ...]`: print the stage graph, resources, feature storage and matrix cost.

The plan imports no torch: the config, the graph, the feature way and the cost come from method and backbone cards
and the data's labels. Two options build models and so need torch: ``--check-data`` (every weights file is loaded
into the model its stage builds, :mod:`pipelines.config.preflight`) and ``--calibrated`` (the model's architecture
on the meta device, :mod:`pipelines.graph.calibrated_cost`); their modules are imported by name when asked for.
"""
from __future__ import annotations

import importlib
import sys

from cluster.storage.s3 import configure_object_storage, uses_object_storage
from pipelines.config.load import ConfigError, config_to_dict, load_config
from pipelines.config.protocols import describe_protocol
from pipelines.graph.compile import compile_scenario, describe
from pipelines.graph.plan_cost import cost_lines
from pipelines.graph.source_digests import file_digest
from pipelines.methods import METHODS
from pipelines.store.run_store import RunStore

PREFLIGHT_MODULE = "pipelines.config.preflight"  # --check-data: loads weights into models (torch)
CALIBRATED_COST_MODULE = "pipelines.graph.calibrated_cost"  # --calibrated: the model on the meta device (torch)


def run(args) -> int:
    try:
        config = load_config(args.config, args.overrides)
    except (ConfigError, ValueError, FileNotFoundError) as error:
        print(f"refused: {error}", file=sys.stderr)
        return 2
    graph = compile_scenario(config)
    print(describe(graph))
    if not args.no_cost:
        print(describe_cost(graph, args))
    print(describe_paper(config))
    if config.output.shared_store and graph.pretrain_stages:
        print(describe_shared(config.output.shared_store, graph.pretrain_stages))
    if args.check_data:
        problems = check_data(config)
        if problems:
            print(f"data: {len(problems)} problem(s):")
            for keys, message in group_problems(problems):
                print(f"  {', '.join(keys)}: {message}")
            return 1
        print("data: every pool opened")
    return 0


def group_problems(problems: list[tuple[str, str]]) -> list[tuple[list[str], str]]:
    """Problems with the same text under several keys (three pools on one missing root) as one line naming every
    key, in first-seen order; a message that starts with its own key is shown without the repeat."""
    grouped: dict[str, list[str]] = {}
    for key, message in problems:
        text = message[len(key) + 1:].lstrip() if message.startswith(f"{key}:") else message
        grouped.setdefault(text, []).append(key)
    return [(keys, text) for text, keys in grouped.items()]


def describe_cost(graph, args) -> str:
    """The cost section: images per stage from the samplers, GPU-hours at the stated per-image cost, critical path."""
    if uses_object_storage(graph.config, ""):
        configure_object_storage()
    if args.seconds_per_image is not None:
        if args.seconds_per_image <= 0:
            raise ValueError(f"--seconds-per-image: expected a positive number, got {args.seconds_per_image}")
        return "\n".join(cost_lines(graph, args.seconds_per_image, "given by --seconds-per-image"))
    if args.calibrated is not None:
        calibrated = importlib.import_module(CALIBRATED_COST_MODULE)
        seconds, source = calibrated.calibrated_seconds_per_image(graph.config, args.calibrated)
        return "\n".join(cost_lines(graph, seconds, source))
    return "\n".join(cost_lines(graph, None, ""))


def describe_shared(root: str, pretrain_stages: dict[str, str]) -> str:
    """One line: which third-party models the shared store already holds (copied, not trained, by a run)."""
    try:
        held = set(RunStore(root).stage_keys())
    except OSError as error:  # an unreachable bucket is a plan detail, not a refusal
        return f"third-party models: shared store {root} not readable ({error})"
    there = [name for name, key in pretrain_stages.items() if key in held]
    missing = [name for name in pretrain_stages if name not in there]
    parts = ([f"{', '.join(there)} copied, not trained"] if there else []) + \
        ([f"{', '.join(missing)} trained by the first run that needs them, then published"] if missing else [])
    return (f"third-party models: shared store {root} holds {len(there)} of {len(pretrain_stages)} "
            f"({'; '.join(parts)})")


def check_data(config) -> list[tuple[str, str]]:
    """(config key, problem) for every pool that cannot be opened and every weights source that is missing or does
    not load strictly: all of them, not just the first, so a new machine is fixed in one pass (the run's preflight)."""
    if uses_object_storage(config, ""):
        configure_object_storage()
    for index, entry in enumerate(config.pretrain):
        digest = file_digest(entry.init) if entry.init is not None and entry.init_sha256 is None else None
        if digest is not None:
            print(f"pretrain[{index}].init: no init_sha256 set; {entry.init} has sha256 {digest}: "
                  f"pin it with pretrain[{index}].init_sha256")
    preflight = importlib.import_module(PREFLIGHT_MODULE)
    return preflight.data_problems(config) + preflight.weights_problems(config)


def describe_paper(config) -> str:
    """Which paper table the scenario reproduces, its deliberate divergences and the choices the paper leaves open."""
    paper = config.paper
    extensions = [f"replacements[{index}].anchor: replaced (this project's extension, not the papers' method: the "
                  f"first task after the replacement at task {entry.at_task} is anchored to the model it replaces; "
                  f"the papers anchor it to the loaded model, anchor: loaded)"
                  for index, entry in enumerate(config.replacements) if entry.anchor == "replaced"]
    lines = [f"paper: reproduces {paper.reproduces}" if paper else "paper: none (not a reproduction of a published "
             "table)"]
    divergences = (paper.divergences if paper else []) + extensions
    if paper or divergences:
        lines.append("  divergences:" if divergences else "  divergences: none")
    lines += [f"    - {item}" for item in divergences]
    if paper is not None and paper.public_code:
        lines.append("  where the papers are silent, as their public code:")
        lines += [f"    - {item}" for item in paper.public_code]
    if paper is not None and paper.choices:
        lines.append("  choices where the papers and their public code are silent:")
        lines += [f"    - {item}" for item in paper.choices]
    if paper is not None and paper.public_code_differences:
        lines.append("  differences from the public code (its value and file:line):")
        lines += [f"    - {item}" for item in paper.public_code_differences]
    card = METHODS.get(config.method.name)
    if card.paper:
        lines.append(f"  method {card.name}, from its paper:")
        lines += [f"    - {item}" for item in card.paper]
    if config.evaluation.closed_set:
        lines.append(CLOSED_SET_LINE)
    if config.protocol is not None:
        lines += describe_protocol(config.protocol, config_to_dict(config))
    return "\n".join(lines)


CLOSED_SET_LINE = ("evaluation.closed_set: true (open-set guard overridden: the query and gallery sets may hold "
                   "classes the models were trained on)")

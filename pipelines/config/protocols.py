"""Named protocol presets: ``protocol: NAME`` in a scenario YAML (or ``--set protocol=NAME``) writes a published
code's settings into the config before it is validated.

A preset is a list of config keys, each with the value the named code uses and where that code sets it. Order of
precedence: the config file, then the preset's values, then every ``--set`` (so ``--set`` can still change a key
the preset sets; ``compat plan`` shows which). The validated config holds the resulting values, so its hash, its
stage keys and the ``config.yaml`` a run saves are those of the same settings written out by hand; the preset's name
is kept on the config (not in its dump) for ``compat plan``.

``public-code``: the public IAM-CL2R training script (github.com/miccunifi/iamcl2r, ``src/iamcl2r``) for a
CIFAR-100(R) fine-tuning pool evaluated on CIFAR-10, methods ``dsimplex-hoc`` (its ``hoc``) and ``er``.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

PROTOCOL_KEY = "protocol"

# the public IAM-CL2R code's CIFAR-100 statistics, used for training and for the CIFAR-10 queries and gallery
PUBLIC_CIFAR100_NORMALIZE = {"mean": [0.5071, 0.4867, 0.4408], "std": [0.2675, 0.2565, 0.2761]}


@dataclass(frozen=True)
class Setting:
    """One key a preset sets: dotted config path, value, and where the followed code sets it."""

    key: str
    value: Any
    source: str
    methods: tuple[str, ...] = ()  # only for these methods (empty: every method the preset accepts)


@dataclass(frozen=True)
class Protocol:
    """A preset: the settings it writes, the pools and methods it applies to, and what it cannot set."""

    name: str
    follows: str
    settings: tuple[Setting, ...]
    training_datasets: tuple[str, ...]
    test_datasets: tuple[str, ...]
    methods: tuple[str, ...]
    not_covered: tuple[str, ...]


PUBLIC_CODE = Protocol(
    name="public-code",
    follows="the public IAM-CL2R training script, github.com/miccunifi/iamcl2r src/iamcl2r",
    settings=(
        Setting("model.backbone", "resnet18", "ResNet18 with the ImageNet stem, src/iamcl2r/models/resnet.py"),
        Setting("model.simplex_norm", "row_eps", "d-Simplex rows / (norm + 1e-8), src/iamcl2r/models/__init__.py:114"),
        Setting("method.params.masking", "reference", "same-class InfoNCE entries multiplied by zero, "
                "src/iamcl2r/methods/hoc.py:62", methods=("dsimplex-hoc",)),
        Setting("tasks.order", "given", "classes in the dataset's id order, src/iamcl2r/dataset/__init__.py:57-61"),
        Setting("training.schedule", {"name": "cosine", "min_lr": 1e-5, "interval": "epoch"},
                "CosineAnnealingLR(T_max=epochs, eta_min=1e-5) stepped per epoch, src/iamcl2r/main.py:162,207"),
        Setting("training.optimizer.weight_decay_exclude", "norm_and_bias",
                "no weight decay on BatchNorm weights and biases, src/iamcl2r/main.py:147-156"),
        Setting("training.drop_last", True, "DataLoader(drop_last=True) at the first task, src/iamcl2r/main.py:181-183"),
        Setting("replay.epoch_length", "reference", "BalancedBatchSampler, src/iamcl2r/dataset/dataset_utils.py:35-67"),
        Setting("data.normalize", PUBLIC_CIFAR100_NORMALIZE, "CIFAR-100 statistics, src/iamcl2r/dataset/cifar.py:14-27"),
        Setting("evaluation.query_set.normalize", PUBLIC_CIFAR100_NORMALIZE,
                "CIFAR-100 statistics for CIFAR-10, src/iamcl2r/dataset/cifar.py:48-52"),
        Setting("evaluation.gallery_set.normalize", PUBLIC_CIFAR100_NORMALIZE,
                "CIFAR-100 statistics for CIFAR-10, src/iamcl2r/dataset/cifar.py:48-52"),
        Setting("evaluation.gallery", "class_means", "class-mean templates, src/iamcl2r/performance_metrics.py:27-44"),
    ),
    training_datasets=("cifar100", "cifar100r"),
    test_datasets=("cifar10",),
    methods=("dsimplex-hoc", "er"),
    not_covered=(
        "mixed precision: the public code trains with fp16 autocast and a GradScaler on CUDA "
        "(src/iamcl2r/params.py:30, train.py:41); training.autocast decides here (rounding-level differences)",
        "er: the public code deletes the pre-trained classifier and grows a fresh one "
        "(src/iamcl2r/models/__init__.py:181); here the learnable classifier keeps its pre-training rows",
        "third-party models: the public code downloads its checkpoints (scripts/download_pretrained_models.sh); the "
        "config's pretrain stages or weights files stand for them",
        "replacements by another architecture: the public code cannot run them (src/iamcl2r/eval.py:29-30)",
        "random draws: the public code's numpy global generator, seeded once per run; here per task and epoch",
    ),
)

PROTOCOLS: dict[str, Protocol] = {PUBLIC_CODE.name: PUBLIC_CODE}


def get_protocol(name: Any) -> Protocol:
    """The preset called ``name`` (ValueError naming the key and listing the valid names)."""
    if name not in PROTOCOLS:
        raise ValueError(f"{PROTOCOL_KEY}: unknown protocol {name!r}; valid: {', '.join(sorted(PROTOCOLS))}")
    return PROTOCOLS[name]


def _get(document: dict, key: str) -> Any:
    node: Any = document
    for part in key.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def _set(document: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = document
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = copy.deepcopy(value)


def _applicable(protocol: Protocol, document: dict, source: str) -> None:
    """Refuse a scenario the preset does not describe (other data or method), naming the key and what it needs."""
    problems = []
    checks = [("data.dataset", protocol.training_datasets), ("evaluation.query_set.dataset", protocol.test_datasets),
              ("evaluation.gallery_set.dataset", protocol.test_datasets), ("method.name", protocol.methods)]
    for key, allowed in checks:
        value = _get(document, key)
        if value not in allowed:
            problems.append(f"{key} is {value!r}; {protocol.name} follows {protocol.follows}, which takes "
                            f"{' or '.join(allowed)}")
    if problems:
        raise ValueError(f"invalid scenario config {source}: {PROTOCOL_KEY}: {protocol.name} does not apply:\n  "
                         + "\n  ".join(problems))


def apply_protocol(document: dict, name: Any, source: str = "<config>", scenario: dict | None = None) -> dict:
    """A copy of ``document`` with the preset ``name``'s settings written in (the ``protocol`` key removed);
    ValueError for an unknown name or a scenario it does not apply to. ``scenario``: the document whose pools and
    method decide that (default ``document``; the config with its ``--set`` values when those come after)."""
    protocol = get_protocol(name)
    scenario = document if scenario is None else scenario
    _applicable(protocol, scenario, source)
    result = copy.deepcopy(document)
    result.pop(PROTOCOL_KEY, None)
    method = _get(scenario, "method.name")
    for setting in protocol.settings:
        if not setting.methods or method in setting.methods:
            _set(result, setting.key, setting.value)
    return result


def _holds(expected: Any, actual: Any) -> bool:
    """Whether the config's ``actual`` value (its JSON dump) holds the preset's ``expected`` value."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(_holds(v, actual.get(k)) for k, v in expected.items())
    if isinstance(expected, float) or isinstance(actual, float):
        return isinstance(actual, (int, float)) and not isinstance(actual, bool) and float(actual) == float(expected)
    return expected == actual


def describe_protocol(name: str, dumped: dict) -> list[str]:
    """`compat plan` lines: each key the preset set, with its source; a key a later ``--set`` changed shows both."""
    protocol = get_protocol(name)
    method = _get(dumped, "method.name")
    lines = [f"protocol: {protocol.name} ({protocol.follows}) set:"]
    for setting in protocol.settings:
        if setting.methods and method not in setting.methods:
            continue
        value = json.dumps(setting.value)
        actual = _get(dumped, setting.key)
        note = "" if _holds(setting.value, actual) else f"; --set changed it to {json.dumps(actual)}"
        lines.append(f"    - {setting.key} = {value} ({setting.source}{note})")
    lines.append(f"  not set by {protocol.name} (differences that remain):")
    lines += [f"    - {item}" for item in protocol.not_covered]
    return lines


__all__ = ["PROTOCOLS", "PROTOCOL_KEY", "PUBLIC_CIFAR100_NORMALIZE", "Protocol", "Setting", "apply_protocol",
           "describe_protocol", "get_protocol"]

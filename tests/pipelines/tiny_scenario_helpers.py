"""A tiny synthetic scenario (16x16 grey images, a handful of classes, cnn4 width 4, 1 epoch) for pipeline tests.

Imported by the pipeline tests and by the subprocess of the kill-and-resume test (which registers the dataset
before calling the CLI).
"""
from __future__ import annotations

import numpy as np

from compat_core.data.source import ArraySource

POOLS = {  # split -> global class ids (pretrain classes are 0-based: they are the d-Simplex slots)
    "pretrain": list(range(0, 4)),
    "finetune": list(range(10, 16)),
    "query": list(range(20, 23)),
    "gallery": list(range(20, 23)),
}
PER_CLASS = 10


def make_source(split: str = "finetune", root=None) -> ArraySource:
    rng = np.random.default_rng(7 + len(split))
    classes = POOLS[split]
    images, labels = [], []
    for c in classes:
        pattern = np.random.default_rng(c).integers(0, 256, size=(16, 16, 1))
        for i in range(PER_CLASS):
            noise = rng.normal(0, 25, size=(16, 16, 1))
            images.append(np.clip(pattern + noise, 0, 255).astype(np.uint8))
            labels.append(c)
    names = [f"c{i}" for i in range(max(max(p) for p in POOLS.values()) + 1)]
    return ArraySource(f"tiny/{split}", np.stack(images), np.asarray(labels), names, hflip=False)


def register() -> None:
    from compat_core.data.datasets import DATASETS, dataset_names

    dataset_names()  # import the built-in readers first
    if "tiny-synth" not in DATASETS:
        DATASETS.register("tiny-synth", make_source)


def scenario(method: str = "dsimplex-hoc", params: dict | None = None, output: str = "runs/tiny") -> dict:
    """3 tasks (2+2x2), one third-party model, a replacement at task 3 (1-based); K = 4 + 6 = 10 slots."""
    return {
        "name": f"tiny-{method}",
        "seed": 0,
        "device": "cpu",
        "data": {"dataset": "tiny-synth", "split": "finetune"},
        "tasks": {"spec": "2+2x2"},
        "model": {"backbone": "cnn4", "backbone_config": {"in_chans": 1, "width": 4}, "num_slots": 10},
        "method": {"name": method, "params": params or {}},
        # precision and layout pinned: a graph compiled from this document has the keys of the run made from it
        "training": {"optimizer": {"name": "sgd", "lr": 0.01}, "epochs": 1, "batch_size": 8, "autocast": False,
                     "channels_last": "off"},
        "replay": {"per_class": 3},
        "pretrain": [{"name": "p1", "pool": {"dataset": "tiny-synth", "split": "pretrain"}, "num_classes": 4}],
        "replacements": [{"at_task": 3, "source": "pretrain:p1"}],
        "evaluation": {"query_set": {"dataset": "tiny-synth", "split": "query"},
                       "gallery_set": {"dataset": "tiny-synth", "split": "gallery"},
                       "batch_size": 16},
        "output": {"dir": output},
    }


RETRAINING = {"cores", "psp", "lsp"}  # retrain from the same initial weights: no replacement, no third-party model


def method_scenario(method: str, output, **changes) -> dict:
    """The tiny scenario as ``method`` can run it: no replacement or third-party model for the methods that
    retrain from one initial state, 4 classes first for PSP/LSP (a 2-class PSP feature is always +-(1, -1)/sqrt(2):
    all ties); ``changes`` replace top-level sections."""
    document = scenario(method, output=str(output))
    if method in RETRAINING:
        document.pop("replacements")
        document.pop("pretrain")
    if method in ("psp", "lsp"):
        document["tasks"] = {"spec": "4+2x1"}
    document.update(changes)
    return document


# A `compat` entry point for subprocess tests: the tiny dataset registered, one torch thread. Write it to a file with
# CLI_SCRIPT.format(here=<folder of this module>) and run it with the project on PYTHONPATH.
CLI_SCRIPT = """
import sys, torch
sys.path.insert(0, {here!r})
torch.set_num_threads(1)
import tiny_scenario_helpers as tiny
tiny.register()
from app.cli import main
sys.exit(main(sys.argv[1:]))
"""

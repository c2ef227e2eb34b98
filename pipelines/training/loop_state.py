"""The whole state of a training loop as a dict of tensors and plain data (read back with
``torch.load(weights_only=True)``): what an epoch checkpoint holds, and how a loop is restored from it."""
from __future__ import annotations

import random
from dataclasses import asdict
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from pipelines.training.records import TrainRecord


def _rng_states(augment_generator: torch.Generator | None) -> dict[str, Any]:
    numpy_state = np.random.get_state()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"name": numpy_state[0], "keys": torch.from_numpy(numpy_state[1].astype(np.int64)),
                  "pos": int(numpy_state[2]), "has_gauss": int(numpy_state[3]), "cached": float(numpy_state[4])},
        "python": random.getstate(),
        "augment": augment_generator.get_state() if augment_generator is not None else None,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: Mapping[str, Any], augment_generator: torch.Generator | None) -> None:
    torch.set_rng_state(states["torch"])
    numpy_state = states["numpy"]
    np.random.set_state((numpy_state["name"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                         numpy_state["has_gauss"], numpy_state["cached"]))
    python = states["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    if augment_generator is not None and states.get("augment") is not None:
        augment_generator.set_state(states["augment"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, *, epochs_done: int,
                   step_in_epoch: int = 0, step: int = 0, extra_modules: Sequence[nn.Module] = (),
                   augment_generator: torch.Generator | None = None, selector: Any = None,
                   records: Sequence[TrainRecord] = (), extras: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The whole state of a training loop as a dict of tensors and plain data (``torch.load(weights_only=True)``
    reads it back): model, optimiser, scheduler, the method's extra modules, RNG states (torch, numpy, python, the
    augmentation generator, CUDA), sampler position (``epochs_done`` completed epochs + ``step_in_epoch`` steps of
    the next; batch order is seeded per epoch, so the position is the sampler's whole state), optimiser steps so
    far, model-selection state, the records emitted so far and loop ``extras`` (plain data or tensors)."""
    selection = None
    if selector is not None:
        selection = {"best_state": selector.best_state, "best_epoch": selector.best_epoch,
                     "best_self": float(selector.best_self), "history": list(selector.history)}
    return {
        "format": 1,
        "epochs_done": int(epochs_done),
        "step_in_epoch": int(step_in_epoch),
        "step": int(step),
        "model": model.state_dict(),
        "extra_modules": [module.state_dict() for module in extra_modules],
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": _rng_states(augment_generator),
        "selection": selection,
        "records": [asdict(record) for record in records],
        "extras": dict(extras or {}),
    }


def restore_training_state(state: Mapping[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer,
                           scheduler: Any, *, extra_modules: Sequence[nn.Module] = (),
                           augment_generator: torch.Generator | None = None, selector: Any = None) -> dict[str, Any]:
    """Load a :func:`training_state` dict into the given objects (built as for a fresh start, ``method.setup``
    done) and set the RNG states. Returns the position: ``epochs_done``, ``step_in_epoch``, ``step``, ``records``
    (TrainRecord list) and ``extras``."""
    if state.get("format") != 1:
        raise ValueError(f"epoch checkpoint format {state.get('format')!r}: expected 1")
    if len(state["extra_modules"]) != len(extra_modules):
        raise ValueError(f"epoch checkpoint holds {len(state['extra_modules'])} extra module(s) of the method, "
                         f"the method set up {len(extra_modules)}")
    model.load_state_dict(state["model"])
    for module, module_state in zip(extra_modules, state["extra_modules"]):
        module.load_state_dict(module_state)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if selector is not None and state.get("selection") is not None:
        selection = state["selection"]
        selector.best_state, selector.best_epoch = selection["best_state"], selection["best_epoch"]
        selector.best_self, selector.history = selection["best_self"], list(selection["history"])
    _set_rng_states(state["rng"], augment_generator)
    return {"epochs_done": int(state["epochs_done"]), "step_in_epoch": int(state["step_in_epoch"]),
            "step": int(state["step"]), "records": [TrainRecord(**record) for record in state["records"]],
            "extras": dict(state["extras"])}

"""The run's precision, resolved once on the driver before any stage is compiled or run.

``training.autocast: auto`` means "half-precision autocast where a measured training step of the run's model is
faster than fp32 on this machine" (``compat_core.hardware.calibration``, cached per machine). A run resolves it here,
once, to bf16, fp16 or off (fp32): measured on the scenario's model (``model`` section, the method's classifier) on
a batch of its fine-tuning pool, on the run's device. The resolved value replaces "auto" in the config, so it is in
every training and extract stage's key, in their manifests, in config.yaml and the MLflow params; stages never
measure. A config that pins bf16 / fp16 / off is returned with its setting spelled as such (true -> auto,
false -> off) and nothing is measured.

``training.compile: auto`` is resolved the same way, after the precision and under it, to "on" or "off": a timed
eager and compiled training step of the same model on the same batch, the compile time counted
(``compat_core.hardware.compile_probe``, cached per machine, batch shape and torch version), compiled only where it
pays over a fine-tuning stage's steps (``training.epochs`` times ``training.steps_per_epoch``, or one pass over an
average task: the pool over the number of split tasks). The resolved value is in the training stages' keys,
their manifests (``"compile"``), config.yaml, the MLflow params and report.md, like the precision.

``training.channels_last: auto`` is resolved the same way, under the resolved precision, to "on" or "off": a timed
training step of the run's model with contiguous and with channels_last weights and batches
(``compat_core.hardware.layout_probe``, cached per machine, batch shape and torch version); off without measuring for
a scenario naming a backbone without convolutions (model, pre-training or replacement). ``on`` for such a
backbone is refused when the config loads. Recorded like the
compile mode (manifests: ``"channels_last"``).
"""
from __future__ import annotations

import math

import torch

from compat_core.hardware.calibration import calibration_enabled
from compat_core.models.backbones import BACKBONES
from compat_core.models.compat_model import create_model
from pipelines.config.schema import ScenarioConfig, resolved_head
from pipelines.config.validate import training_backbones
from pipelines.graph.build_inputs import method_classifier
from pipelines.stages.context import resolve_device
from pipelines.stages.pools import load_pool
from pipelines.training.autocast import example_batch, resolve_autocast, resolve_channels_last, resolve_compile
from pipelines.training.settings import autocast_mode


def precision_probe(config: ScenarioConfig, device: torch.device) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model and the batch ``auto`` is measured on: the scenario's model on ``device`` and the first
    ``training.batch_size`` images of its fine-tuning pool, transformed as for evaluation."""
    classifier = method_classifier(config)
    model = create_model(config.model.backbone, config.model.num_slots, classifier=classifier,
                         backbone_config=config.model.backbone_config, head=resolved_head(config, classifier))
    pool = load_pool(config.data, "data")
    batch_size = config.training.batch_size
    example = example_batch(pool, list(range(min(len(pool), batch_size))), batch_size, device)
    return model.to(device), example


def measuring_device(config: ScenarioConfig, key: str, pins: str) -> torch.device:
    """The run's device, where ``key``'s ``auto`` is measured; a ValueError naming ``key`` and its pinned values
    ``pins`` when it is a CUDA device this driver does not have."""
    device = resolve_device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{key}: auto is measured on the run's device {config.device!r}, which this driver does not "
                         f"have; pin {key} ({pins})")
    return device


def resolve_run_precision(config: ScenarioConfig) -> ScenarioConfig:
    """``config`` with ``training.autocast`` resolved: bf16 | fp16 | off (see the module doc). With calibration off
    (``COMPAT_CALIBRATION=off``) ``auto`` is off (fp32) without measuring."""
    mode = autocast_mode(config.training.autocast)
    if mode == "auto":
        if not calibration_enabled():
            mode = "off"
        else:
            device = measuring_device(config, "training.autocast", "bf16, fp16 or off")
            model, example = precision_probe(config, device)
            mode = resolve_autocast("auto", device, model, example, train=True)
    compiled = resolve_run_compile(config, mode)
    channels_last = resolve_run_channels_last(config, mode)
    if (mode, compiled, channels_last) == (config.training.autocast, config.training.compile,
                                           config.training.channels_last):
        return config
    training = config.training.model_copy(update={"autocast": mode, "compile": compiled,
                                                  "channels_last": channels_last})
    return config.model_copy(update={"training": training})


def stage_steps(config: ScenarioConfig, pool_size: int) -> int:
    """Optimiser steps of one fine-tuning stage as ``compile: auto`` weighs them: epochs times the configured cap,
    else one pass over the pool split evenly over the tasks."""
    training = config.training
    tasks = max(1, config.num_split_tasks)
    per_epoch = training.steps_per_epoch or max(1, math.ceil(pool_size / tasks / training.batch_size))
    return training.epochs * per_epoch


def resolve_run_compile(config: ScenarioConfig, autocast: str) -> str:
    """``training.compile`` resolved under the resolved ``autocast``: on | off (see the module doc); ``auto`` is off
    without measuring when calibration is off."""
    mode = config.training.compile
    if mode != "auto":
        return mode
    if not calibration_enabled():
        return "off"
    device = measuring_device(config, "training.compile", "on or off")
    model, example = precision_probe(config, device)
    steps = stage_steps(config, len(load_pool(config.data, "data")))
    return resolve_compile("auto", device, model, example, steps, config.training.batch_size, autocast)


def resolve_run_channels_last(config: ScenarioConfig, autocast: str) -> str:
    """``training.channels_last`` resolved under the resolved ``autocast``: on | off (see the module doc); ``auto``
    is off without measuring when calibration is off or a backbone the scenario names has no convolutions."""
    mode = config.training.channels_last
    if mode != "auto":
        return mode
    if not calibration_enabled() or not all(BACKBONES.get(name).convolutional
                                            for name in training_backbones(config).values()):
        return "off"
    device = measuring_device(config, "training.channels_last", "on or off")
    model, example = precision_probe(config, device)
    return resolve_channels_last("auto", device, model, example, autocast)


__all__ = ["precision_probe", "resolve_run_channels_last", "resolve_run_compile", "resolve_run_precision",
           "stage_steps"]

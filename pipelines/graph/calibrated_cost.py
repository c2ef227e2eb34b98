"""The per-image training cost of a scenario's model from this machine's calibration cache (``compat plan
--calibrated DEVICE``, after ``compat calibrate CONFIG --device DEVICE``). It builds the model's architecture on the
meta device to find its cached training step, so it imports torch; the rest of the plan
(:mod:`pipelines.graph.plan_cost`) does not."""
from __future__ import annotations

import torch

from compat_core.hardware import calibration
from compat_core.models.compat_model import create_model
from pipelines.config.schema import resolved_head
from pipelines.methods import METHODS


def calibrated_seconds_per_image(config, device: str) -> tuple[float, str]:
    """Seconds per training image of the config's model from this machine's calibration cache (``compat calibrate
    CONFIG --device DEVICE``): the cached training step of its architecture, in the precision ``auto`` chose,
    divided by the step's batch. Raises ValueError saying which command measures it when nothing is cached."""
    classifier = METHODS.get(config.method.name).classifier
    with torch.device("meta"):  # the architecture's signature only: no weights are allocated
        model = create_model(config.model.backbone, config.model.num_slots, classifier=classifier,
                             backbone_config=config.model.backbone_config, head=resolved_head(config, classifier))
    prefix = calibration.workload_signature(model, torch.zeros(1, 1), train=True).rsplit("-in", 1)[0] + "-in"
    document = calibration.load(device) or {}
    found = sorted((name, entry) for name, entry in (document.get("workloads") or {}).items()
                   if name.startswith(prefix))
    if not found:
        raise ValueError(f"--calibrated {device}: no training step of {config.model.backbone} is cached for this "
                         f"machine; run `compat calibrate {config.name}.yaml --device {device}` (the config file) first")
    name, entry = found[-1]
    batch = int(name.rsplit("-in", 1)[1].split("x")[0])
    seconds = float(entry["seconds_per_step"][entry["choice"]]) / batch
    return seconds, f"measured here: {name}, {entry['choice']}, batch {batch}, {calibration.cache_path(device)}"


__all__ = ["calibrated_seconds_per_image"]

"""The run's precision, resolved once on the driver before any stage is compiled or run.

``training.autocast: auto`` means "half-precision autocast where a measured training step of the run's model is
faster than fp32 on this machine" (``compat_core.hardware.calibration``, cached per machine). A run resolves it here,
once, to bf16, fp16 or off (fp32): measured on the scenario's model (``model`` section, the method's classifier) on
a batch of its fine-tuning pool, on the run's device. The resolved value replaces "auto" in the config, so it is in
every training and extract stage's key, in their manifests, in config.yaml and the MLflow params; stages never
measure. A config that pins bf16 / fp16 / off is returned with its setting spelled as such (true -> auto,
false -> off) and nothing is measured.
"""
from __future__ import annotations

import torch

from compat_core.hardware.calibration import calibration_enabled
from compat_core.models.compat_model import create_model
from pipelines.config.schema import ScenarioConfig, resolved_head
from pipelines.graph.build_inputs import method_classifier
from pipelines.stages.context import resolve_device
from pipelines.stages.pools import load_pool
from pipelines.training.autocast import example_batch, resolve_autocast
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


def resolve_run_precision(config: ScenarioConfig) -> ScenarioConfig:
    """``config`` with ``training.autocast`` resolved: bf16 | fp16 | off (see the module doc). With calibration off
    (``COMPAT_CALIBRATION=off``) ``auto`` is off (fp32) without measuring."""
    mode = autocast_mode(config.training.autocast)
    if mode == "auto":
        if not calibration_enabled():
            mode = "off"
        else:
            device = resolve_device(config.device)
            if device.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"training.autocast: auto is measured on the run's device {config.device!r}, which "
                                 f"this driver does not have; pin training.autocast (bf16, fp16 or off)")
            model, example = precision_probe(config, device)
            mode = resolve_autocast("auto", device, model, example, train=True)
    if mode == config.training.autocast:
        return config
    return config.model_copy(update={"training": config.training.model_copy(update={"autocast": mode})})


__all__ = ["precision_probe", "resolve_run_precision"]

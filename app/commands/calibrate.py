"""``compat calibrate``: measure (or show) this machine's fast arithmetic paths (``compat_core.hardware.calibration``).

``compat calibrate`` times the candidate matrix products (fp32 / bf16 / fp16 / int8 at a retrieval chunk shape)
once per machine key and prints the table; with CONFIG it also times a training step and an inference step of the
config's model on a batch of its fine-tuning data, fp32 against half autocast (what ``training.autocast: auto``
will use). ``--show`` prints what is cached and measures nothing; ``--force`` measures again.
"""
from __future__ import annotations

import argparse

from compat_core.hardware import calibration
from compat_core.models.compat_model import create_model
from pipelines.config.load import load_config
from pipelines.config.schema import resolved_head
from pipelines.methods import get_method
from pipelines.stages.pools import load_pool
from pipelines.training.autocast import example_batch, resolve_autocast


def run(args: argparse.Namespace) -> int:
    import torch

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads: expected a positive integer, got {args.threads}")
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: {args.device!r} asked for, but torch sees no CUDA device")
    path = calibration.cache_path(device)
    if args.show:
        print(calibration.format_calibration(calibration.load(device), path))
        return 0
    if not calibration.calibration_enabled():
        raise ValueError(f"{calibration.MODE_ENV}=off: calibration is switched off in this environment")
    if args.force:
        path.unlink(missing_ok=True)
    calibration.gemm_rates(device)
    if args.config is not None:
        _calibrate_config(args.config, device)
    print(calibration.format_calibration(calibration.load(device), path))
    return 0


def _calibrate_config(path: str, device) -> None:
    """Time the config's model on a training batch and an evaluation batch of its fine-tuning pool."""
    config = load_config(path)
    pool = load_pool(config.data, "data")
    classifier = get_method(config.method.name, **config.method.params).classifier
    model = create_model(config.model.backbone, config.model.num_slots, classifier=classifier,
                         backbone_config=config.model.backbone_config, head=resolved_head(config, classifier))
    indices = list(range(min(len(pool), config.training.batch_size)))
    for train, batch_size in ((True, config.training.batch_size), (False, config.evaluation.batch_size)):
        example = example_batch(pool, indices, batch_size, device)
        resolve_autocast("auto", device, model.to(device), example, train=train)

"""Tiny copies of every data set the shipped paper configs read, in the published on-disk layouts, under the
relative roots the configs name (``data/cifar100``, ``data/CUB_200_2011``, ...), plus the shrinking that turns a
paper config into a seconds-long run of the same scenario shape (same datasets, readers, method, protocol).

Written with the format writers of tests/compat_core/data/fixtures_published.py (independent of the readers).
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compat_core" / "data"))
import fixtures_published as fx  # noqa: E402

from compat_core.data.formats.tinyimagenet import TINYIMAGENET20_WNIDS  # noqa: E402

PER_CLASS = 4  # images per class and split: a task of 2 classes has 8 samples, >= half of the batch of 8
SIZE = 16  # pixels of the encoded images (readers with an image_size option resize to it)
TINY_BACKBONE = {"in_chans": 3, "width": 4}
ENCODED_FAMILIES = {"celeba", "casia_webface", "cub180", "cub20", "cub200", "tinyimagenet200", "tinyimagenet20"}


def _pattern(class_key: int, rng: np.random.Generator, count: int, size: int) -> np.ndarray:
    """``count`` noisy copies of a class-specific random colour pattern, (count, size, size, 3) uint8."""
    base = np.random.default_rng(class_key).integers(0, 256, size=(size, size, 3))
    noise = rng.normal(0, 20, size=(count, size, size, 3))
    return np.clip(base[None] + noise, 0, 255).astype(np.uint8)


def write_all(root: Path) -> Path:
    """Write every data set of the shipped paper configs under ``root/data``; returns that folder."""
    rng = np.random.default_rng(0)
    data = Path(root) / "data"
    # CIFAR-100 (train/test, 100 fine classes in 20 coarse groups) and CIFAR-10 (5 train batches + test)
    fine = np.repeat(np.arange(100), PER_CLASS)
    images = np.concatenate([_pattern(c, rng, PER_CLASS, 32) for c in range(100)])
    split = (images, fine.tolist(), (fine // 5).tolist())
    fx.write_cifar100(data / "cifar100", split, split, [f"fine{c}" for c in range(100)],
                      [f"coarse{c}" for c in range(20)])
    labels10 = np.repeat(np.arange(10), PER_CLASS)
    images10 = np.concatenate([_pattern(1000 + c, rng, PER_CLASS, 32) for c in range(10)])
    batches = [(images10[i::5], labels10[i::5].tolist()) for i in range(5)]
    fx.write_cifar10(data / "cifar10", batches, (images10, labels10.tolist()),
                     ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"])
    # ImageNet32: ten train batches (1-based labels), classes 1..8 present
    labels_in = np.repeat(np.arange(1, 9), PER_CLASS)
    images_in = np.concatenate([_pattern(2000 + c, rng, PER_CLASS, 32) for c in range(1, 9)])
    for number in range(1, 11):
        fx.write_imagenet32_batch(data / "imagenet32" / f"train_data_batch_{number}", images_in[number - 1::10],
                                  labels_in[number - 1::10].tolist())
    fx.write_imagenet32_batch(data / "imagenet32" / "val_data", images_in[:8], labels_in[:8].tolist(),
                              with_mean=False)
    # Tiny ImageNet 200 (8 synsets here) and the 20 Appendix-C synsets from an ImageNet-1k tree
    wnids = [f"n0{1000000 + k}" for k in range(8)]
    train = {w: list(_pattern(3000 + k, rng, PER_CLASS, SIZE)) for k, w in enumerate(wnids)}
    val = [(w, image) for k, w in enumerate(wnids) for image in _pattern(3000 + k, rng, 2, SIZE)]
    fx.write_tinyimagenet(data, train, val, {w: f"thing {k}" for k, w in enumerate(wnids)}, wnids)
    for k, wnid in enumerate(TINYIMAGENET20_WNIDS):
        for split_name in ("train", "val"):
            for i, image in enumerate(_pattern(4000 + k, rng, 2, SIZE)):
                fx.write_image(data / "imagenet" / split_name / wnid / f"{wnid}_{split_name}_{i}.JPEG", image)
    # CUB-200-2011: all 200 class names; images for classes 1..8 (CUB180 side) and 181..200 (CUB20 side)
    names = [f"{c:03d}.Bird_{c}" for c in range(1, 201)]
    rows = []
    for c in list(range(1, 9)) + list(range(181, 201)):
        for i, image in enumerate(_pattern(5000 + c, rng, PER_CLASS, SIZE)):
            rows.append((c, i % 2 == 0 or c <= 180, image))
    fx.write_cub(data, names, rows)
    # CelebA: identities 1..8 in the train partition, 9..12 in the test partition (2 images each: query + gallery)
    celeba = []
    for identity in range(1, 13):
        partition = 0 if identity <= 8 else 2
        count = PER_CLASS if partition == 0 else 2
        for i, image in enumerate(_pattern(6000 + identity, rng, count, SIZE)):
            celeba.append((f"{identity:03d}{i:03d}.jpg", identity, partition, image))
    fx.write_celeba(data / "celeba", celeba)
    # CASIA-WebFace identity folders (the papers' 3525/7050/10575 become the first 2/3/4 identities here)
    for k in range(4):
        for i, image in enumerate(_pattern(7000 + k, rng, PER_CLASS, SIZE)):
            fx.write_image(data / "casia-webface" / "CASIA-WebFace" / f"{k:07d}" / f"{i + 1:03d}.jpg", image)
    return data


def write_init_checkpoint(path: Path, backbone_config: dict) -> Path:
    """A torch state dict of the tiny backbone, saved like a published checkpoint (read with weights_only=True)."""
    from compat_core.models.backbones import create_backbone

    torch.manual_seed(123)
    backbone = create_backbone("cnn4", **backbone_config)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(backbone.state_dict(), path)
    return path


def _pools(document: dict):
    yield document["data"]
    for entry in document.get("pretrain", []):
        yield entry["pool"]
    yield document["evaluation"]["query_set"]
    yield document["evaluation"]["gallery_set"]


def shrink(document: dict, output: str) -> dict:
    """A paper config made tiny: 3 tasks of 4 + 2 + 2 classes, 1 epoch, cnn4 width 4, 16 px images, at most two
    replacements (at tasks 2 and 3), pre-training pools of 2, 3, 4 classes, K sized to fit. Datasets, readers,
    method, replay, protocol and metric stay as the config has them."""
    document = copy.deepcopy(document)
    document["tasks"]["spec"] = "4+2x1"
    document["training"].update({"epochs": 1, "batch_size": 8, "autocast": False})
    document["model"].update({"backbone": "cnn4", "backbone_config": dict(TINY_BACKBONE)})
    for index, entry in enumerate(document.get("pretrain", [])):
        entry.update({"epochs": 1, "batch_size": 8, "num_classes": 2 + index})
        if entry.get("backbone"):
            entry.update({"backbone": "cnn4", "backbone_config": {"in_chans": 3, "width": 4 + 2 * index}})
        entry["pool"].setdefault("options", {})["num_classes"] = 2 + index
    for index, replacement in enumerate(document.get("replacements", [])):
        replacement["at_task"] = 2 + index
        if replacement.get("backbone"):
            replacement.update({"backbone": "cnn4", "backbone_config": {"in_chans": 3, "width": 4 + 2 * (index + 1)}})
    document["model"]["num_slots"] = min(document["model"]["num_slots"], 2 + len(document.get("pretrain", [])) + 8)
    for pool in _pools(document):
        pool["num_samples"] = None
        if pool["dataset"] in ENCODED_FAMILIES:
            pool.setdefault("options", {})["image_size"] = SIZE
    evaluation = document["evaluation"]
    evaluation.update({"batch_size": 64, "verification_pairs": 40})
    document["output"] = {"dir": output}
    document["device"] = "cpu"
    return document

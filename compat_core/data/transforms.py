"""Batch-wise image transforms on the device: uint8 ``(B, H, W, C)`` in, normalised float ``(B, C, H, W)`` out.

Why the random parts are written here and not taken from ``torchvision.transforms.v2``: a v2 transform called on
a batched tensor draws its random parameters once and applies them to the whole batch, so ``v2.RandomCrop`` would
shift every image of a batch by the same offset and ``v2.RandomHorizontalFlip`` would flip all or none. The papers'
augmentation (``RandomCrop(32, padding=4)`` + ``RandomHorizontalFlip`` per image, as in the public CL2R code) draws
per image. Here the crop is a zero pad followed by a gather with one random offset per image, and the flip is a
per-image ``torch.where``: both vectorised, so a batch costs a few tensor ops on CPU or GPU. The deterministic
parts (dtype conversion with scaling, normalisation) are torchvision v2's functional ops.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from torchvision.transforms.v2 import functional as TF

from compat_core.data.stream import to_device


@dataclass
class BatchTransform:
    """Callable: uint8 ``(B, H, W, C)`` -> float32 (torch's default float dtype) ``(B, C, H, W)`` normalised by ``mean``/``std`` ([0, 1] units).

    With ``train``: per-image random crop of the original size from the image zero-padded by ``crop_padding``
    pixels (padding is black, as torchvision's default fill, i.e. ``-mean/std`` after normalising), then a per-image
    horizontal flip with probability 1/2 when ``hflip``. ``generator`` (a ``torch.Generator``) makes it repeatable.
    """

    mean: tuple[float, ...]
    std: tuple[float, ...]
    train: bool
    crop_padding: int = 4
    hflip: bool = False
    generator: torch.Generator | None = None
    channels_last: bool = False
    _device_stats: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.mean) != len(self.std) or not self.mean:
            raise ValueError(f"mean and std need one value per channel, got mean={self.mean} std={self.std}")
        if any(s <= 0 for s in self.std):
            raise ValueError(f"std values must be > 0, got {self.std}")
        if isinstance(self.crop_padding, bool) or not isinstance(self.crop_padding, int) or self.crop_padding < 0:
            raise ValueError(f"crop_padding must be an integer >= 0 (pixels), got {self.crop_padding!r}")

    def _random(self, high: int, count: int, device: torch.device, rows: tuple[int, int, int] | None = None
                ) -> torch.Tensor:
        where = self.generator.device if self.generator is not None else device
        if rows is None:
            return to_device(torch.randint(0, high, (count,), generator=self.generator, device=where), device)
        start, stop, total = rows  # draw for the whole batch, keep these rows: the same draws as one process
        values = torch.randint(0, high, (total,), generator=self.generator, device=where)
        return to_device(values[start:stop], device)

    def _stats(self, device: torch.device, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """mean and std as ``dtype`` tensors on ``device``, made once per device and dtype (a list passed to normalize is
        copied to the device on every call, a host-device sync per batch on CUDA)."""
        key = (str(device), dtype)
        if key not in self._device_stats:
            self._device_stats[key] = tuple(to_device(torch.tensor(v, dtype=dtype), device)
                                            for v in (self.mean, self.std))
        return self._device_stats[key]

    def __call__(self, images: torch.Tensor, rows: tuple[int, int, int] | None = None) -> torch.Tensor:
        """Transform ``images``; ``rows=(start, stop, total)``: they are rows [start, stop) of a batch of ``total``
        (data-parallel training), and the random draws are those of the whole batch."""
        if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or images.ndim != 4:
            got = f"{images.dtype} {tuple(images.shape)}" if isinstance(images, torch.Tensor) else type(images).__name__
            raise ValueError(f"transform input must be a uint8 tensor (B, H, W, C), got {got}")
        if images.shape[-1] != len(self.mean):
            raise ValueError(
                f"transform input has {images.shape[-1]} channels but mean/std have {len(self.mean)} values"
            )
        batch = images.permute(0, 3, 1, 2)  # (B, C, H, W) view; the gathers below make it contiguous
        if rows is not None and (rows[1] - rows[0] != batch.shape[0] or not 0 <= rows[0] <= rows[1] <= rows[2]):
            raise ValueError(f"transform rows {rows} do not describe {batch.shape[0]} rows of a batch")
        if self.train and batch.shape[0] > 0:
            batch = self._augment(batch, rows)
        # torch's default float dtype: fp32 unless a caller (an fp64 parity run) changed it
        out = TF.to_dtype(batch.contiguous(), torch.get_default_dtype(), scale=True)
        mean, std = self._stats(out.device, out.dtype)
        out = TF.normalize(out, mean=mean, std=std)
        if self.channels_last:
            out = out.contiguous(memory_format=torch.channels_last)
        return out

    def _augment(self, batch: torch.Tensor, draws: tuple[int, int, int] | None = None) -> torch.Tensor:
        count, channels, height, width = batch.shape
        device = batch.device
        pad = self.crop_padding
        if pad > 0:
            padded = F.pad(batch, (pad, pad, pad, pad), value=0)
            top = self._random(2 * pad + 1, count, device, draws)
            left = self._random(2 * pad + 1, count, device, draws)
            rows = (top[:, None] + torch.arange(height, device=device)[None, :])  # (B, H)
            cols = (left[:, None] + torch.arange(width, device=device)[None, :])  # (B, W)
            row_index = rows[:, None, :, None].expand(count, channels, height, padded.shape[-1])
            batch = torch.gather(padded, 2, row_index)
            col_index = cols[:, None, None, :].expand(count, channels, height, width)
            batch = torch.gather(batch, 3, col_index)
        if self.hflip:
            flip = self._random(2, count, device, draws).bool()
            batch = torch.where(flip[:, None, None, None], batch.flip(-1), batch)
        return batch


def make_transforms(
    source_or_stats,
    train: bool,
    crop_padding: int = 4,
    hflip: bool | None = None,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    channels_last: bool = False,
) -> BatchTransform:
    """The train or eval transform of a data source.

    source_or_stats: an ImageSource (uses its ``mean``, ``std`` and ``hflip``) or a pair ``(mean, std)`` of
    per-channel sequences in [0, 1] units (flip off unless ``hflip=True``). hflip: None follows the source; a
    bool overrides it. seed: builds a CPU ``torch.Generator`` when ``generator`` is not given.
    """
    if hasattr(source_or_stats, "mean") and hasattr(source_or_stats, "std"):
        mean, std = source_or_stats.mean, source_or_stats.std
        domain_flip = bool(getattr(source_or_stats, "hflip", False))
    elif isinstance(source_or_stats, (tuple, list)) and len(source_or_stats) == 2:
        mean, std = source_or_stats
        domain_flip = False
    else:
        raise ValueError(
            "make_transforms needs an ImageSource (with mean, std, hflip) or a (mean, std) pair, "
            f"got {type(source_or_stats).__name__}"
        )
    mean_t = _as_floats(mean, "mean")
    std_t = _as_floats(std, "std")
    if generator is None and seed is not None:
        generator = torch.Generator().manual_seed(int(seed))
    return BatchTransform(
        mean=mean_t,
        std=std_t,
        train=bool(train),
        crop_padding=crop_padding,
        hflip=domain_flip if hflip is None else bool(hflip),
        generator=generator,
        channels_last=channels_last,
    )


def _as_floats(values: Sequence[float] | float, name: str) -> tuple[float, ...]:
    if isinstance(values, (int, float)):
        return (float(values),)
    try:
        return tuple(float(v) for v in values)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of per-channel floats, got {values!r}") from None


__all__ = ["BatchTransform", "make_transforms"]

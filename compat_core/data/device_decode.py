"""JPEG decode on the training device (``training.decode: gpu``): encoded bytes in, a uint8 ``(n, S, S, 3)`` batch on
the device out, fitted like :func:`compat_core.data.encoded.decode_batch` (the centred square of side min(H, W),
resized to S x S: bilinear when enlarging, antialiased bilinear when shrinking).

On CUDA, ``torchvision.io.decode_jpeg(..., device="cuda")`` decodes a whole batch with nvJPEG, and the crop and
resize run there too, so the CPU only gathers bytes: where a node's CPUs cannot decode as fast as its GPU trains,
the GPU decodes instead. The same function runs with ``device="cpu"`` (libjpeg-turbo, torch's resize), which is how
it is tested on machines without CUDA. The resize is torch's, not OpenCV's, so pixels differ from ``decode_batch``
by rounding-level amounts (a test bounds the difference).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch.nn import functional as F

__all__ = ["decode_on_device"]


def _fit(image: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 ``(3, H, W)`` -> uint8 ``(size, size, 3)``: the centred square, resized (antialiased when shrinking)."""
    height, width = image.shape[-2:]
    side = min(height, width)
    top, left = (height - side) // 2, (width - side) // 2
    square = image[:, top:top + side, left:left + side]
    if side != size:
        resized = F.interpolate(square[None].float(), size=(size, size), mode="bilinear", align_corners=False,
                                antialias=side > size)[0]
        square = resized.round_().clamp_(0, 255).to(torch.uint8)
    return square.permute(1, 2, 0)


def decode_on_device(blobs: Sequence[bytes], size: int, device: torch.device | str, where: str) -> torch.Tensor:
    """JPEG/PNG bytes -> uint8 RGB ``(n, size, size, 3)`` on ``device``: JPEGs decoded there in one batched call
    (nvJPEG on CUDA), other formats on the CPU and moved; then fitted on the device (module doc). ``where`` names
    the data in a decode error."""
    from torchvision.io import ImageReadMode, decode_image, decode_jpeg

    device = torch.device(device)
    tensors = [torch.frombuffer(bytearray(blob), dtype=torch.uint8) for blob in blobs]
    jpeg = [i for i, blob in enumerate(blobs) if bytes(blob[:2]) == b"\xff\xd8"]
    decoded: list = [None] * len(blobs)
    try:
        if jpeg:
            images = decode_jpeg([tensors[i] for i in jpeg], mode=ImageReadMode.RGB, device=device)
            for i, image in zip(jpeg, images):
                decoded[i] = image
        for i in sorted(set(range(len(blobs))) - set(jpeg)):
            decoded[i] = decode_image(tensors[i], mode=ImageReadMode.RGB).to(device)
    except RuntimeError as error:
        raise ValueError(f"cannot decode an image of {where}: {error} (expected JPEG or PNG bytes)") from None
    if not decoded:
        return torch.empty((0, size, size, 3), dtype=torch.uint8, device=device)
    return torch.stack([_fit(image, size) for image in decoded])

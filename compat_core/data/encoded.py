"""Encoded images (JPEG/PNG bytes): the two decoders and :class:`EncodedImages`, bytes that index like a uint8
``(M, H, W, C)`` array.

``decode_image`` (PIL) is how the published readers decode; ``decode_batch`` (torchvision + OpenCV) is the ingested
shards' opt-in decoder. Dataset sources hand out their samples' bytes as ``EncodedImages`` and replay shards store
them, so both read back exactly as the source that produced the bytes reads them.
"""
from __future__ import annotations

import io
from typing import Sequence

import numpy as np

DECODERS = ("pil", "torchvision")
ENCODED_PREFIX = "encoded/"    # + the decoder: "encoded/pil", "encoded/torchvision"


def decode_image(data: bytes, size: int, where: str) -> np.ndarray:
    """Decode JPEG/PNG bytes to uint8 RGB ``(size, size, 3)``.

    Non-square images are scaled so the shorter side is ``size`` and centre-cropped (aspect ratio kept); an image
    already ``size`` x ``size`` is returned exactly as decoded.
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image = image.convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"cannot decode image {where}: {exc} (expected JPEG or PNG bytes)") from None
    if image.size != (size, size):
        image = ImageOps.fit(image, (size, size), method=Image.Resampling.BILINEAR)
    return np.asarray(image, dtype=np.uint8)


def decode_batch(blobs: Sequence[bytes], size: int, where: str) -> np.ndarray:
    """JPEG/PNG bytes -> uint8 RGB ``(n, size, size, 3)``: torchvision's libjpeg-turbo decoder (one batched call
    for the JPEGs), then the centred square of side min(H, W) resized to ``size`` x ``size`` straight into the
    output (OpenCV: bilinear when enlarging, pixel-area averaging, i.e. antialiased, when shrinking), the geometry of
    the published readers' ``ImageOps.fit`` (crop box first, then resize).

    Why these parts (measured on 178x218 CelebA-sized JPEGs to 224 px, one thread): decode ~135 us per image;
    OpenCV's fixed-point resize ~75 us against ~130 us for torch's uint8 antialiased interpolate, and it writes
    into the batch array, saving the ~20 us copy; cropping first spends no resize work on dropped rows.
    Pixel values differ slightly from PIL's (other resampling code), so it is an opt-in reader option."""
    import cv2
    import torch
    from torchvision.io import ImageReadMode, decode_image, decode_jpeg

    tensors = [torch.frombuffer(bytearray(blob), dtype=torch.uint8) for blob in blobs]
    jpeg = [i for i, blob in enumerate(blobs) if blob[:2] == b"\xff\xd8"]
    decoded: list = [None] * len(blobs)
    try:
        if jpeg:
            for i, image in zip(jpeg, decode_jpeg([tensors[i] for i in jpeg], mode=ImageReadMode.RGB)):
                decoded[i] = image
        for i in set(range(len(blobs))) - set(jpeg):
            decoded[i] = decode_image(tensors[i], mode=ImageReadMode.RGB)
    except RuntimeError as error:
        raise ValueError(f"cannot decode an image of {where}: {error} (expected JPEG or PNG bytes)") from None
    out = np.empty((len(blobs), size, size, 3), dtype=np.uint8)
    for row, image in enumerate(decoded):
        pixels = image.permute(1, 2, 0).numpy()  # (H, W, 3) view: the decoders' memory is HWC already
        height, width = pixels.shape[:2]
        if (height, width) == (size, size):
            out[row] = pixels
            continue
        side = min(height, width)
        top, left = (height - side) // 2, (width - side) // 2
        square = np.ascontiguousarray(pixels[top:top + side, left:left + side])
        cv2.resize(square, (size, size), dst=out[row],
                   interpolation=cv2.INTER_LINEAR if side < size else cv2.INTER_AREA)
    return out


class EncodedImages:
    """Encoded images (JPEG/PNG bytes) that index like a uint8 ``(M, H, W, C)`` array: ``images[rows]`` decodes
    those rows, fitted to ``image_shape`` by ``decoder`` ("pil": ``decode_image``, the published readers' decoder;
    "torchvision": ``decode_batch``, the ingested shards' opt-in decoder), so they read back exactly as the source
    that produced the bytes reads them."""

    dtype = np.dtype(np.uint8)
    ndim = 4

    def __init__(self, blobs: list[bytes], image_shape: tuple[int, int, int], decoder: str = "pil") -> None:
        if decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {DECODERS}, got {decoder!r}")
        if len(image_shape) != 3 or image_shape[0] != image_shape[1] or image_shape[2] != 3:
            raise ValueError(f"encoded images decode to square RGB (S, S, 3), got image_shape {image_shape}")
        self.blobs = list(blobs)
        self.image_shape = tuple(int(v) for v in image_shape)
        self.decoder = decoder

    @property
    def encoding(self) -> str:
        return ENCODED_PREFIX + self.decoder

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (len(self.blobs), *self.image_shape)

    def __len__(self) -> int:
        return len(self.blobs)

    def take(self, rows) -> "EncodedImages":
        """The encoded rows ``rows`` (no decoding)."""
        return EncodedImages([self.blobs[int(r)] for r in np.arange(len(self))[rows].reshape(-1)],
                             self.image_shape, self.decoder)

    def __getitem__(self, rows) -> np.ndarray:
        single = isinstance(rows, (int, np.integer))
        picked = self.take(rows).blobs
        size = self.image_shape[0]
        if self.decoder == "torchvision" and picked:
            images = decode_batch(picked, size, "replay shard")
        else:
            images = np.empty((len(picked), *self.image_shape), dtype=np.uint8)
            for row, data in enumerate(picked):
                images[row] = decode_image(data, size, f"replay shard row {row}")
        return images[0] if single else images

    def __array__(self, dtype=None, copy=None):
        images = self[:]
        return images if dtype is None else images.astype(dtype)


__all__ = ["DECODERS", "ENCODED_PREFIX", "EncodedImages", "decode_batch", "decode_image"]

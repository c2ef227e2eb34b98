"""Rendering of the glyph set: the images of one class in one style (seeded variations of font, size, position,
rotation, stroke, blur, contrast, texture and noise) and whole pools, cached as ``.npz`` under a key of the
rendering parameters.
"""
from __future__ import annotations

import hashlib
import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from compat_core.data.glyphs.catalogue import (
    DEFAULT_IMAGE_SIZE,
    GLYPHS_VERSION,
    GlyphCatalogue,
    _atomic_write_bytes,
    _layout_key,
)
from compat_core.data.glyphs.fonts import STYLES, GlyphStyle, _font


def _bilinear_matrix(out_size: int, in_size: int) -> np.ndarray:
    """(out_size, in_size) weights that upsample a coarse grid to ``out_size`` pixels (align-corners)."""
    position = np.linspace(0.0, in_size - 1.0, out_size)
    low = np.clip(np.floor(position).astype(int), 0, in_size - 2)
    frac = position - low
    weights = np.zeros((out_size, in_size))
    weights[np.arange(out_size), low] = 1.0 - frac
    weights[np.arange(out_size), low + 1] = frac
    return weights


def render_class(
    char: str, fonts: tuple[str, ...], style: GlyphStyle, count: int, seed: int, image_size: int = DEFAULT_IMAGE_SIZE
) -> tuple[np.ndarray, np.ndarray]:
    """``count`` images of ``char`` in ``style``: uint8 ``(count, image_size, image_size)`` and the font index of each
    image into ``fonts``. Deterministic in (char, style name, seed, count, image_size)."""
    from PIL import Image, ImageDraw, ImageFilter

    if not fonts:
        raise ValueError(f"glyphs: no font of style {style.name!r} draws {char!r} (U+{ord(char):04X})")
    style_index = sorted(STYLES).index(style.name) if style.name in STYLES else 99
    rng = np.random.default_rng([seed, style_index, ord(char)])
    font_choice = np.resize(rng.permutation(len(fonts)), count)
    sizes = rng.integers(style.size_px[0], style.size_px[1] + 1, size=count)
    angles = rng.uniform(-style.max_rotation_deg, style.max_rotation_deg, size=count)
    shifts = rng.integers(-style.max_shift_px, style.max_shift_px + 1, size=(count, 2))
    strokes = rng.choice(np.asarray(style.stroke_widths), size=count)
    blurs = rng.uniform(*style.blur_sigma_px, size=count)
    background = rng.uniform(*style.background, size=count)
    contrast = rng.uniform(*style.contrast, size=count)
    texture_amp = rng.uniform(*style.texture_amplitude, size=count)
    texture = rng.uniform(-1.0, 1.0, size=(count, 4, 4))
    noise_sigma = rng.uniform(*style.noise_sigma, size=count)
    noise = rng.standard_normal((count, image_size, image_size))

    margin = image_size // 4
    canvas = image_size + 2 * margin
    fit = image_size - 2 * style.max_shift_px - 2  # the ink box must survive the largest shift uncut
    glyphs = np.empty((count, image_size, image_size), dtype=np.float32)
    for i in range(count):
        font_name = fonts[font_choice[i]]
        size = int(sizes[i])
        # A stroke on an already bold face fills the counters ('e', 'a') at 32 px: regular weights only.
        stroke = 0 if "Bol" in font_name else int(strokes[i])
        while True:
            font = _font(font_name, size)
            left, top, right, bottom = font.getbbox(char, stroke_width=stroke)
            # Tall accented capitals ('Ǘ') would be cut at the larger sizes: shrink them until they fit.
            if max(right - left, bottom - top) <= fit or size <= 8:
                break
            size -= 1
        image = Image.new("L", (canvas, canvas), 0)
        x = round(canvas / 2 - (left + right) / 2)
        y = round(canvas / 2 - (top + bottom) / 2)
        ImageDraw.Draw(image).text((x, y), char, font=font, fill=255, stroke_width=stroke, stroke_fill=255)
        if angles[i] != 0.0:
            image = image.rotate(float(angles[i]), resample=Image.BILINEAR)
        if blurs[i] > 0.0:
            image = image.filter(ImageFilter.GaussianBlur(radius=float(blurs[i])))
        dx, dy = int(shifts[i, 0]), int(shifts[i, 1])
        box = (margin - dx, margin - dy, margin - dx + image_size, margin - dy + image_size)
        glyphs[i] = np.asarray(image.crop(box), dtype=np.float32) / 255.0

    upsample = _bilinear_matrix(image_size, 4)
    field_ = upsample @ texture @ upsample.T  # (count, image_size, image_size) smooth background texture
    foreground = np.minimum(background + contrast, 1.0)
    pixels = (
        background[:, None, None]
        + (foreground - background)[:, None, None] * glyphs
        + texture_amp[:, None, None] * field_
        + noise_sigma[:, None, None] * noise
    )
    images = np.clip(np.rint(pixels * 255.0), 0, 255).astype(np.uint8)
    return images, font_choice.astype(np.int64)


def _render_key(layout_seed: int, images_per_class: int, seed: int, image_size: int, style: GlyphStyle) -> str:
    text = json.dumps(
        {"layout": _layout_key(layout_seed), "images_per_class": images_per_class, "seed": seed,
         "image_size": image_size, "style": style.__dict__},
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class _RenderedPool:
    images: np.ndarray
    labels: np.ndarray
    instance_ids: np.ndarray
    font_ids: np.ndarray
    mean: tuple[float, ...]
    std: tuple[float, ...]
    render_seconds: float
    from_cache: bool
    path: Path


def _render_pool(
    catalogue: GlyphCatalogue, pool: str, style: GlyphStyle, images_per_class: int, seed: int, image_size: int,
    root: Path, layout_seed: int,
) -> _RenderedPool:
    key = _render_key(layout_seed, images_per_class, seed, image_size, style)
    path = root / key / f"{pool}-{style.name}.npz"
    class_ids = catalogue.pools[pool]
    if path.is_file():
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(str(data["meta"]))
                if meta["chars"] == "".join(catalogue.chars[i] for i in class_ids):
                    return _RenderedPool(
                        images=data["images"], labels=data["labels"], instance_ids=data["instance_ids"],
                        font_ids=data["font_ids"], mean=tuple(meta["mean"]), std=tuple(meta["std"]),
                        render_seconds=float(meta["render_seconds"]), from_cache=True, path=path,
                    )
                warnings.warn(f"glyphs: cache {path} holds other classes; rendering again", stacklevel=3)
        except (OSError, ValueError, KeyError) as error:
            warnings.warn(f"glyphs: unreadable cache {path} ({error}); rendering again", stacklevel=3)

    started = time.perf_counter()
    total = len(class_ids) * images_per_class
    images = np.empty((total, image_size, image_size, 1), dtype=np.uint8)
    font_ids = np.empty(total, dtype=np.int64)
    for row, class_id in enumerate(class_ids):
        block = slice(row * images_per_class, (row + 1) * images_per_class)
        rendered, fonts_used = render_class(
            catalogue.chars[class_id], catalogue.fonts[style.name][class_id], style, images_per_class, seed, image_size
        )
        images[block, :, :, 0] = rendered
        # Font ids index the style's font list, so they compare across classes.
        style_position = [style.fonts.index(name) for name in catalogue.fonts[style.name][class_id]]
        font_ids[block] = np.asarray(style_position)[fonts_used]
    labels = np.repeat(class_ids, images_per_class)
    instance_ids = np.tile(np.arange(images_per_class, dtype=np.int64), len(class_ids))
    # Exact statistics from the 256-bin histogram: no float copy of the whole pool.
    histogram = np.bincount(images.ravel(), minlength=256).astype(np.float64)
    levels = np.arange(256, dtype=np.float64) / 255.0
    mean_value = float((histogram * levels).sum() / histogram.sum())
    variance = float((histogram * (levels - mean_value) ** 2).sum() / histogram.sum())
    mean = (mean_value,)
    std = (max(variance ** 0.5, 1e-3),)
    seconds = time.perf_counter() - started
    meta = {"chars": "".join(catalogue.chars[i] for i in class_ids), "mean": mean, "std": std,
            "render_seconds": seconds, "style": style.name, "pool": pool, "version": GLYPHS_VERSION}
    import io

    buffer = io.BytesIO()
    np.savez(buffer, images=images, labels=labels, instance_ids=instance_ids, font_ids=font_ids,
             meta=np.asarray(json.dumps(meta, ensure_ascii=False)))
    _atomic_write_bytes(path, buffer.getvalue())
    return _RenderedPool(images, labels, instance_ids, font_ids, mean, std, seconds, False, path)

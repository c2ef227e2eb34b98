"""Pictures placed side by side (the demo's two matrix heatmaps as one image for the README and the terminal)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence


def side_by_side(pictures: Sequence[str | os.PathLike], output: str | os.PathLike, gap: int = 16) -> Path:
    """Write the PNGs ``pictures`` left to right on white, top-aligned, ``gap`` pixels apart, to ``output``."""
    from PIL import Image

    if not pictures:
        raise ValueError("side_by_side: expected at least one picture")
    images = []
    for path in pictures:
        with Image.open(path) as image:
            images.append(image.convert("RGB"))
    width = sum(image.width for image in images) + gap * (len(images) - 1)
    canvas = Image.new("RGB", (width, max(image.height for image in images)), "white")
    left = 0
    for image in images:
        canvas.paste(image, (left, 0))
        left += image.width + gap
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(output, optimize=True)
    return output


__all__ = ["side_by_side"]

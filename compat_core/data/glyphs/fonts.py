"""The fonts and rendering styles of the glyph set: matplotlib's bundled TrueType files, which code points each
draws, the fingerprint of the font files and rasteriser (part of every cache key), and the two styles (``source``,
``target``) with the ranges their variations are drawn from.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

# Computer Modern TTFs from matplotlib use TeX encodings: only ASCII letters and digits sit at their Unicode
# code points, so those fonts may draw nothing else.
_TEX_ENCODED_FONTS = frozenset({"cmr10.ttf", "cmb10.ttf", "cmti10.ttf", "cmss10.ttf", "cmtt10.ttf"})
_ASCII_ALNUM = frozenset(ord(c) for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")

# Reference renders used to find homoglyphs (Latin A / Greek Alpha / Cyrillic A) and near-invisible glyphs.
_REFERENCE_FONTS = ("DejaVuSans.ttf", "DejaVuSerif.ttf", "STIXGeneral.ttf", "DejaVuSansMono.ttf")


@dataclass(frozen=True)
class GlyphStyle:
    """How instances of one style are drawn. Lengths in pixels of the output image, angles in degrees,
    intensities as fractions of full white (0 = black, 1 = white); ``(lo, hi)`` pairs are uniform ranges.
    ``size_px`` is the font size (em) before shrinking glyphs that would not fit; ``stroke_widths`` is drawn from
    uniformly and applies to regular-weight faces only; ``texture_amplitude`` scales a smooth 4x4 random field."""

    name: str
    fonts: tuple[str, ...]
    size_px: tuple[int, int]
    max_shift_px: int
    max_rotation_deg: float
    stroke_widths: tuple[int, ...]
    blur_sigma_px: tuple[float, float]
    background: tuple[float, float]
    contrast: tuple[float, float]
    texture_amplitude: tuple[float, float]
    noise_sigma: tuple[float, float]


STYLES: dict[str, GlyphStyle] = {
    "source": GlyphStyle(
        name="source",
        fonts=("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSans-Oblique.ttf", "DejaVuSans-BoldOblique.ttf",
               "DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf", "DejaVuSerif-Italic.ttf", "DejaVuSerif-BoldItalic.ttf"),
        size_px=(19, 25),
        max_shift_px=2,
        max_rotation_deg=6.0,
        stroke_widths=(0,),
        blur_sigma_px=(0.0, 0.0),
        background=(0.0, 0.08),
        contrast=(0.82, 0.92),
        texture_amplitude=(0.0, 0.0),
        noise_sigma=(0.0, 0.02),
    ),
    "target": GlyphStyle(
        name="target",
        fonts=("STIXGeneral.ttf", "STIXGeneralBol.ttf", "STIXGeneralItalic.ttf", "STIXGeneralBolIta.ttf",
               "DejaVuSansMono.ttf", "DejaVuSansMono-Bold.ttf", "DejaVuSansMono-Oblique.ttf",
               "DejaVuSansMono-BoldOblique.ttf", "cmr10.ttf", "cmb10.ttf", "cmti10.ttf", "cmss10.ttf", "cmtt10.ttf"),
        size_px=(17, 25),
        max_shift_px=3,
        max_rotation_deg=12.0,
        stroke_widths=(0, 0, 1),
        blur_sigma_px=(0.2, 0.8),
        background=(0.0, 0.3),
        contrast=(0.4, 0.8),
        texture_amplitude=(0.03, 0.12),
        noise_sigma=(0.02, 0.07),
    ),
}


def font_dir() -> Path:
    """The folder of TrueType fonts shipped with matplotlib."""
    import matplotlib

    return Path(matplotlib.get_data_path()) / "fonts" / "ttf"


@functools.lru_cache(maxsize=1)
def _font_fingerprint() -> str:
    """Font file names + sizes and the rasteriser versions: a change in any of them changes the pixels."""
    import PIL
    from PIL import features

    folder = font_dir()
    names = sorted({name for style in STYLES.values() for name in style.fonts} | set(_REFERENCE_FONTS))
    parts = []
    for name in names:
        path = folder / name
        if not path.is_file():
            raise FileNotFoundError(
                f"glyphs: font file {path} is missing; the glyph set needs matplotlib's bundled fonts "
                f"({', '.join(names)})"
            )
        parts.append(f"{name}:{path.stat().st_size}")
    parts.append(f"pillow:{PIL.__version__}")
    parts.append(f"freetype:{features.version('freetype2')}")
    return ";".join(parts)


@functools.lru_cache(maxsize=512)
def _font(name: str, size: int):
    from PIL import ImageFont

    return ImageFont.truetype(str(font_dir() / name), size)


@functools.lru_cache(maxsize=None)
def _charmap(name: str) -> frozenset[int]:
    from matplotlib.ft2font import FT2Font

    codes = frozenset(FT2Font(str(font_dir() / name)).get_charmap())
    if name in _TEX_ENCODED_FONTS:
        codes = codes & _ASCII_ALNUM
    return codes

"""The offline many-class data set: characters rendered with the TrueType fonts that matplotlib installs.

A class is one Unicode character (code point). Its images are drawn by every font of a rendering *style* whose
character map covers it, with seeded variations of font, size, position, rotation, stroke, blur, contrast, texture
and noise. Nothing is downloaded: the fonts ship inside matplotlib (``matplotlib/mpl-data/fonts/ttf``).

Class pools mirror the roles in the papers (IAM-CL2R: ImageNet32 -> CIFAR100 -> CIFAR10):

- ``pretrain``: classes for third-party models, a fixed seeded order so that every prefix is a nested pool;
  ``pretrain-1`` / ``-2`` / ``-3`` are the first 100 / 300 / 600 classes (the ImageNet32 pool sizes of IAM-CL2R).
- ``finetune``: 100 classes (the demo's 10 + 6x15): for every *concept* (a Latin base letter with enough
  accented variants) the plain letter plus further variants, e.g. ``u``, ``ü``.
- ``test``: the open-set pool for query/gallery: other variants of the same base letters, e.g. ``ú``, ``ű``, ``ṹ``.
  Fine labels are disjoint from every training pool; the coarse label (base letter, by Unicode canonical
  decomposition, case kept) is shared with fine-tuning classes, as CIFAR10's ``truck`` is covered by CIFAR100's
  ``pickup truck``. Evaluate it with ``label_level="coarse"``.
- ``val``: the validation pool, built like ``test`` from forms left over by every other pool (up to
  TEST_MEMBERS_PER_CONCEPT more forms of each base letter): its characters are in no other pool, so selecting a
  setting on ``val-query`` / ``val-gallery`` sees neither a test image nor a test class nor a trained class.

Styles: ``source`` (clean DejaVu Sans/Serif, for pre-training) and ``target`` (STIX, DejaVu Sans Mono and Computer
Modern, stroke, blur, lower contrast, background texture and noise, for fine-tuning and test). Any pool can be
rendered in either style; by default ``pretrain`` uses ``source`` and the others ``target``.

Labels are *global* class ids of the whole glyph set (pretrain pool first, then finetune, test, val), so labels of
different pools never collide and :func:`compat_core.data.tasks.check_open_set` works on them directly.

Rendered pools are cached as ``.npz`` under ``~/.cache/compat/glyphs/<key>/`` where ``<key>`` hashes the rendering
parameters, the code version, the font files and the Pillow/FreeType versions; ``cache_dir`` overrides the root.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
import time
import unicodedata
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from compat_core.data.base import ArraySource
from compat_core.data.registry import register_dataset

# Bump whenever rendering, the catalogue rules or the pool layout change: it is part of the cache key.
GLYPHS_VERSION = "2"

PRETRAIN_POOL_SIZES: tuple[int, ...] = (100, 300, 600)
FINETUNE_CLASSES = 100
TEST_MEMBERS_PER_CONCEPT = 4
# A concept needs at least one member for fine-tuning and one for test; 4 leaves room for variety in both.
MIN_CONCEPT_MEMBERS = 4
MIN_FONTS_PER_STYLE = 2
DEFAULT_IMAGES_PER_CLASS = 48
DEFAULT_IMAGE_SIZE = 32

# Computer Modern TTFs from matplotlib use TeX encodings: only ASCII letters and digits sit at their Unicode
# code points, so those fonts may draw nothing else.
_TEX_ENCODED_FONTS = frozenset({"cmr10.ttf", "cmb10.ttf", "cmti10.ttf", "cmss10.ttf", "cmtt10.ttf"})
_ASCII_ALNUM = frozenset(ord(c) for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")

# Reference renders used to find homoglyphs (Latin A / Greek Alpha / Cyrillic A) and near-invisible glyphs.
_REFERENCE_FONTS = ("DejaVuSans.ttf", "DejaVuSerif.ttf", "STIXGeneral.ttf", "DejaVuSansMono.ttf")
_REFERENCE_SIZE = 24
# RMS difference (pixel values in [0, 1]) below which two centred reference renders count as the same glyph.
_HOMOGLYPH_RMS = 0.06
_MIN_INK_SIDE_PX = 7  # at the reference size: drops '.', ',', '·' that differ only by position
_MIN_INK_PIXELS = 15.0

_ALLOWED_CATEGORIES = frozenset({"Lu", "Ll", "Lt", "Lo", "Nd", "No", "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po",
                                 "Sm", "Sc", "So"})


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

SPLITS = ("finetune", "pretrain", "pretrain-1", "pretrain-2", "pretrain-3", "test", "test-query", "test-gallery",
          "val", "val-query", "val-gallery")
_POOL_OF_SPLIT = {"pretrain": "pretrain", "pretrain-1": "pretrain", "pretrain-2": "pretrain",
                  "pretrain-3": "pretrain", "finetune": "finetune", "test": "test", "test-query": "test",
                  "test-gallery": "test", "val": "val", "val-query": "val", "val-gallery": "val"}
_DEFAULT_STYLE_OF_POOL = {"pretrain": "source", "finetune": "target", "test": "target", "val": "target"}


def font_dir() -> Path:
    """The folder of TrueType fonts shipped with matplotlib."""
    import matplotlib

    return Path(matplotlib.get_data_path()) / "fonts" / "ttf"


def default_cache_dir() -> Path:
    """``~/.cache/compat/glyphs`` (``XDG_CACHE_HOME`` respected)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "compat" / "glyphs"


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


def _eligible_character(code: int) -> bool:
    char = chr(code)
    if 0xFFF0 <= code <= 0xFFFF:  # the replacement character stands for a missing glyph, not a class
        return False
    if unicodedata.category(char) not in _ALLOWED_CATEGORIES:
        return False
    # Canonical singletons (Kelvin sign, Angstrom sign, Greek tonos duplicates) are the same character twice.
    if unicodedata.normalize("NFC", char) != char:
        return False
    # Compatibility characters (superscripts, ligatures, circled or full-width forms) are variants, not letters.
    return not unicodedata.decomposition(char).startswith("<")


def _concept_of(char: str) -> str:
    """The base character by canonical decomposition ('ü' -> 'u', 'Ǘ' -> 'U'); case is kept."""
    return unicodedata.normalize("NFD", char)[0]


def _centered_render(char: str, font_name: str, size: int, canvas: int) -> np.ndarray:
    """``char`` drawn white on black with its ink box centred in a ``canvas`` x ``canvas`` float image."""
    from PIL import Image, ImageDraw

    font = _font(font_name, size)
    left, top, right, bottom = font.getbbox(char)
    image = Image.new("L", (canvas, canvas), 0)
    x = round(canvas / 2 - (left + right) / 2)
    y = round(canvas / 2 - (top + bottom) / 2)
    ImageDraw.Draw(image).text((x, y), char, font=font, fill=255)
    return np.asarray(image, dtype=np.float32) / 255.0


@dataclass(frozen=True)
class GlyphCatalogue:
    """Every class of the glyph set: ``chars[i]`` is global class id ``i``.

    ``pools`` maps pool name to its global class ids (``pretrain`` in its nested order); ``coarse_of_class[i]``
    indexes ``coarse_names`` (the base letter of class ``i``); ``fonts[style][i]`` names the style's fonts that
    draw class ``i``.
    """

    chars: tuple[str, ...]
    coarse_names: tuple[str, ...]
    coarse_of_class: np.ndarray
    pools: dict[str, np.ndarray]
    fonts: dict[str, tuple[tuple[str, ...], ...]]
    candidates_considered: int
    homoglyphs_dropped: int

    @property
    def num_classes(self) -> int:
        return len(self.chars)

    def class_names(self) -> list[str]:
        """Readable names: the character and its code point, e.g. ``'ü U+00FC'``."""
        return [f"{char} U+{ord(char):04X}" for char in self.chars]

    def to_dict(self) -> dict:
        return {
            "chars": list(self.chars),
            "coarse_names": list(self.coarse_names),
            "coarse_of_class": [int(v) for v in self.coarse_of_class],
            "pools": {name: [int(v) for v in ids] for name, ids in self.pools.items()},
            "fonts": {style: [list(names) for names in per_class] for style, per_class in self.fonts.items()},
            "candidates_considered": self.candidates_considered,
            "homoglyphs_dropped": self.homoglyphs_dropped,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "GlyphCatalogue":
        return cls(
            chars=tuple(data["chars"]),
            coarse_names=tuple(data["coarse_names"]),
            coarse_of_class=np.asarray(data["coarse_of_class"], dtype=np.int64),
            pools={name: np.asarray(ids, dtype=np.int64) for name, ids in data["pools"].items()},
            fonts={style: tuple(tuple(names) for names in per_class) for style, per_class in data["fonts"].items()},
            candidates_considered=int(data["candidates_considered"]),
            homoglyphs_dropped=int(data["homoglyphs_dropped"]),
        )


def _distinct_characters() -> tuple[list[str], int, int]:
    """Characters drawn by >= MIN_FONTS_PER_STYLE fonts of every style, without homoglyphs or specks.

    Returns (kept characters in code-point order, candidates considered, homoglyphs dropped). Lower code points
    win a homoglyph tie, so Latin 'A' is kept and Greek 'Alpha' / Cyrillic 'A' are dropped.
    """
    covering = {name: _charmap(name) for style in STYLES.values() for name in style.fonts}
    all_codes = sorted(set().union(*covering.values()))
    candidates = [
        code for code in all_codes
        if _eligible_character(code)
        and all(sum(code in covering[name] for name in style.fonts) >= MIN_FONTS_PER_STYLE for style in STYLES.values())
    ]
    canvas = DEFAULT_IMAGE_SIZE
    renders: dict[str, dict[int, np.ndarray]] = {name: {} for name in _REFERENCE_FONTS}
    visible = []
    for code in candidates:
        char = chr(code)
        first = None
        for name in _REFERENCE_FONTS:
            if code in _charmap(name):
                bitmap = _centered_render(char, name, _REFERENCE_SIZE, canvas)
                renders[name][code] = bitmap
                first = bitmap if first is None else first
        if first is None:
            continue
        rows = np.flatnonzero(first.max(axis=1) > 0.25)
        cols = np.flatnonzero(first.max(axis=0) > 0.25)
        if rows.size == 0 or first.sum() < _MIN_INK_PIXELS:
            continue
        if max(rows[-1] - rows[0] + 1, cols[-1] - cols[0] + 1) < _MIN_INK_SIDE_PX:
            continue
        visible.append(code)

    # Smallest RMS distance between two characters over the reference fonts that draw both.
    position = {code: i for i, code in enumerate(visible)}
    nearest = np.full((len(visible), len(visible)), np.inf)
    for name in _REFERENCE_FONTS:
        codes = [code for code in visible if code in renders[name]]
        rows = np.asarray([position[code] for code in codes])
        flat = np.stack([renders[name][code].ravel() for code in codes]).astype(np.float64)
        sq = (flat * flat).sum(axis=1)
        dist2 = np.maximum(sq[:, None] + sq[None, :] - 2.0 * flat @ flat.T, 0.0)
        rms = np.sqrt(dist2 / flat.shape[1])
        block = nearest[np.ix_(rows, rows)]
        nearest[np.ix_(rows, rows)] = np.minimum(block, rms)
    kept: list[int] = []
    for i in range(len(visible)):
        if kept and nearest[i, kept].min() < _HOMOGLYPH_RMS:
            continue
        kept.append(i)
    chars = [chr(visible[i]) for i in kept]
    return chars, len(candidates), len(visible) - len(kept)


def build_catalogue(layout_seed: int = 0) -> GlyphCatalogue:
    """Choose the classes and split them into pools (deterministic for a given ``layout_seed`` and font set).

    Concepts are Latin base letters with >= MIN_CONCEPT_MEMBERS distinct forms. Fine-tuning takes each concept's
    plain letter, then further forms round-robin over concepts until FINETUNE_CLASSES; the test pool takes up to
    TEST_MEMBERS_PER_CONCEPT of the remaining forms per concept; everything else is shuffled into the pretrain order.
    The validation pool takes up to TEST_MEMBERS_PER_CONCEPT forms per concept among the shuffled characters left
    after the pretrain pool (the other pools are exactly as without it).
    """
    chars, considered, dropped = _distinct_characters()
    rng = np.random.default_rng([layout_seed, 0x67_6C_79])
    members: dict[str, list[str]] = {}
    for char in chars:
        base = _concept_of(char)
        if "A" <= base <= "Z" or "a" <= base <= "z":
            members.setdefault(base, []).append(char)
    concepts = sorted(base for base, forms in members.items() if len(forms) >= MIN_CONCEPT_MEMBERS and base in forms)
    if len(concepts) > FINETUNE_CLASSES:
        raise ValueError(f"glyphs: {len(concepts)} concepts exceed the {FINETUNE_CLASSES} fine-tuning classes")
    variants = {}
    for base in concepts:
        others = [char for char in members[base] if char != base]
        variants[base] = [others[i] for i in rng.permutation(len(others))]
    finetune = list(concepts)
    taken = {base: 0 for base in concepts}
    concept_order = [concepts[i] for i in rng.permutation(len(concepts))]
    while len(finetune) < FINETUNE_CLASSES:
        progressed = False
        for base in concept_order:
            # Keep at least one form of every concept for the test pool.
            if len(finetune) < FINETUNE_CLASSES and taken[base] < len(variants[base]) - 1:
                finetune.append(variants[base][taken[base]])
                taken[base] += 1
                progressed = True
        if not progressed:
            raise ValueError(f"glyphs: only {len(finetune)} fine-tuning classes available, need {FINETUNE_CLASSES}")
    test = []
    for base in concepts:
        test.extend(variants[base][taken[base]:taken[base] + TEST_MEMBERS_PER_CONCEPT])
    used = set(finetune) | set(test)
    rest = [char for char in chars if char not in used]
    shuffled = [rest[i] for i in rng.permutation(len(rest))]
    pretrain = shuffled[: PRETRAIN_POOL_SIZES[-1]]
    if len(pretrain) < PRETRAIN_POOL_SIZES[-1]:
        raise ValueError(
            f"glyphs: only {len(pretrain)} classes left for pre-training, need {PRETRAIN_POOL_SIZES[-1]}"
        )
    left_over = shuffled[PRETRAIN_POOL_SIZES[-1]:]
    val = [char for base in concepts
           for char in [c for c in left_over if _concept_of(c) == base][:TEST_MEMBERS_PER_CONCEPT]]
    ordered = pretrain + finetune + test + val
    coarse_names: list[str] = []
    coarse_index: dict[str, int] = {}
    coarse_of_class = []
    for char in ordered:
        key = _concept_of(char)
        if key not in coarse_index:
            coarse_index[key] = len(coarse_names)
            coarse_names.append(key)
        coarse_of_class.append(coarse_index[key])
    offsets = np.cumsum([0, len(pretrain), len(finetune), len(test), len(val)])
    pools = {
        "pretrain": np.arange(offsets[0], offsets[1], dtype=np.int64),
        "finetune": np.arange(offsets[1], offsets[2], dtype=np.int64),
        "test": np.arange(offsets[2], offsets[3], dtype=np.int64),
        "val": np.arange(offsets[3], offsets[4], dtype=np.int64),
    }
    fonts = {
        style.name: tuple(tuple(name for name in style.fonts if ord(char) in _charmap(name)) for char in ordered)
        for style in STYLES.values()
    }
    return GlyphCatalogue(
        chars=tuple(ordered),
        coarse_names=tuple(coarse_names),
        coarse_of_class=np.asarray(coarse_of_class, dtype=np.int64),
        pools=pools,
        fonts=fonts,
        candidates_considered=considered,
        homoglyphs_dropped=dropped,
    )


def _layout_key(layout_seed: int) -> str:
    text = json.dumps(
        {"version": GLYPHS_VERSION, "fonts": _font_fingerprint(), "layout_seed": layout_seed,
         "pools": [PRETRAIN_POOL_SIZES, FINETUNE_CLASSES, TEST_MEMBERS_PER_CONCEPT, MIN_CONCEPT_MEMBERS,
                   MIN_FONTS_PER_STYLE, _HOMOGLYPH_RMS, _MIN_INK_SIDE_PX, _MIN_INK_PIXELS]},
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


_CATALOGUES: dict[str, GlyphCatalogue] = {}


def glyph_catalogue(cache_dir: str | os.PathLike | None = None, layout_seed: int = 0) -> GlyphCatalogue:
    """The class catalogue: built once (a few seconds), kept in memory and as JSON next to the rendered pools."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    key = _layout_key(layout_seed)
    path = root / f"catalogue-{key}.json"
    catalogue = _CATALOGUES.get(key)
    if catalogue is None and path.is_file():
        try:
            catalogue = GlyphCatalogue.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except (ValueError, KeyError, TypeError) as error:
            warnings.warn(f"glyphs: ignoring unreadable catalogue {path} ({error}); rebuilding it", stacklevel=2)
    if catalogue is None:
        catalogue = build_catalogue(layout_seed)
    if not path.is_file():
        _atomic_write_bytes(path, json.dumps(catalogue.to_dict(), ensure_ascii=False).encode("utf-8"))
    # The key hashes the fonts, the rules and the code version, so one in-memory copy serves every cache root.
    _CATALOGUES[key] = catalogue
    return catalogue


def _atomic_write_bytes(path: Path, payload: bytes) -> None:
    # Several processes (tests, Ray workers) may render the same pool at once: write aside, then rename.
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(payload)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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


@dataclass
class GlyphSource(ArraySource):
    """An :class:`ArraySource` of rendered glyphs with rendering metadata per image.

    ``fine_labels`` are the global character class ids even when ``labels`` are coarse; ``instance_ids`` number the
    images of one class (0-based); ``font_ids`` index ``font_names``.
    """

    fine_labels: np.ndarray | None = None
    instance_ids: np.ndarray | None = None
    font_ids: np.ndarray | None = None
    font_names: tuple[str, ...] = ()
    coarse_names: list[str] = field(default_factory=list)
    pool: str = ""
    style: str = ""
    label_level: str = "fine"
    from_cache: bool = False
    render_seconds: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for attribute in ("fine_labels", "instance_ids", "font_ids"):
            value = getattr(self, attribute)
            if value is not None:
                value = np.asarray(value, dtype=np.int64)
                if value.shape != self.labels.shape:
                    raise ValueError(f"{self.name}: {attribute} must have shape {self.labels.shape}, got {value.shape}")
                setattr(self, attribute, value)

    def subset(self, indices: np.ndarray, name: str | None = None) -> "GlyphSource":
        """The samples at ``indices`` with their metadata (class ids, names and statistics unchanged)."""
        indices = np.asarray(indices, dtype=np.int64)

        def pick(values):
            return None if values is None else values[indices]

        return GlyphSource(
            name=name or self.name, images=self.images[indices], labels=self.labels[indices],
            class_names=self.class_names, coarse_labels=pick(self.coarse_labels), mean=self.mean, std=self.std,
            hflip=self.hflip, fine_labels=pick(self.fine_labels), instance_ids=pick(self.instance_ids),
            font_ids=pick(self.font_ids), font_names=self.font_names, coarse_names=self.coarse_names,
            pool=self.pool, style=self.style, label_level=self.label_level, from_cache=self.from_cache,
            render_seconds=self.render_seconds,
        )


def _check_positive_int(value, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"glyphs: {name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


@register_dataset(
    "glyphs",
    summary="offline many-class set: characters rendered with matplotlib's fonts, in disjoint class pools and two styles",
    splits=SPLITS,
    layout="nothing to provide: rendered from matplotlib/mpl-data/fonts/ttf and cached as .npz under root "
    "(default ~/.cache/compat/glyphs)",
    options={
        "style": "rendering style 'source' (clean DejaVu) or 'target' (shifted); default source for pretrain splits, "
        "target otherwise",
        "pool_size": "number of pretrain classes (a prefix of the nested pretrain order; pretrain split only)",
        "images_per_class": f"images rendered per class (default {DEFAULT_IMAGES_PER_CLASS})",
        "seed": "rendering seed (default 0)",
        "image_size": f"image side in pixels (default {DEFAULT_IMAGE_SIZE})",
        "label_level": "'fine' (labels = characters, default) or 'coarse' (labels = base letters)",
        "cache_dir": "folder of the rendered cache (overrides root)",
        "layout_seed": "seed of the class-to-pool assignment (default 0)",
    },
    generated=True,
)
def load_glyphs(
    root: str | os.PathLike | None = None,
    split: str = "finetune",
    style: str | None = None,
    pool_size: int | None = None,
    images_per_class: int = DEFAULT_IMAGES_PER_CLASS,
    seed: int = 0,
    image_size: int = DEFAULT_IMAGE_SIZE,
    label_level: str = "fine",
    cache_dir: str | os.PathLike | None = None,
    layout_seed: int = 0,
) -> GlyphSource:
    """Load (rendering and caching on first use) one split of the glyph set as uint8 ``(N, S, S, 1)`` images.

    split: ``pretrain`` (all 600 classes, or the first ``pool_size``), ``pretrain-1|2|3`` (first 100 / 300 / 600),
    ``finetune`` (100), ``test`` (open-set pool), ``test-query`` / ``test-gallery`` (odd / even instance ids of
    every test class: disjoint halves), ``val`` / ``val-query`` / ``val-gallery`` (the validation pool, halved the
    same way). style: ``source`` | ``target``; None picks ``source`` for pretrain splits
    and ``target`` otherwise. label_level: ``fine`` (labels = global character ids) or ``coarse`` (labels = base
    letter ids; ``fine_labels`` keeps the characters). root: same as ``cache_dir`` (the folder holding the rendered
    set); both None means ``~/.cache/compat/glyphs``. seed: rendering seed; layout_seed: pool assignment seed.
    mean/std are per (pool, style) over the whole rendered pool, so every split of a pool normalises alike.
    """
    if split not in _POOL_OF_SPLIT:
        raise ValueError(f"glyphs: unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    pool = _POOL_OF_SPLIT[split]
    style_name = style if style is not None else _DEFAULT_STYLE_OF_POOL[pool]
    if style_name not in STYLES:
        raise ValueError(f"glyphs: unknown style {style_name!r}; expected one of {', '.join(sorted(STYLES))}")
    if label_level not in ("fine", "coarse"):
        raise ValueError(f"glyphs: label_level must be 'fine' or 'coarse', got {label_level!r}")
    images_per_class = _check_positive_int(images_per_class, "images_per_class")
    seed = _check_positive_int(seed, "seed", minimum=0)
    layout_seed = _check_positive_int(layout_seed, "layout_seed", minimum=0)
    image_size = _check_positive_int(image_size, "image_size", minimum=16)
    if split.endswith(("-query", "-gallery")) and images_per_class < 2:
        raise ValueError(f"glyphs: split {split!r} halves each class; images_per_class must be >= 2")
    if pool_size is not None and pool != "pretrain":
        raise ValueError(f"glyphs: pool_size applies to pretrain splits only, got split {split!r}")
    cache_root = Path(cache_dir if cache_dir is not None else root if root is not None else default_cache_dir())
    cache_root = cache_root.expanduser()
    catalogue = glyph_catalogue(cache_root, layout_seed)
    style_spec = STYLES[style_name]
    rendered = _render_pool(catalogue, pool, style_spec, images_per_class, seed, image_size, cache_root, layout_seed)

    keep = None
    pool_ids = catalogue.pools[pool]
    if pool == "pretrain":
        if split != "pretrain":
            if pool_size is not None:
                raise ValueError(f"glyphs: give either split {split!r} or pool_size, not both")
            pool_size = PRETRAIN_POOL_SIZES[int(split[-1]) - 1]
        if pool_size is not None:
            pool_size = _check_positive_int(pool_size, "pool_size")
            if pool_size > len(pool_ids):
                raise ValueError(f"glyphs: pool_size {pool_size} exceeds the {len(pool_ids)} pretrain classes")
            # Prefixes of the fixed pretrain order: every smaller pool is nested in every larger one.
            keep = np.flatnonzero(np.isin(rendered.labels, pool_ids[:pool_size]))
    elif split in ("test-query", "val-query"):
        keep = np.flatnonzero(rendered.instance_ids % 2 == 1)
    elif split in ("test-gallery", "val-gallery"):
        keep = np.flatnonzero(rendered.instance_ids % 2 == 0)

    def pick(values: np.ndarray) -> np.ndarray:
        return values if keep is None else values[keep]

    fine = pick(rendered.labels)
    coarse = catalogue.coarse_of_class[fine]
    if label_level == "coarse":
        labels, class_names = coarse, list(catalogue.coarse_names)
    else:
        labels, class_names = fine, catalogue.class_names()
    return GlyphSource(
        name=f"glyphs/{split}/{style_name}",
        images=pick(rendered.images),
        labels=labels,
        class_names=class_names,
        coarse_labels=coarse,
        mean=rendered.mean,
        std=rendered.std,
        hflip=False,  # a mirrored character is another character (or none)
        fine_labels=fine,
        instance_ids=pick(rendered.instance_ids),
        font_ids=pick(rendered.font_ids),
        font_names=style_spec.fonts,
        coarse_names=list(catalogue.coarse_names),
        pool=pool,
        style=style_name,
        label_level=label_level,
        from_cache=rendered.from_cache,
        render_seconds=rendered.render_seconds,
    )


def glyph_set_summary(
    cache_dir: str | os.PathLike | None = None,
    images_per_class: int = DEFAULT_IMAGES_PER_CLASS,
    seed: int = 0,
    image_size: int = DEFAULT_IMAGE_SIZE,
    layout_seed: int = 0,
    styles: dict[str, str] | None = None,
) -> dict:
    """The glyph set's numbers for reports: classes and images per pool, disjointness, render seconds, cache bytes.

    Renders (or loads from the cache) each pool in ``styles`` (default: pretrain in ``source``, finetune and test
    in ``target``). ``render_seconds`` is the time the first render of each pool took (stored with the cache),
    ``load_seconds`` the time of this call's load (both in seconds). ``disjointness`` is measured on the loaded
    images' labels: ``fine_label_overlap`` / ``character_overlap`` count the classes (global ids) / characters that
    two pools share (0 for a valid set); ``pretrain_nested`` says whether the classes of ``pretrain-1`` are a subset
    of ``pretrain-2`` and those of ``pretrain-2`` of ``pretrain-3``; ``test_coarse_groups_covered_by_finetune`` counts
    the test pool's base letters that the fine-tuning pool also draws. Overlaps need all three pools in ``styles``.
    """
    cache_root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    styles = dict(styles or _DEFAULT_STYLE_OF_POOL)
    started = time.perf_counter()
    catalogue = glyph_catalogue(cache_root, layout_seed)
    catalogue_seconds = time.perf_counter() - started
    pools = {}
    loaded_classes: dict[str, np.ndarray] = {}
    for pool, style in styles.items():
        begin = time.perf_counter()
        source = load_glyphs(split=pool, style=style, images_per_class=images_per_class, seed=seed,
                             image_size=image_size, cache_dir=cache_root, layout_seed=layout_seed)
        pools[f"{pool}/{style}"] = {
            "classes": int(len(catalogue.pools[pool])),
            "coarse_groups": int(len(np.unique(source.coarse_labels))),
            "images": len(source),
            "render_seconds": round(source.render_seconds, 2),
            "load_seconds": round(time.perf_counter() - begin, 2),
            "from_cache": source.from_cache,
            "mean": source.mean,
            "std": source.std,
        }
        loaded_classes[pool] = np.unique(source.fine_labels)
    finetune_coarse = set(catalogue.coarse_of_class[catalogue.pools["finetune"]].tolist())
    test_coarse = set(catalogue.coarse_of_class[catalogue.pools["test"]].tolist())
    disjointness = _pool_disjointness(catalogue, loaded_classes, cache_root, images_per_class, seed, image_size,
                                      layout_seed, styles)
    render_key = {style: _render_key(layout_seed, images_per_class, seed, image_size, STYLES[style])
                  for style in set(styles.values())}
    cache_bytes = sum(path.stat().st_size for key in render_key.values() for path in (cache_root / key).glob("*.npz"))
    return {
        "classes_total": catalogue.num_classes,
        "pretrain_nested_pools": {f"pretrain-{i + 1}": size for i, size in enumerate(PRETRAIN_POOL_SIZES)},
        "finetune_classes": int(len(catalogue.pools["finetune"])),
        "test_classes": int(len(catalogue.pools["test"])),
        "test_coarse_groups": len(test_coarse),
        "test_coarse_groups_covered_by_finetune": len(test_coarse & finetune_coarse),
        "disjointness": disjointness,
        "images_per_class": images_per_class,
        "image_shape": (image_size, image_size, 1),
        "images_total": sum(entry["images"] for entry in pools.values()),
        "candidate_characters": catalogue.candidates_considered,
        "homoglyphs_dropped": catalogue.homoglyphs_dropped,
        "catalogue_seconds": round(catalogue_seconds, 2),
        "render_seconds_total": round(sum(entry["render_seconds"] for entry in pools.values()), 2),
        "cache_bytes": int(cache_bytes),
        "cache_dir": str(cache_root),
        "pools": pools,
    }


def _pool_disjointness(
    catalogue: GlyphCatalogue, loaded_classes: dict[str, np.ndarray], cache_root: Path, images_per_class: int,
    seed: int, image_size: int, layout_seed: int, styles: dict[str, str],
) -> dict:
    """Pairwise class and character overlaps of the loaded pools and the nesting of the pretrain sub-pools."""
    fine_overlap, char_overlap = {}, {}
    names = [pool for pool in ("pretrain", "finetune", "test", "val") if pool in loaded_classes]
    for position, first in enumerate(names):
        for second in names[position + 1:]:
            pair = f"{first}&{second}"
            fine_overlap[pair] = int(np.intersect1d(loaded_classes[first], loaded_classes[second]).size)
            chars_first = {catalogue.chars[i] for i in loaded_classes[first]}
            chars_second = {catalogue.chars[i] for i in loaded_classes[second]}
            char_overlap[pair] = len(chars_first & chars_second)
    nested: dict[str, bool] = {}
    if "pretrain" in styles:
        sub_pools = [
            set(np.unique(load_glyphs(split=f"pretrain-{level}", style=styles["pretrain"],
                                      images_per_class=images_per_class, seed=seed, image_size=image_size,
                                      cache_dir=cache_root, layout_seed=layout_seed).labels).tolist())
            for level in range(1, len(PRETRAIN_POOL_SIZES) + 1)
        ]
        for level in range(1, len(sub_pools)):
            nested[f"pretrain-{level} <= pretrain-{level + 1}"] = sub_pools[level - 1] <= sub_pools[level]
    return {"fine_label_overlap": fine_overlap, "character_overlap": char_overlap, "pretrain_nested": nested}


def format_glyph_summary(summary: dict) -> str:
    """The numbers of :func:`glyph_set_summary` as readable lines (counts, overlaps, nesting, seconds, bytes)."""
    disjointness = summary["disjointness"]
    lines = [
        f"glyph set: {summary['classes_total']} classes, {summary['images_total']} images of "
        f"{'x'.join(str(v) for v in summary['image_shape'])} ({summary['images_per_class']} per class)",
        f"candidate characters {summary['candidate_characters']}, homoglyphs dropped {summary['homoglyphs_dropped']}",
        "pools:",
    ]
    for name, entry in summary["pools"].items():
        lines.append(
            f"  {name:<16} {entry['classes']:>4} classes {entry['images']:>6} images  coarse groups "
            f"{entry['coarse_groups']:>3}  render {entry['render_seconds']:.2f} s  load {entry['load_seconds']:.2f} s"
            f"  {'(cache)' if entry['from_cache'] else '(rendered)'}"
        )
    lines.append("nested pretrain pools: " + ", ".join(
        f"{name} = {size} classes" for name, size in summary["pretrain_nested_pools"].items()))
    for check, holds in disjointness["pretrain_nested"].items():
        lines.append(f"  {check}: {'yes' if holds else 'NO'}")
    lines.append("overlap between pools (classes / characters; 0 = disjoint):")
    for pair, count in disjointness["fine_label_overlap"].items():
        lines.append(f"  {pair:<18} {count} / {disjointness['character_overlap'][pair]}")
    lines.append(
        f"test coarse groups covered by finetune: {summary['test_coarse_groups_covered_by_finetune']} of "
        f"{summary['test_coarse_groups']}"
    )
    lines.append(
        f"catalogue {summary['catalogue_seconds']:.2f} s, render total {summary['render_seconds_total']:.2f} s, "
        f"cache {summary['cache_bytes'] / 2**20:.1f} MiB in {summary['cache_dir']}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m compat_core.data.glyphs [CACHE_DIR] [--json]``: render (or load) the default set, print its numbers.

    Returns 0 when the pools are pairwise disjoint and the pretrain sub-pools nested, 1 otherwise.
    """
    import argparse

    parser = argparse.ArgumentParser(prog="python -m compat_core.data.glyphs", description=main.__doc__)
    parser.add_argument("cache_dir", nargs="?", default=None, help="cache folder (default ~/.cache/compat/glyphs)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON instead of text")
    args = parser.parse_args(argv)
    summary = glyph_set_summary(args.cache_dir)
    print(json.dumps(summary, indent=2, ensure_ascii=False) if args.json else format_glyph_summary(summary))
    disjointness = summary["disjointness"]
    valid = (not any(disjointness["fine_label_overlap"].values()) and not any(disjointness["character_overlap"].values())
             and all(disjointness["pretrain_nested"].values()))
    return 0 if valid else 1


if __name__ == "__main__":
    raise SystemExit(main())

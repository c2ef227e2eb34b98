"""The class catalogue of the glyph set: which characters are classes (eligible, drawn by enough fonts of every style,
no homoglyphs or specks), their concepts (base letters) and the pools they are split into (``pretrain`` in its nested
order, ``finetune``, ``test``, ``val``), cached as JSON under the glyph cache folder.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import unicodedata
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from compat_core.data.glyphs.fonts import _REFERENCE_FONTS, STYLES, _charmap, _font, _font_fingerprint

# Bump whenever rendering, the catalogue rules or the pool layout change: it is part of the cache key.
GLYPHS_VERSION = "3"

PRETRAIN_POOL_SIZES: tuple[int, ...] = (100, 300, 600)
FINETUNE_CLASSES = 100
TEST_MEMBERS_PER_CONCEPT = 4
# A concept needs at least one member for fine-tuning and one for test; 4 leaves room for variety in both.
MIN_CONCEPT_MEMBERS = 4
MIN_FONTS_PER_STYLE = 2
DEFAULT_IMAGE_SIZE = 32
# The held-out characters (in no training pool) are split by base letter between the validation and the test pool:
# a seeded permutation of the held-out base letters, the first VALIDATION_LETTER_SHARE of them (rounded down) for
# validation. The seed is [layout_seed, HELDOUT_SPLIT_SEED], recorded in the catalogue (``heldout_split``).
HELDOUT_SPLIT_SEED = 0x76_61_6C  # "val"
VALIDATION_LETTER_SHARE = 0.5

# Font size (pixels) of the reference renders.
_REFERENCE_SIZE = 24
# RMS difference (pixel values in [0, 1]) below which two centred reference renders count as the same glyph.
_HOMOGLYPH_RMS = 0.06
_MIN_INK_SIDE_PX = 7  # at the reference size: drops '.', ',', '·' that differ only by position
_MIN_INK_PIXELS = 15.0

_ALLOWED_CATEGORIES = frozenset({"Lu", "Ll", "Lt", "Lo", "Nd", "No", "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po",
                                 "Sm", "Sc", "So"})


def default_cache_dir() -> Path:
    """``~/.cache/compat/glyphs`` (``XDG_CACHE_HOME`` respected)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "compat" / "glyphs"


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
    heldout_split: dict = field(default_factory=dict)

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
            "heldout_split": self.heldout_split,
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
            heldout_split=dict(data["heldout_split"]),
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


def _coarse_labels(ordered: list[str]) -> tuple[list[str], list[int]]:
    """(coarse names in order of first appearance, each class's coarse index) of the characters ``ordered``: a
    character's coarse label is its base letter."""
    coarse_names: list[str] = []
    coarse_index: dict[str, int] = {}
    coarse_of_class = []
    for char in ordered:
        key = _concept_of(char)
        if key not in coarse_index:
            coarse_index[key] = len(coarse_names)
            coarse_names.append(key)
        coarse_of_class.append(coarse_index[key])
    return coarse_names, coarse_of_class


def build_catalogue(layout_seed: int = 0) -> GlyphCatalogue:
    """Choose the classes and split them into pools (deterministic for a given ``layout_seed`` and font set).

    Concepts are Latin base letters with >= MIN_CONCEPT_MEMBERS distinct forms. Fine-tuning takes each concept's
    plain letter, then further forms round-robin over concepts until FINETUNE_CLASSES; up to
    TEST_MEMBERS_PER_CONCEPT of the remaining forms per concept are held out; everything else is shuffled into the
    pretrain order, and up to TEST_MEMBERS_PER_CONCEPT more forms per concept among the shuffled characters left
    after the pretrain pool are held out too. The held-out characters (in no training pool) are split by base letter
    into the validation and the test pool (:func:`split_held_out`), so both are drawn from one distribution and
    never share a base letter.
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
    held_out = {base: variants[base][taken[base]:taken[base] + TEST_MEMBERS_PER_CONCEPT] for base in concepts}
    used = set(finetune) | {char for forms in held_out.values() for char in forms}
    rest = [char for char in chars if char not in used]
    shuffled = [rest[i] for i in rng.permutation(len(rest))]
    pretrain = shuffled[: PRETRAIN_POOL_SIZES[-1]]
    if len(pretrain) < PRETRAIN_POOL_SIZES[-1]:
        raise ValueError(
            f"glyphs: only {len(pretrain)} classes left for pre-training, need {PRETRAIN_POOL_SIZES[-1]}"
        )
    left_over = shuffled[PRETRAIN_POOL_SIZES[-1]:]
    for base in concepts:
        held_out[base] = held_out[base] + [c for c in left_over if _concept_of(c) == base][:TEST_MEMBERS_PER_CONCEPT]
    split_seed = [layout_seed, HELDOUT_SPLIT_SEED]
    val, test = split_held_out(held_out, split_seed)
    ordered = pretrain + finetune + test + val
    coarse_names, coarse_of_class = _coarse_labels(ordered)
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
        heldout_split={"seed": split_seed, "validation_letter_share": VALIDATION_LETTER_SHARE,
                       "validation_letters": sorted({_concept_of(c) for c in val}),
                       "test_letters": sorted({_concept_of(c) for c in test})},
    )


def split_held_out(held_out: dict[str, list[str]], seed) -> tuple[list[str], list[str]]:
    """(validation characters, test characters) of the held-out characters ``held_out`` (base letter -> its forms).

    Whole base letters go to one side: a permutation of the letters (sorted, then shuffled by
    ``numpy.random.default_rng(seed)``) gives its first ``floor(VALIDATION_LETTER_SHARE * letters)`` letters to
    validation and the others to test, so the two pools are disjoint by base letter, every held-out character is in
    exactly one, and both are a random draw from the same letters. Letters without forms are ignored; each side
    lists its letters' forms in sorted letter order, forms in the given order.
    """
    letters = sorted(base for base, forms in held_out.items() if forms)
    order = np.random.default_rng(seed).permutation(len(letters))
    count = int(VALIDATION_LETTER_SHARE * len(letters))
    val_letters = {letters[i] for i in order[:count]}
    val = [char for base in letters if base in val_letters for char in held_out[base]]
    test = [char for base in letters if base not in val_letters for char in held_out[base]]
    return val, test


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

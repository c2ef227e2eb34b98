"""The offline many-class data set: characters rendered with the TrueType fonts that matplotlib installs.

A class is one Unicode character (code point). Its images are drawn by every font of a rendering *style* whose
character map covers it, with seeded variations of font, size, position, rotation, stroke, blur, contrast, texture
and noise. Nothing is downloaded: the fonts ship inside matplotlib (``matplotlib/mpl-data/fonts/ttf``).

Class pools mirror the roles in the papers (IAM-CL2R: ImageNet32 -> CIFAR100 -> CIFAR10):

- ``pretrain``: classes for third-party models, a fixed seeded order so that every prefix is a nested pool;
  ``pretrain-1`` / ``-2`` / ``-3`` are the first 100 / 300 / 600 classes (the ImageNet32 pool sizes of IAM-CL2R).
- ``finetune``: 100 classes (the demo's 10 + 6x15): for every *concept* (a Latin base letter with enough
  accented variants) the plain letter plus further variants, e.g. ``u``, ``ü``.
- ``test``: the open-set pool for query/gallery: other variants of the fine-tuning base letters, e.g. ``ú``, ``ű``.
  Fine labels are disjoint from every training pool; the coarse label (base letter, by Unicode canonical
  decomposition, case kept) is shared with fine-tuning classes, as CIFAR10's ``truck`` is covered by CIFAR100's
  ``pickup truck``. Evaluate it with ``label_level="coarse"``.
- ``val``: the validation pool. The held-out characters (accented forms in no training pool) are split at random
  by base letter, half the letters each (seeded, recorded in the catalogue's ``heldout_split``), into ``val`` and
  ``test``: the two pools never share a character or a base letter and are drawn from one distribution, so
  selecting a setting on ``val-query`` / ``val-gallery`` sees neither a test image nor a test class nor a test
  coarse label nor a trained class.

Styles: ``source`` (clean DejaVu Sans/Serif, for pre-training) and ``target`` (STIX, DejaVu Sans Mono and Computer
Modern, stroke, blur, lower contrast, background texture and noise, for fine-tuning and test). Any pool can be
rendered in either style; by default ``pretrain`` uses ``source`` and the others ``target``.

Labels are *global* class ids of the whole glyph set (pretrain pool first, then finetune, test, val), so labels of
different pools never collide and :func:`compat_core.data.tasks.check_open_set` works on them directly.

Rendered pools are cached as ``.npz`` under ``~/.cache/compat/glyphs/<key>/`` where ``<key>`` hashes the rendering
parameters, the code version, the font files and the Pillow/FreeType versions; ``cache_dir`` overrides the root.

This module owns the dataset entry (``load_glyphs``, registered as ``glyphs``), its splits and the summary of the
set; the fonts and styles are in :mod:`compat_core.data.glyphs.fonts`, the class catalogue and its pools in
:mod:`compat_core.data.glyphs.catalogue`, rendering and the rendered-pool cache in :mod:`compat_core.data.glyphs.render`.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from compat_core.data.source import ArraySource
from compat_core.data.datasets import register_dataset
from compat_core.data.glyphs.catalogue import (
    DEFAULT_IMAGE_SIZE,
    PRETRAIN_POOL_SIZES,
    GlyphCatalogue,
    default_cache_dir,
    glyph_catalogue,
)
from compat_core.data.glyphs.fonts import STYLES
from compat_core.data.glyphs.render import _render_key, _render_pool
from compat_core.data.tasks import select_class_samples

DEFAULT_IMAGES_PER_CLASS = 48

SPLITS = ("finetune", "pretrain", "pretrain-1", "pretrain-2", "pretrain-3", "test", "test-query", "test-gallery",
          "val", "val-query", "val-gallery")
_POOL_OF_SPLIT = {"pretrain": "pretrain", "pretrain-1": "pretrain", "pretrain-2": "pretrain",
                  "pretrain-3": "pretrain", "finetune": "finetune", "test": "test", "test-query": "test",
                  "test-gallery": "test", "val": "val", "val-query": "val", "val-gallery": "val"}
_DEFAULT_STYLE_OF_POOL = {"pretrain": "source", "finetune": "target", "test": "target", "val": "target"}


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
    pool, style_name = _check_split_and_style(split, style, label_level)
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
    keep = _split_rows(split, pool, pool_size, catalogue.pools[pool], rendered)

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


def _check_split_and_style(split: str, style: str | None, label_level: str) -> tuple[str, str]:
    """(pool, style name) of a split; ValueError naming the valid splits, styles or label levels."""
    if split not in _POOL_OF_SPLIT:
        raise ValueError(f"glyphs: unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    pool = _POOL_OF_SPLIT[split]
    style_name = style if style is not None else _DEFAULT_STYLE_OF_POOL[pool]
    if style_name not in STYLES:
        raise ValueError(f"glyphs: unknown style {style_name!r}; expected one of {', '.join(sorted(STYLES))}")
    if label_level not in ("fine", "coarse"):
        raise ValueError(f"glyphs: label_level must be 'fine' or 'coarse', got {label_level!r}")
    return pool, style_name


def _split_rows(split: str, pool: str, pool_size: int | None, pool_ids, rendered) -> np.ndarray | None:
    """Rows of the rendered pool that the split keeps (None: all): a prefix of the pretrain classes, or the odd /
    even instances of every class for the query / gallery halves."""
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
            return select_class_samples(rendered.labels, pool_ids[:pool_size])
    elif split in ("test-query", "val-query"):
        return np.flatnonzero(rendered.instance_ids % 2 == 1)
    elif split in ("test-gallery", "val-gallery"):
        return np.flatnonzero(rendered.instance_ids % 2 == 0)
    return None


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
    """``python -m compat_core.data.glyphs.dataset [CACHE_DIR] [--json]``: render (or load) the default set, print its numbers.

    Returns 0 when the pools are pairwise disjoint and the pretrain sub-pools nested, 1 otherwise.
    """
    import argparse

    parser = argparse.ArgumentParser(prog="python -m compat_core.data.glyphs.dataset", description=main.__doc__)
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

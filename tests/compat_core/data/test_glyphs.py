"""The glyph set: size and disjointness numbers, nested pools, shared coarse concepts, determinism, cache, styles."""
from __future__ import annotations

import json
import unicodedata

import numpy as np
import pytest

from compat_core.data.glyphs import dataset as glyphs
from compat_core.data.glyphs import render as glyph_render
from compat_core.data.glyphs.catalogue import (
    DEFAULT_IMAGE_SIZE,
    HELDOUT_SPLIT_SEED,
    TEST_MEMBERS_PER_CONCEPT,
    build_catalogue,
    glyph_catalogue,
    split_held_out,
)
from compat_core.data.glyphs.dataset import glyph_set_summary, load_glyphs
from compat_core.data.glyphs.fonts import STYLES
from compat_core.data.tasks import check_open_set

SMALL = 4  # images per class for the cheap renders


@pytest.fixture(scope="module")
def full_set(tmp_path_factory):
    """The full default set rendered once into a fresh cache (pretrain/source, finetune + test + val/target)."""
    cache = tmp_path_factory.mktemp("glyph-cache")
    summary = glyph_set_summary(cache_dir=cache)
    print("\n" + glyphs.format_glyph_summary(summary))
    return cache, summary


@pytest.fixture
def renderer_forbidden(monkeypatch):
    """Makes any call of the glyph renderer fail, so a load that succeeds must have come from the cache."""

    def refuse(*args, **kwargs):
        raise AssertionError("render_class was called: the pool was not served from the cache")

    monkeypatch.setattr(glyph_render, "render_class", refuse)


def _char_of(source, label: int) -> str:
    return source.class_names[label].split(" U+")[0]


def test_full_set_size(full_set):
    cache, summary = full_set
    pools = {split: load_glyphs(split=split, cache_dir=cache) for split in ("pretrain", "finetune", "test", "val")}
    classes = {split: np.unique(source.fine_labels) for split, source in pools.items()}
    total_classes = sum(ids.size for ids in classes.values())
    assert total_classes >= 700
    assert summary["classes_total"] == total_classes
    assert classes["finetune"].size >= 100
    for split, source in pools.items():
        assert source.images.dtype == np.uint8 and source.images.shape[1:] == (32, 32, 1), split
        counts = np.bincount(source.fine_labels)[classes[split]]
        assert counts.min() >= 32, split
    assert summary["images_total"] == sum(len(source) for source in pools.values())
    for split, source in pools.items():
        entry = summary["pools"][f"{split}/{source.style}"]
        assert entry["images"] == len(source) and entry["classes"] == classes[split].size, split
    # The fixture's cache folder was fresh, so the summary must have rendered every pool itself.
    assert [entry["from_cache"] for entry in summary["pools"].values()] == [False, False, False, False]


def test_pools_disjoint_nested_and_concepts_shared(full_set):
    cache, summary = full_set
    nested = [load_glyphs(split=f"pretrain-{level}", cache_dir=cache) for level in (1, 2, 3)]
    nested_classes = [set(np.unique(source.labels).tolist()) for source in nested]
    assert [len(classes) for classes in nested_classes] == [100, 300, 600]
    assert nested_classes[0] < nested_classes[1] < nested_classes[2]
    by_size = load_glyphs(split="pretrain", pool_size=300, cache_dir=cache)
    assert set(np.unique(by_size.labels).tolist()) == nested_classes[1]

    finetune = load_glyphs(split="finetune", cache_dir=cache)
    test = load_glyphs(split="test", cache_dir=cache)
    pretrain_ids = np.asarray(sorted(nested_classes[2]))
    finetune_ids, test_ids = np.unique(finetune.labels), np.unique(test.labels)
    for a, b in ((pretrain_ids, finetune_ids), (pretrain_ids, test_ids), (finetune_ids, test_ids)):
        assert np.intersect1d(a, b).size == 0
        check_open_set(a, b)  # the guard agrees
    # Characters (not just ids) are distinct across pools.
    finetune_chars = {_char_of(finetune, c) for c in finetune_ids}
    test_chars = {_char_of(test, c) for c in test_ids}
    pretrain_chars = {_char_of(finetune, c) for c in pretrain_ids}
    assert not (finetune_chars & test_chars) and not (pretrain_chars & test_chars)
    assert not (pretrain_chars & finetune_chars)
    # Every test character is an accented form of a base letter that the fine-tuning pool also draws.
    base = lambda char: unicodedata.normalize("NFD", char)[0]  # noqa: E731
    finetune_bases = {base(char) for char in finetune_chars}
    for char in test_chars:
        assert base(char) in finetune_bases, char
        assert base(char).isascii() and base(char).isalpha(), char
    assert len({base(char) for char in test_chars}) >= 10
    # The summary reports the same facts (counts recomputed here from the loaded pools).
    disjointness = summary["disjointness"]
    no_overlap = {"pretrain&finetune": 0, "pretrain&test": 0, "pretrain&val": 0, "finetune&test": 0,
                  "finetune&val": 0, "test&val": 0}
    assert disjointness["fine_label_overlap"] == no_overlap
    assert disjointness["character_overlap"] == no_overlap
    assert disjointness["pretrain_nested"] == {"pretrain-1 <= pretrain-2": True, "pretrain-2 <= pretrain-3": True}
    test_bases = {base(char) for char in test_chars}
    assert summary["test_coarse_groups"] == len(test_bases)
    assert summary["test_coarse_groups_covered_by_finetune"] == len(test_bases & finetune_bases) == len(test_bases)
    # The coarse labels are those base letters.
    for label, coarse in zip(test.fine_labels[::7], test.coarse_labels[::7]):
        assert test.coarse_names[coarse] == base(_char_of(test, label))


def test_validation_pool_shares_nothing_with_test_or_training(full_set):
    """The test pool is open-set by class (no test character is trained on) and split into query / gallery by
    instance; the validation pool must be the same kind of pool without touching it: its own characters (none in
    test, pretrain or finetune) and its own base letters (none a test letter), base letters that fine-tuning draws
    (coarse labels as in test), target style, and query / gallery halves of its own rendered instances."""
    cache, _ = full_set
    split_of = {split: load_glyphs(split=split, cache_dir=cache)
                for split in ("pretrain", "finetune", "test", "val", "val-query", "val-gallery", "test-query")}
    val, query, gallery = split_of["val"], split_of["val-query"], split_of["val-gallery"]
    val_ids = np.unique(val.fine_labels)
    val_chars = {_char_of(val, c) for c in val_ids}
    assert val_ids.size >= 40 and val.style == "target"
    for other in ("pretrain", "finetune", "test"):
        other_ids = np.unique(split_of[other].fine_labels)
        assert np.intersect1d(val_ids, other_ids).size == 0, other
        assert not val_chars & {_char_of(val, c) for c in other_ids}, other
        check_open_set(other_ids, val_ids)
    # No validation image is a test image: different classes, so no rendered image is shared either.
    assert not set(np.unique(split_of["test-query"].fine_labels).tolist()) & set(val_ids.tolist())
    base = lambda char: unicodedata.normalize("NFD", char)[0]  # noqa: E731
    finetune_bases = {base(_char_of(val, c)) for c in np.unique(split_of["finetune"].fine_labels)}
    val_bases = {base(char) for char in val_chars}
    test_bases = {base(_char_of(val, c)) for c in np.unique(split_of["test"].fine_labels)}
    assert val_bases <= finetune_bases and len(val_bases) >= 10
    assert not val_bases & test_bases  # disjoint by base letter, so validation never sees a test coarse label
    # 38 held-out letters split in half: 19 each; every letter holds up to 2 x TEST_MEMBERS_PER_CONCEPT forms
    assert (len(val_bases), len(test_bases)) == (19, 19)
    counts = {char: sum(base(c) == char for c in val_chars) for char in val_bases}
    assert max(counts.values()) <= 2 * TEST_MEMBERS_PER_CONCEPT
    # Query / gallery: odd / even instances of every validation class, together the whole pool.
    assert len(query) + len(gallery) == len(val)
    assert set(query.instance_ids % 2) == {1} and set(gallery.instance_ids % 2) == {0}
    np.testing.assert_array_equal(np.unique(query.fine_labels), val_ids)
    np.testing.assert_array_equal(np.unique(gallery.fine_labels), val_ids)
    assert query.mean == val.mean and gallery.std == val.std


def test_held_out_split_by_letter_on_a_hand_worked_fixture():
    """Five held-out letters with 2 + 1 + 3 + 1 + 0 forms: two letters (floor of half the four with forms) go to
    validation, the other two to test; every form lands on exactly one side, with its whole letter."""
    held_out = {"a": ["á", "à"], "b": ["ḃ"], "c": ["ç", "ć", "ĉ"], "d": ["ď"], "e": []}
    val, test = split_held_out(held_out, [0, HELDOUT_SPLIT_SEED])
    base = lambda char: unicodedata.normalize("NFD", char)[0]  # noqa: E731
    val_letters, test_letters = {base(c) for c in val}, {base(c) for c in test}
    assert len(val_letters) == 2 and len(test_letters) == 2 and not val_letters & test_letters
    assert sorted(val + test) == sorted(["á", "à", "ḃ", "ç", "ć", "ĉ", "ď"])  # each form exactly once
    assert len(val) == sum(len(held_out[letter]) for letter in val_letters)
    # the permutation of the sorted letters a, b, c, d by default_rng([0, seed]), its first two to validation
    order = np.random.default_rng([0, HELDOUT_SPLIT_SEED]).permutation(4)
    assert val_letters == {"abcd"[i] for i in order[:2]}
    # stable: the same seed gives the same split, whatever the dict order; another seed may differ
    assert split_held_out(dict(reversed(list(held_out.items()))), [0, HELDOUT_SPLIT_SEED]) == (val, test)
    splits = {tuple(split_held_out(held_out, [seed, HELDOUT_SPLIT_SEED])[0]) for seed in range(8)}
    assert len(splits) > 1


def test_held_out_characters_split_between_validation_and_test(full_set):
    """The catalogue's validation and test pools: together the 190 held-out characters of the default layout
    (38 letters), each in exactly one pool, disjoint by letter, the seed and letters recorded,
    the same on a rebuild."""
    cache, _ = full_set
    catalogue = glyph_catalogue(cache)
    val_chars = [catalogue.chars[i] for i in catalogue.pools["val"]]
    test_chars = [catalogue.chars[i] for i in catalogue.pools["test"]]
    assert len(val_chars) + len(test_chars) == 190 and not set(val_chars) & set(test_chars)
    base = lambda char: unicodedata.normalize("NFD", char)[0]  # noqa: E731
    split = catalogue.heldout_split
    assert split["seed"] == [0, HELDOUT_SPLIT_SEED]
    assert split["validation_letters"] == sorted({base(c) for c in val_chars})
    assert split["test_letters"] == sorted({base(c) for c in test_chars})
    assert len(split["validation_letters"]) == len(split["test_letters"]) == 19
    assert not set(split["validation_letters"]) & set(split["test_letters"])
    rebuilt = build_catalogue(0)
    assert rebuilt.heldout_split == split
    np.testing.assert_array_equal(rebuilt.pools["val"], catalogue.pools["val"])
    np.testing.assert_array_equal(rebuilt.pools["test"], catalogue.pools["test"])


def test_second_load_hits_the_cache(full_set, renderer_forbidden, tmp_path):
    cache, summary = full_set
    again = load_glyphs(split="pretrain", cache_dir=cache)  # would raise if it rendered
    assert again.from_cache
    assert len(again) == summary["pools"]["pretrain/source"]["images"]
    assert summary["cache_bytes"] == sum(p.stat().st_size for p in cache.rglob("*.npz"))
    # The guard is live: a pool missing from the cache does reach the (forbidden) renderer.
    with pytest.raises(AssertionError, match="render_class was called"):
        load_glyphs(split="finetune", images_per_class=SMALL, cache_dir=tmp_path)


def test_summary_counts_overlaps_and_nesting_of_given_pools(full_set):
    cache, _ = full_set
    catalogue = glyph_catalogue(cache)
    # Hand-made pools: class 2 in pretrain and finetune, classes 3 and 4 in finetune and test.
    loaded = {"pretrain": np.array([0, 1, 2]), "finetune": np.array([2, 3, 4]), "test": np.array([3, 4, 5])}
    result = glyphs._pool_disjointness(catalogue, loaded, cache, glyphs.DEFAULT_IMAGES_PER_CLASS, 0,
                                       DEFAULT_IMAGE_SIZE, 0, styles={"finetune": "target"})
    assert result["fine_label_overlap"] == {"pretrain&finetune": 1, "pretrain&test": 0, "finetune&test": 2}
    assert result["character_overlap"] == {"pretrain&finetune": 1, "pretrain&test": 0, "finetune&test": 2}
    assert result["pretrain_nested"] == {}  # no pretrain style asked for: nothing loaded, nothing claimed


def test_module_entry_point_prints_the_numbers(full_set, renderer_forbidden, capsys):
    cache, summary = full_set
    assert glyphs.main([str(cache)]) == 0
    text = capsys.readouterr().out
    assert f"glyph set: {summary['classes_total']} classes, {summary['images_total']} images" in text
    assert "pretrain&finetune  0 / 0" in text and "finetune&test      0 / 0" in text
    assert "pretrain-1 <= pretrain-2: yes" in text and "pretrain-2 <= pretrain-3: yes" in text
    covered = summary["test_coarse_groups_covered_by_finetune"]
    assert f"test coarse groups covered by finetune: {covered} of {summary['test_coarse_groups']}" in text
    assert glyphs.main([str(cache), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["classes_total"] == summary["classes_total"]
    assert printed["disjointness"]["fine_label_overlap"] == summary["disjointness"]["fine_label_overlap"]


def test_catalogue_is_deterministic(full_set):
    cache, _ = full_set
    cached = json.loads(next(cache.glob("catalogue-*.json")).read_text(encoding="utf-8"))
    assert build_catalogue().to_dict() == cached


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    first = load_glyphs(split="finetune", images_per_class=SMALL, cache_dir=tmp_path / "a")
    second = load_glyphs(split="finetune", images_per_class=SMALL, cache_dir=tmp_path / "b")
    other = load_glyphs(split="finetune", images_per_class=SMALL, seed=1, cache_dir=tmp_path / "c")
    assert not first.from_cache and not second.from_cache
    assert first.images.tobytes() == second.images.tobytes()
    np.testing.assert_array_equal(first.labels, second.labels)
    assert first.images.tobytes() != other.images.tobytes()
    np.testing.assert_array_equal(first.labels, other.labels)


def test_statistics_and_labels_of_a_split(tmp_path):
    source = load_glyphs(split="finetune", images_per_class=SMALL, cache_dir=tmp_path)
    pixels = source.images.astype(np.float64) / 255.0
    assert source.mean == pytest.approx((pixels.mean(),), abs=1e-12)
    assert source.std == pytest.approx((pixels.std(),), abs=1e-12)
    assert source.hflip is False and source.image_shape == (32, 32, 1)
    assert np.bincount(source.instance_ids).tolist() == [100] * SMALL


def test_query_gallery_halves_and_coarse_level(tmp_path):
    test = load_glyphs(split="test", images_per_class=SMALL, cache_dir=tmp_path)
    query = load_glyphs(split="test-query", images_per_class=SMALL, cache_dir=tmp_path)
    gallery = load_glyphs(split="test-gallery", images_per_class=SMALL, cache_dir=tmp_path, label_level="coarse")
    assert len(query) + len(gallery) == len(test)
    assert set(query.instance_ids.tolist()) == {1, 3} and set(gallery.instance_ids.tolist()) == {0, 2}
    assert query.mean == test.mean and gallery.std == test.std
    # Coarse level: labels are base-letter ids, the characters stay in fine_labels.
    np.testing.assert_array_equal(gallery.labels, gallery.coarse_labels)
    for label, fine in zip(gallery.labels[::5], gallery.fine_labels[::5]):
        char = test.class_names[fine].split(" U+")[0]
        assert gallery.class_names[label] == unicodedata.normalize("NFD", char)[0]


def test_styles_differ_measurably(tmp_path):
    source = load_glyphs(split="finetune", style="source", images_per_class=SMALL, cache_dir=tmp_path)
    target = load_glyphs(split="finetune", style="target", images_per_class=SMALL, cache_dir=tmp_path)
    np.testing.assert_array_equal(source.labels, target.labels)
    used_source = {source.font_names[i] for i in np.unique(source.font_ids)}
    used_target = {target.font_names[i] for i in np.unique(target.font_ids)}
    assert used_source and used_target and not (used_source & used_target)
    assert any(name.startswith("STIX") for name in used_target) and any("Mono" in n for n in used_target)

    def corner_noise(images):  # pixel std in the four 4x4 corners, where glyph ink rarely reaches
        img = images[..., 0].astype(np.float64)
        corners = np.concatenate([img[:, :4, :4], img[:, :4, -4:], img[:, -4:, :4], img[:, -4:, -4:]], axis=1)
        return corners.reshape(len(img), -1).std(axis=1).mean()

    def contrast(images):  # brightest ink minus background, in [0, 255] units
        flat = images[..., 0].reshape(len(images), -1).astype(np.float64)
        return (np.percentile(flat, 99, axis=1) - np.median(flat, axis=1)).mean()

    assert corner_noise(target.images) > 2.0 * corner_noise(source.images)
    assert contrast(source.images) > contrast(target.images) + 0.15 * 255
    assert np.median(target.images) > np.median(source.images) + 10


def test_input_errors_name_the_option(tmp_path):
    with pytest.raises(ValueError, match="unknown split 'train'"):
        load_glyphs(split="train", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown style 'fancy'"):
        load_glyphs(split="finetune", style="fancy", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="pool_size applies to pretrain"):
        load_glyphs(split="finetune", pool_size=10, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="label_level"):
        load_glyphs(split="test", label_level="medium", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="images_per_class must be an integer >= 1"):
        load_glyphs(split="test", images_per_class=0, cache_dir=tmp_path)


def test_registered_in_the_dataset_registry(tmp_path):
    from compat_core.data import load_dataset

    source = load_dataset("glyphs", split="pretrain", pool_size=20, images_per_class=2, cache_dir=tmp_path)
    assert np.unique(source.labels).tolist() == list(range(20))
    assert source.style == "source"
    assert STYLES["source"].fonts[0] == "DejaVuSans.ttf"

"""Dataset registry behaviour, Fashion-MNIST IDX files, scikit-learn digits, RecordIO without an identity table."""
import gzip
import struct

import fixtures_published as fx
import numpy as np
import pytest

from compat_core.data import dataset_info, dataset_names, load_dataset
from compat_core.data.source import ImageSource
from compat_core.data.datasets import _call_plain_factory

EXPECTED_NAMES = {"cifar10", "cifar100", "cifar100r", "tinyimagenet200", "tinyimagenet20", "cub200", "cub180", "cub20",
                  "imagenet32", "casia_webface", "celeba", "lfw", "fashion_mnist", "digits"}


def test_registry_lists_every_reader_and_rejects_unknowns():
    assert EXPECTED_NAMES <= set(dataset_names())
    with pytest.raises(KeyError, match=r"unknown dataset 'cifar1000'; valid dataset names: .*cifar100r"):
        load_dataset("cifar1000")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['sizes'\]; valid options: seed, test_fraction"):
        load_dataset("digits", sizes=3)
    with pytest.raises(ValueError, match=r"unknown split 'val'; valid splits: train, test, all"):
        load_dataset("digits", split="val")
    with pytest.raises(FileNotFoundError, match=r"celeba: no data root given \(nothing is downloaded\).*identity_CelebA.txt"):
        load_dataset("celeba")
    info = dataset_info("lfw")
    assert info.splits == ("pairs",) and "10\\t300" in info.layout and "image_size" in info.options
    assert dataset_info("fashion_mnist").default_root == "/usr/share/datasets/fashion-mnist"


def test_plain_factories_get_root_only_when_they_take_it():
    calls = []

    def no_root(split="finetune", style=None):
        calls.append((split, style))
        return "ok"

    assert _call_plain_factory(no_root, None, None, {"style": "target"}) == "ok"
    assert _call_plain_factory(no_root, None, "test", {}) == "ok"
    assert calls == [("finetune", "target"), ("test", None)]
    with pytest.raises(TypeError):
        _call_plain_factory(no_root, "/data", "test", {})


def test_fashion_mnist_idx_gzip_and_raw(tmp_path):
    rng = np.random.default_rng(0)
    train = (rng.integers(0, 256, (3, 28, 28), dtype=np.uint8), np.array([9, 0, 3], np.uint8))
    test = (rng.integers(0, 256, (2, 28, 28), dtype=np.uint8), np.array([1, 2], np.uint8))
    fx.write_fashion_mnist(tmp_path / "gz", train, test, gzipped=True)
    fx.write_fashion_mnist(tmp_path / "raw", train, test, gzipped=False)
    header = gzip.decompress((tmp_path / "gz" / "train-images-idx3-ubyte.gz").read_bytes())[:16]
    assert header == bytes.fromhex("00000803 00000003 0000001c 0000001c")  # magic 2051, 3 images, 28 x 28
    for folder in ("gz", "raw"):
        source = load_dataset("fashion_mnist", root=str(tmp_path / folder))
        assert isinstance(source, ImageSource) and source.image_shape == (28, 28, 1) and source.hflip
        np.testing.assert_array_equal(source.read(np.arange(3))[..., 0], train[0])
        assert source.labels.tolist() == [9, 0, 3] and source.class_names[9] == "Ankle boot"
        assert source.mean == (0.2860,) and source.std == (0.3530,)
    assert load_dataset("fashion_mnist", root=str(tmp_path / "raw"), split="test").labels.tolist() == [1, 2]


def test_fashion_mnist_wrong_magic_and_size(tmp_path):
    images, labels = np.zeros((2, 28, 28), np.uint8), np.zeros(2, np.uint8)
    fx.write_fashion_mnist(tmp_path, (images, labels), (images, labels), gzipped=False)
    path = tmp_path / "train-labels-idx1-ubyte"
    path.write_bytes(struct.pack(">II", 0x00000803, 2) + b"\x00\x00")
    with pytest.raises(ValueError, match=r"train-labels-idx1-ubyte has magic 0x00000803, expected 0x00000801"):
        load_dataset("fashion_mnist", root=str(tmp_path))
    path.write_bytes(struct.pack(">II", 0x00000801, 5) + b"\x00\x00")
    with pytest.raises(ValueError, match=r"header announces shape \(5,\) \(5 bytes\), found 2"):
        load_dataset("fashion_mnist", root=str(tmp_path))
    path.unlink()
    with pytest.raises(FileNotFoundError, match=r"train-labels-idx1-ubyte\(\.gz\); expected .*0x00000801"):
        load_dataset("fashion_mnist", root=str(tmp_path))


def test_digits_scaling_and_seeded_stratified_split():
    from sklearn.datasets import load_digits

    raw = load_digits()
    every = load_dataset("digits", split="all")
    assert len(every) == 1797 and every.image_shape == (8, 8, 1) and every.hflip is False
    # sklearn's first digit starts with the row 0 0 5 13 9 1 0 0 (values 0..16); scaled by 255/16 and rounded:
    # 5 -> 79.7 -> 80, 13 -> 207.2 -> 207, 9 -> 143.4 -> 143, 1 -> 15.9 -> 16
    assert raw.images[0, 0].tolist() == [0, 0, 5, 13, 9, 1, 0, 0]
    assert every.read([0])[0, 0, :, 0].tolist() == [0, 0, 80, 207, 143, 16, 0, 0]
    assert every.read(np.arange(1797)).max() == 255 and every.labels[:3].tolist() == [0, 1, 2]
    train = load_dataset("digits", split="train", seed=3)
    test = load_dataset("digits", split="test", seed=3)
    assert len(train) + len(test) == 1797
    counts = np.bincount(raw.target)
    assert np.bincount(test.labels).tolist() == [int(round(c * 0.25)) for c in counts]
    again = load_dataset("digits", split="test", seed=3)
    np.testing.assert_array_equal(again.read(np.arange(len(again))), test.read(np.arange(len(test))))
    other = load_dataset("digits", split="test", seed=4)
    assert not np.array_equal(other.read(np.arange(len(other))), test.read(np.arange(len(test))))


def test_recordio_without_identity_table_reads_labels_from_headers(tmp_path):
    png = [fx.encode_image(fx.flat_image((c, c, c), (4, 4)), "PNG") for c in (10, 20, 30)]
    records = {0: fx.irheader_payload(1.0, png[0]), 1: fx.irheader_payload(0.0, png[1]), 2: fx.irheader_payload([1.0, 5.0], png[2])}
    fx.write_recordio(tmp_path / "train.rec", tmp_path / "train.idx", records)
    source = load_dataset("casia_webface", root=str(tmp_path), image_size=4)
    assert source.labels.tolist() == [1, 0, 1]
    assert source.read([2])[0, 0, 0].tolist() == [30, 30, 30]

"""CIFAR-10/100, CIFAR100R and ImageNet32 read from pickle batches written in the published layouts."""
import pickle

import fixtures_published as fx
import numpy as np
import pytest

from compat_core.data import load_dataset
from compat_core.data.formats.cifar import CIFAR10_STD, CIFAR100_MEAN


def _images(n, seed, side=32):
    return np.random.default_rng(seed).integers(0, 256, size=(n, side, side, 3), dtype=np.uint8)


@pytest.fixture()
def cifar10_root(tmp_path):
    batches = [(_images(3, seed), [seed % 10, (seed + 1) % 10, 9]) for seed in range(5)]
    test = (_images(2, 99), [4, 0])
    fx.write_cifar10(tmp_path, batches, test, [f"class{i}" for i in range(10)])
    return tmp_path, batches, test


def test_cifar10_reads_py2_pickles_in_file_order(cifar10_root):
    root, batches, test = cifar10_root
    train = load_dataset("cifar10", root=str(root), split="train")
    assert len(train) == 15 and train.image_shape == (32, 32, 3) and train.num_classes == 10
    np.testing.assert_array_equal(train.read(np.arange(15)), np.concatenate([b[0] for b in batches]))
    assert train.labels.tolist() == [0, 1, 9, 1, 2, 9, 2, 3, 9, 3, 4, 9, 4, 5, 9]
    assert train.class_names[3] == "class3"
    assert train.std == CIFAR10_STD and train.hflip is True
    tst = load_dataset("cifar10", root=str(root / "cifar-10-batches-py"), split="test")  # dataset folder itself
    np.testing.assert_array_equal(tst.read(np.array([1, 0])), test[0][::-1])
    assert tst.labels.tolist() == [4, 0]


def test_cifar_pixel_layout_is_planar_rgb(tmp_path):
    # One 32x32 image whose pixel (row 1, col 2) is (10, 20, 30): in the published row the R plane comes first,
    # so byte 1*32+2 = 34 is R, 1024+34 = 1058 is G and 2048+34 = 2082 is B.
    image = np.zeros((1, 32, 32, 3), dtype=np.uint8)
    image[0, 1, 2] = (10, 20, 30)
    row = fx.planar_rows(image)[0]
    assert (row[34], row[1058], row[2082]) == (10, 20, 30)
    fx.write_cifar100(tmp_path, (image, [0], [0]), (image, [0], [0]), ["apple"], ["fruit"])
    source = load_dataset("cifar100", root=str(tmp_path), split="train")
    assert tuple(source.read([0])[0, 1, 2]) == (10, 20, 30) and int(source.read([0]).sum()) == 60


def test_cifar100_fine_coarse_and_cifar100r_first_per_class(tmp_path):
    fine = [0, 1, 0, 2, 1, 0, 2, 0]
    coarse = [f // 2 for f in fine]
    images = _images(8, 3)
    fx.write_cifar100(tmp_path, (images, fine, coarse), (images[:2], fine[:2], coarse[:2]),
                      ["apple", "pear", "bus"], ["fruit", "vehicle"])
    train = load_dataset("cifar100", root=str(tmp_path))
    assert train.labels.tolist() == fine and train.coarse_labels.tolist() == coarse
    assert train.class_names == ["apple", "pear", "bus"] and train.coarse_class_names == ["fruit", "vehicle"]
    assert train.mean == CIFAR100_MEAN
    reduced = load_dataset("cifar100r", root=str(tmp_path), per_class=2)
    # first two of class 0 are rows 0, 2; of class 1 rows 1, 4; of class 2 rows 3, 6 -> kept in file order
    assert reduced.labels.tolist() == [0, 1, 0, 2, 1, 2]
    np.testing.assert_array_equal(reduced.read(np.arange(6)), images[[0, 1, 2, 3, 4, 6]])
    assert reduced.coarse_labels.tolist() == [0, 0, 0, 1, 0, 1]
    assert len(load_dataset("cifar100r", root=str(tmp_path), split="test")) == 2


def test_cifar_errors_name_file_and_format(tmp_path, cifar10_root):
    with pytest.raises(FileNotFoundError, match=r"cifar-100-python.*fine_labels"):
        load_dataset("cifar100", root=str(tmp_path / "empty"))
    root, _, _ = cifar10_root
    (root / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match=r"data_batch_3.*b'labels'"):
        load_dataset("cifar10", root=str(root))
    bad = root / "cifar-10-batches-py" / "test_batch"
    bad.write_bytes(fx.py2_pickle_bytes({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}))
    with pytest.raises(ValueError, match=r"test_batch.*row length 100"):
        load_dataset("cifar10", root=str(root), split="test")
    bad.write_bytes(fx.py2_pickle_bytes({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}))
    with pytest.raises(ValueError, match=r"test_batch.*'labels' must lie in \[0, 10\)"):
        load_dataset("cifar10", root=str(root), split="test")


class _RunsCode:
    def __reduce__(self):
        import os
        return (os.getcwd, ())


def test_pickles_with_foreign_globals_are_refused(cifar10_root):
    root, _, _ = cifar10_root
    (root / "cifar-10-batches-py" / "test_batch").write_bytes(pickle.dumps({"data": _RunsCode()}, protocol=2))
    with pytest.raises(ValueError, match=r"test_batch.*refusing global (posix|os|nt)\.getcwd"):
        load_dataset("cifar10", root=str(root), split="test")


def test_imagenet32_one_based_labels_and_first_n_classes(tmp_path):
    images = [_images(4, 10 + i) for i in range(10)]
    labels = [[1, 5, 3, 1000], [2, 2, 7, 4]] + [[1, 1, 1, 1]] * 8
    for i in range(10):
        fx.write_imagenet32_batch(tmp_path / f"train_data_batch_{i + 1}", images[i], labels[i])
    fx.write_imagenet32_batch(tmp_path / "val_data", images[0][:2], [3, 1], with_mean=False)
    full = load_dataset("imagenet32", root=str(tmp_path))
    assert len(full) == 40 and full.num_classes == 1000
    assert full.labels[:8].tolist() == [0, 4, 2, 999, 1, 1, 6, 3]
    first5 = load_dataset("imagenet32", root=str(tmp_path), num_classes=5)
    # classes 0..4 (published labels 1..5): batch 1 rows 0,1,2; batch 2 rows 0,1,3; batches 3-10 every row
    assert first5.num_classes == 5 and len(first5) == 3 + 3 + 32
    np.testing.assert_array_equal(first5.read(np.arange(6)), np.concatenate([images[0][:3], images[1][[0, 1, 3]]]))
    assert first5.labels[:6].tolist() == [0, 4, 2, 1, 1, 3]
    val = load_dataset("imagenet32", root=str(tmp_path), split="val")
    assert val.labels.tolist() == [2, 0]
    (tmp_path / "npz").mkdir()
    np.savez(tmp_path / "npz" / "val_data.npz", data=fx.planar_rows(images[1][:2]), labels=np.array([1000, 2]))
    npz_val = load_dataset("imagenet32", root=str(tmp_path / "npz"), split="val")
    assert npz_val.labels.tolist() == [999, 1] and np.array_equal(npz_val.read([0, 1]), images[1][:2])
    fx.write_imagenet32_batch(tmp_path / "val_data", images[0][:1], [0])
    with pytest.raises(ValueError, match=r"val_data.*1-based class ids in \[1, 1000\]"):
        load_dataset("imagenet32", root=str(tmp_path), split="val")
    with pytest.raises(ValueError, match="num_classes must lie in"):
        load_dataset("imagenet32", root=str(tmp_path), num_classes=0)

"""Tiny ImageNet, TinyImageNet20 and CUB-200-2011 read from folders and text files in the published layouts."""
import fixtures_published as fx
import numpy as np
import pytest
from PIL import Image

from compat_core.data import load_dataset
from compat_core.data.formats.tinyimagenet import TINYIMAGENET20_WNIDS

RED, GREEN, BLUE, GREY = (200, 30, 40), (20, 180, 60), (30, 50, 210), (128, 128, 128)


def _decoded(path):
    return np.asarray(Image.open(path).convert("RGB"))


def test_tinyimagenet20_wnids_are_the_appendix_c_list_and_absent_from_tiny_imagenet():
    # Appendix C of the 2026 paper, copied by hand; the first and last entries of the Tiny ImageNet wnids.txt.
    assert TINYIMAGENET20_WNIDS[0] == "n04116512" and TINYIMAGENET20_WNIDS[-1] == "n03483316"
    assert len(set(TINYIMAGENET20_WNIDS)) == 20
    assert not {"n02124075", "n04067472", "n02437312", "n03447447"} & set(TINYIMAGENET20_WNIDS)


@pytest.fixture()
def tiny_root(tmp_path):
    train = {
        "n02124075": [fx.flat_image(RED, (8, 8)), fx.flat_image(GREEN, (8, 8))],
        "n01443537": [fx.flat_image(BLUE, (8, 8))],
    }
    val = [("n02124075", fx.flat_image(GREY, (8, 8))), ("n01443537", fx.flat_image(RED, (8, 8)))]
    words = {"n01443537": "goldfish, Carassius auratus", "n02124075": "Egyptian cat", "n00001740": "entity"}
    fx.write_tinyimagenet(tmp_path, train, val, words, wnids_order=["n02124075", "n01443537"])
    return tmp_path


def test_tinyimagenet200_train_and_val(tiny_root):
    train = load_dataset("tinyimagenet200", root=str(tiny_root), image_size=8)
    # class ids follow the sorted wnids: n01443537 -> 0, n02124075 -> 1
    assert train.class_names == ["goldfish, Carassius auratus", "Egyptian cat"]
    assert train.labels.tolist() == [0, 1, 1] and train.image_shape == (8, 8, 3)
    base = tiny_root / "tiny-imagenet-200"
    images = train.read(np.array([0, 1, 2]))
    np.testing.assert_array_equal(images[0], _decoded(base / "train/n01443537/images/n01443537_0.JPEG"))
    np.testing.assert_array_equal(images[2], _decoded(base / "train/n02124075/images/n02124075_1.JPEG"))
    assert np.abs(images[1].astype(int) - RED).max() <= 3 and np.abs(images[2].astype(int) - GREEN).max() <= 3
    val = load_dataset("tinyimagenet200", root=str(tiny_root), split="val", image_size=4)
    assert val.labels.tolist() == [1, 0] and val.read([0]).shape == (1, 4, 4, 3)
    assert np.abs(val.read([0]).astype(int) - GREY).max() <= 3  # a flat colour stays flat when resized


def test_tinyimagenet200_malformed_annotation_names_file_and_line(tiny_root):
    path = tiny_root / "tiny-imagenet-200" / "val" / "val_annotations.txt"
    path.write_text("val_0.JPEG\tn02124075\t0\t0\t7\t7\nval_1.JPEG\tn01443537\n")
    with pytest.raises(ValueError, match=r"val_annotations.txt line 2: expected '<file>"):
        load_dataset("tinyimagenet200", root=str(tiny_root), split="val")
    path.write_text("val_0.JPEG\tn09999999\t0\t0\t7\t7\n")
    with pytest.raises(ValueError, match=r"line 1: WordNet id 'n09999999' is not in wnids.txt"):
        load_dataset("tinyimagenet200", root=str(tiny_root), split="val")
    with pytest.raises(ValueError, match=r"unknown split 'test'; valid splits: train, val"):
        load_dataset("tinyimagenet200", root=str(tiny_root), split="test")
    with pytest.raises(FileNotFoundError, match=r"wnids.txt"):
        load_dataset("tinyimagenet200", root=str(tiny_root / "nothing"))


def test_tinyimagenet20_reads_imagenet_tree_in_paper_order(tmp_path):
    colours = {w: (i * 12, 255 - i * 12, 100) for i, w in enumerate(TINYIMAGENET20_WNIDS)}
    for wnid in TINYIMAGENET20_WNIDS:
        fx.write_image(tmp_path / "train" / wnid / f"{wnid}_1.JPEG", fx.flat_image(colours[wnid], (10, 12)))
    fx.write_image(tmp_path / "train" / TINYIMAGENET20_WNIDS[3] / "extra.JPEG", fx.flat_image(GREY, (10, 12)))
    query = load_dataset("tinyimagenet20", root=str(tmp_path), split="train", image_size=6)
    assert len(query) == 21 and query.num_classes == 20 and query.class_names[0] == "n04116512"
    assert query.labels.tolist() == [0, 1, 2, 3, 3] + list(range(4, 20))
    images = query.read(np.arange(21))
    assert images.shape == (21, 6, 6, 3)
    assert np.abs(images[20].astype(int) - colours[TINYIMAGENET20_WNIDS[19]]).max() <= 3
    with pytest.raises(FileNotFoundError, match=r"missing 20 synset folder\(s\).*n04116512"):
        load_dataset("tinyimagenet20", root=str(tmp_path), split="val")


@pytest.fixture()
def cub_root(tmp_path):
    names = [f"{i:03d}.Bird_{i}" for i in range(1, 201)]
    rows = [(1, True, fx.flat_image(RED, (10, 14))), (1, False, fx.flat_image(GREEN, (10, 14))),
            (180, True, fx.flat_image(BLUE, (12, 12))), (181, True, fx.flat_image(GREY, (12, 12))),
            (200, False, fx.flat_image(RED, (12, 12))), (181, False, fx.flat_image(GREEN, (12, 12)))]
    fx.write_cub(tmp_path, names, rows)
    return tmp_path


def test_cub_variants_and_official_split(cub_root):
    all200 = load_dataset("cub200", root=str(cub_root), split="all", image_size=12)
    assert all200.labels.tolist() == [0, 0, 179, 180, 199, 180] and all200.num_classes == 200
    train180 = load_dataset("cub180", root=str(cub_root), split="train", image_size=12)
    assert train180.labels.tolist() == [0, 179] and train180.num_classes == 180
    query20 = load_dataset("cub20", root=str(cub_root), split="train", image_size=12)
    gallery20 = load_dataset("cub20", root=str(cub_root), split="test", image_size=12)
    assert query20.labels.tolist() == [0] and gallery20.labels.tolist() == [19, 0]
    assert query20.class_names[0] == "181.Bird_181" and gallery20.class_names[19] == "200.Bird_200"
    path = cub_root / "CUB_200_2011" / "images" / "200.Bird_200" / "Bird_200_0005.jpg"
    np.testing.assert_array_equal(gallery20.read([0])[0], _decoded(path))
    # 10x14 (H x W) image -> shorter side 10 scaled to 12, centre crop to 12x12, still one flat colour
    first = all200.read([0])[0]
    assert first.shape == (12, 12, 3) and np.abs(first.astype(int) - RED).max() <= 3


def test_cub_malformed_line(cub_root):
    (cub_root / "CUB_200_2011" / "train_test_split.txt").write_text("1 1\n2 x\n")
    with pytest.raises(ValueError, match=r"train_test_split.txt line 2: 'x' is not an integer; expected <image_id> <0\|1>"):
        load_dataset("cub200", root=str(cub_root))
    (cub_root / "CUB_200_2011" / "train_test_split.txt").write_text("1 1\n")
    with pytest.raises(ValueError, match=r"train_test_split.txt has no line for image id\(s\) \[2, 3"):
        load_dataset("cub200", root=str(cub_root))
    (cub_root / "CUB_200_2011" / "classes.txt").unlink()
    with pytest.raises(FileNotFoundError, match=r"CUB_200_2011.*classes.txt"):
        load_dataset("cub20", root=str(cub_root))


def test_cub_refuses_duplicate_ids_bad_labels_escaping_paths_and_empty_images(cub_root, tmp_path):
    """Each broken index is refused when the pool is opened (before any image is decoded), naming file and line."""
    base = cub_root / "CUB_200_2011"
    images, labels = (base / "images.txt").read_text(), (base / "image_class_labels.txt").read_text()
    # a duplicate image id would silently relabel an image
    (base / "image_class_labels.txt").write_text(labels + "2 5\n")
    with pytest.raises(ValueError, match=r"image_class_labels.txt line 7: id 2 is listed twice \(first on line 2\)"):
        load_dataset("cub200", root=str(cub_root), split="all")
    # a label outside classes.txt would silently drop the image
    (base / "image_class_labels.txt").write_text(labels.replace("3 180\n", "3 999\n"))
    with pytest.raises(ValueError, match=r"image_class_labels.txt line 3: class id 999 of image 3 is not in"):
        load_dataset("cub180", root=str(cub_root), split="all")
    (base / "image_class_labels.txt").write_text(labels)
    # a listed path that leaves the data root is never read
    outside = tmp_path / "outside.jpg"
    outside.write_bytes((base / "images" / images.splitlines()[0].split()[1]).read_bytes())
    for escape in ("../../outside.jpg", str(outside), "a/../../../outside.jpg"):
        (base / "images.txt").write_text(images.replace(images.splitlines()[0].split()[1], escape, 1))
        with pytest.raises(ValueError, match=r"images.txt line 1: path .* leaves the data folder"):
            load_dataset("cub200", root=str(cub_root), split="all")
    (base / "images.txt").write_text(images)
    # a zero-byte JPEG is named with its index line before any stage decodes it
    empty = base / "images" / images.splitlines()[3].split()[1]
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"image .*{empty.name} \(listed in .*images.txt line 4\) is empty"):
        load_dataset("cub20", root=str(cub_root), split="train")
    empty.unlink()
    with pytest.raises(FileNotFoundError, match=rf"image .*{empty.name} \(listed in .*images.txt line 4\) does not"):
        load_dataset("cub200", root=str(cub_root), split="all")
    empty.write_bytes(b"<html>not an image</html>")
    with pytest.raises(ValueError, match=rf"image .*{empty.name} \(listed in .*images.txt line 4\) is not a JPEG"):
        load_dataset("cub200", root=str(cub_root), split="all")

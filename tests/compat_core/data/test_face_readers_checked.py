"""LFW (pairs.txt) and CASIA-WebFace identity folders refuse broken data when the pool is opened, before any image
is decoded: a path that leaves the data root, a missing image, an empty or non-image file, each named with the
file (and for LFW the pairs.txt line) it came from."""
import os

import fixtures_published as fx
import numpy as np
import pytest

from compat_core.data import load_dataset

COLOURS = [(200, 30, 40), (20, 180, 60), (30, 50, 210)]


@pytest.fixture
def lfw_root(tmp_path):
    """2 folds of 1 same + 1 different pair: lines 2-5 of pairs.txt."""
    people = {"Ann_A": [fx.flat_image(COLOURS[0], (8, 8))] * 2, "Bob_B": [fx.flat_image(COLOURS[1], (8, 8))],
              "Cy_C": [fx.flat_image(COLOURS[2], (8, 8))] * 3}
    same = [[("Ann_A", 1, 2)], [("Cy_C", 1, 3)]]
    different = [[("Ann_A", 1, "Bob_B", 1)], [("Bob_B", 1, "Cy_C", 2)]]
    root = tmp_path / "lfw-root"
    fx.write_lfw(root, people, same, different)
    return root


def _rewrite_line(path, number: int, text: str) -> None:
    lines = path.read_text().splitlines()
    lines[number - 1] = text
    path.write_text("\n".join(lines) + "\n")


def test_lfw_intact_fixture_opens(lfw_root):
    source = load_dataset("lfw", root=str(lfw_root), split="pairs", image_size=8)
    assert source.class_names == ["Ann_A", "Bob_B", "Cy_C"] and len(source) == 6


@pytest.mark.parametrize("line", ["../../outside\t1\t1", "/etc\t1\t1", "Ann_A/../../..\t1\t2"])
def test_lfw_names_that_leave_the_data_root_are_refused_by_line(lfw_root, tmp_path, line):
    outside = tmp_path / "outside" / "outside_0001.jpg"  # a real image where the escape would land
    fx.write_image(outside, fx.flat_image(COLOURS[0], (8, 8)))
    _rewrite_line(lfw_root / "pairs.txt", 4, line)  # fold 2's same-person line
    with pytest.raises(ValueError, match=r"lfw: .*pairs.txt line 4: path .* leaves the data folder .*lfw"):
        load_dataset("lfw", root=str(lfw_root), split="pairs", image_size=8)


def test_lfw_missing_empty_and_non_image_files_are_named_with_their_line(lfw_root):
    _rewrite_line(lfw_root / "pairs.txt", 5, "Bob_B\t2\tCy_C\t2")  # Bob_B has one image
    with pytest.raises(FileNotFoundError, match=r"image .*lfw/Bob_B/Bob_B_0002.jpg \(listed in .*pairs.txt line 5\) "
                                                r"does not exist"):
        load_dataset("lfw", root=str(lfw_root), split="pairs", image_size=8)
    _rewrite_line(lfw_root / "pairs.txt", 5, "Bob_B\t1\tCy_C\t2")
    image = lfw_root / "lfw" / "Cy_C" / "Cy_C_0003.jpg"  # first named on line 4
    image.write_bytes(b"")
    with pytest.raises(ValueError, match=r"image .*Cy_C_0003.jpg \(listed in .*pairs.txt line 4\) is empty"):
        load_dataset("lfw", root=str(lfw_root), split="pairs", image_size=8)
    image.write_bytes(b"<html>404</html>")
    with pytest.raises(ValueError, match=r"image .*Cy_C_0003.jpg \(listed in .*pairs.txt line 4\) is not a JPEG"):
        load_dataset("lfw", root=str(lfw_root), split="pairs", image_size=8)


def test_lfw_image_numbers_are_one_based(lfw_root):
    _rewrite_line(lfw_root / "pairs.txt", 2, "Ann_A\t0\t2")
    with pytest.raises(ValueError, match=r"pairs.txt line 2: image number 0 is not a 1-based image number"):
        load_dataset("lfw", root=str(lfw_root), split="pairs", image_size=8)


@pytest.fixture
def casia_root(tmp_path):
    root = tmp_path / "casia-root"
    for identity, colours in (("0000045", COLOURS[:2]), ("0000099", COLOURS[2:])):
        for k, colour in enumerate(colours):
            fx.write_image(root / "CASIA-WebFace" / identity / f"{k + 1:03d}.jpg", fx.flat_image(colour, (8, 8)))
    return root


def test_casia_folder_links_out_of_the_root_are_refused(casia_root, tmp_path):
    outside = fx.write_image(tmp_path / "outside.jpg", fx.flat_image(COLOURS[0], (8, 8)))
    base = casia_root / "CASIA-WebFace"
    escape = base / "0000099" / "002.jpg"
    os.symlink("../../../outside.jpg", escape)  # relative: CASIA-WebFace/0000099/../../../outside.jpg
    assert escape.resolve() == outside.resolve()
    with pytest.raises(ValueError, match=r"casia_webface: .*0000099/002.jpg is a link to .*outside.jpg, outside "
                                         r"the data folder"):
        load_dataset("casia_webface", root=str(casia_root), image_size=8)
    escape.unlink()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", base / "0000100")  # an identity folder that is a link out
    with pytest.raises(ValueError, match=r"0000100 is a link to .*elsewhere, outside the data folder"):
        load_dataset("casia_webface", root=str(casia_root), image_size=8)
    (base / "0000100").unlink()
    # a link inside the root is an ordinary image
    os.symlink("001.jpg", escape)
    source = load_dataset("casia_webface", root=str(casia_root), image_size=8)
    assert source.labels.tolist() == [0, 0, 1, 1]
    np.testing.assert_array_equal(source.read([3])[0], source.read([2])[0])


def test_casia_folder_missing_and_empty_images_are_named(casia_root):
    base = casia_root / "CASIA-WebFace"
    dangling = base / "0000045" / "003.jpg"
    os.symlink("gone.jpg", dangling)  # listed by the folder, no image behind it
    with pytest.raises(FileNotFoundError, match=r"casia_webface: .*0000045/003.jpg is a link to .*gone.jpg, which "
                                                r"does not exist"):
        load_dataset("casia_webface", root=str(casia_root), image_size=8)
    dangling.unlink()
    (base / "0000099" / "001.jpg").write_bytes(b"")
    with pytest.raises(ValueError, match=r"casia_webface: image .*0000099/001.jpg is empty"):
        load_dataset("casia_webface", root=str(casia_root), image_size=8)

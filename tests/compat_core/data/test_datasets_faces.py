"""CASIA-WebFace (folders and InsightFace RecordIO), CelebA and LFW pairs in their published layouts."""
import pickle
import struct

import fixtures_published as fx
import numpy as np
import pytest
from PIL import Image

from compat_core.data import load_dataset
from compat_core.data.source import ImageSource
from compat_core.data.formats.casia import RecordIOFile, unpack_irheader
from compat_core.data.formats.celeba import check_identity_disjointness

COLOURS = [(200, 30, 40), (20, 180, 60), (30, 50, 210), (128, 128, 128), (250, 250, 10)]
MAGIC_BYTES = struct.pack("<I", 0xCED7230A)


def _png(colour, side=6):
    return fx.encode_image(fx.flat_image(colour, (side, side)), "PNG")


def test_recordio_frames_split_payload_at_magic_word(tmp_path):
    # 10-byte payload with the magic word at offset 4: parts "abcd" (cflag 1) and "ef" (cflag 3, padded to 4 bytes).
    payload = b"abcd" + MAGIC_BYTES + b"ef"
    frame = fx.recordio_frame(payload)
    assert frame == (MAGIC_BYTES + struct.pack("<I", (1 << 29) | 4) + b"abcd"
                     + MAGIC_BYTES + struct.pack("<I", (3 << 29) | 2) + b"ef" + b"\x00\x00")
    fx.write_recordio(tmp_path / "x.rec", tmp_path / "x.idx", {0: b"hello", 7: payload, 9: b""})
    assert (tmp_path / "x.idx").read_text() == "0\t0\n7\t16\n9\t40\n"  # 8+5+3 pad = 16; 16 + (8+4) + (8+2+2 pad) = 40
    records = RecordIOFile(str(tmp_path / "x.rec"), str(tmp_path / "x.idx"))
    assert records.read_record(7) == payload and records.read_record(0) == b"hello" and records.read_record(9) == b""


def test_irheader_scalar_and_array_labels():
    flag, label, id1, _, rest = unpack_irheader(fx.irheader_payload(3.0, b"JPEG", record_id=5), "t")
    assert (flag, label, id1, rest) == (0, 3.0, 5, b"JPEG")
    flag, label, _, _, rest = unpack_irheader(fx.irheader_payload([7.0, 9.0], b"xy"), "t")
    assert flag == 2 and label.tolist() == [7.0, 9.0] and rest == b"xy"


@pytest.fixture()
def casia_rec(tmp_path):
    identities = [[_png(COLOURS[0]), _png(COLOURS[1])], [_png(COLOURS[2])], [_png(COLOURS[3]), _png(COLOURS[4]), _png(COLOURS[0])]]
    fx.write_insightface_rec(tmp_path / "faces_webface_112x112", identities)
    return tmp_path


def test_casia_recordio_labels_from_identity_records(casia_rec):
    source = load_dataset("casia_webface", root=str(casia_rec), image_size=6)
    assert source.labels.tolist() == [0, 0, 1, 2, 2, 2] and source.num_classes == 3
    assert source.locations == ["1", "2", "3", "4", "5", "6"]
    images = source.read(np.arange(6))
    expected = np.stack([fx.flat_image(c, (6, 6)) for c in [COLOURS[0], COLOURS[1], COLOURS[2], COLOURS[3], COLOURS[4], COLOURS[0]]])
    np.testing.assert_array_equal(images, expected)  # PNG payloads decode exactly
    assert isinstance(source, ImageSource)
    shipped = pickle.loads(pickle.dumps(source))  # e.g. to a worker process: reopens the .rec lazily
    np.testing.assert_array_equal(shipped.read([5, 2]), expected[[5, 2]])
    part = source.subset(np.array([3, 0]))
    assert part.labels.tolist() == [2, 0] and np.array_equal(part.read([0]), expected[[3]])
    first2 = load_dataset("casia_webface", root=str(casia_rec), num_classes=2, image_size=6)
    assert first2.labels.tolist() == [0, 0, 1] and first2.num_classes == 2
    with pytest.raises(ValueError, match="num_classes=4 but .* holds only 3 identities"):
        load_dataset("casia_webface", root=str(casia_rec), num_classes=4)


def test_casia_recordio_bad_magic_and_bad_index(casia_rec):
    base = casia_rec / "faces_webface_112x112"
    data = bytearray((base / "train.rec").read_bytes())
    data[0:4] = b"\x00\x00\x00\x00"
    (base / "train.rec").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"train.rec: bad magic 0x00000000 at byte 0; expected 0xced7230a"):
        load_dataset("casia_webface", root=str(casia_rec))
    (base / "train.idx").write_text("0\t0\n1 12\n")
    with pytest.raises(ValueError, match=r"train.idx line 2: expected '<key>\\t<byte offset>'"):
        load_dataset("casia_webface", root=str(casia_rec))


def test_casia_identity_folders(tmp_path):
    for identity, colours in (("0000045", COLOURS[:2]), ("0000099", COLOURS[2:3])):
        for k, colour in enumerate(colours):
            fx.write_image(tmp_path / "CASIA-WebFace" / identity / f"{k + 1:03d}.jpg", fx.flat_image(colour, (8, 8)))
    source = load_dataset("casia_webface", root=str(tmp_path), image_size=8)
    assert source.class_names == ["0000045", "0000099"] and source.labels.tolist() == [0, 0, 1]
    path = tmp_path / "CASIA-WebFace" / "0000099" / "001.jpg"
    np.testing.assert_array_equal(source.read([2])[0], np.asarray(Image.open(path).convert("RGB")))
    with pytest.raises(ValueError, match="format must be"):
        load_dataset("casia_webface", root=str(tmp_path), format="lmdb")
    with pytest.raises(FileNotFoundError, match="no train.rec"):
        load_dataset("casia_webface", root=str(tmp_path), format="recordio")


def _celeba_rows(partition_of_identity):
    rows, number = [], 1
    for identity, partition in partition_of_identity:
        for _ in range(2):
            rows.append((f"{number:06d}.jpg", identity, partition, fx.flat_image(COLOURS[identity % 5], (10, 8))))
            number += 1
    return rows


def test_celeba_splits_labels_and_disjointness(tmp_path):
    # identities 2880 and 7 train, 12 valid, 3 and 500 test: the published partition is identity-disjoint
    fx.write_celeba(tmp_path, _celeba_rows([(2880, 0), (7, 0), (12, 1), (3, 2), (500, 2)]))
    train = load_dataset("celeba", root=str(tmp_path), image_size=8)
    assert train.identity_ids.tolist() == [7, 2880] and train.labels.tolist() == [1, 1, 0, 0]
    assert train.class_names == ["7", "2880"] and train.locations[0].endswith("img_align_celeba/000001.jpg")
    assert np.abs(train.read([0])[0].astype(int) - COLOURS[2880 % 5]).max() <= 3
    test = load_dataset("celeba", root=str(tmp_path), split="test", identities=[500])
    assert test.labels.tolist() == [0, 0] and test.identity_ids.tolist() == [500]
    report = check_identity_disjointness(str(tmp_path))
    assert report.disjoint and report.identities_per_split == {"train": 2, "valid": 1, "test": 2}
    assert report.images_per_split == {"train": 4, "valid": 2, "test": 4}
    with pytest.raises(ValueError, match=r"identities \[12\] have no image in split 'test'"):
        load_dataset("celeba", root=str(tmp_path), split="test", identities=[12])


def test_celeba_overlap_is_reported_and_bad_lines_rejected(tmp_path):
    rows = _celeba_rows([(5, 0), (5, 2), (9, 1)])  # identity 5 in train and test
    fx.write_celeba(tmp_path, rows)
    report = check_identity_disjointness(str(tmp_path))
    assert not report.disjoint
    assert report.shared == {("train", "valid"): [], ("train", "test"): [5], ("valid", "test"): []}
    assert "train&test: 1 shared" in report.summary()
    (tmp_path / "list_eval_partition.txt").write_text("000001.jpg 0\n000002.jpg\n")
    with pytest.raises(ValueError, match=r"list_eval_partition.txt line 2: expected '<file>.jpg <0\|1\|2>'"):
        load_dataset("celeba", root=str(tmp_path))


def test_lfw_pairs_in_published_format(tmp_path):
    people = {"Ann_A": [fx.flat_image(COLOURS[0], (8, 8))] * 2, "Bob_B": [fx.flat_image(COLOURS[1], (8, 8))],
              "Cy_C": [fx.flat_image(COLOURS[2], (8, 8))] * 3}
    same = [[("Ann_A", 1, 2)], [("Cy_C", 1, 3)]]
    different = [[("Ann_A", 1, "Bob_B", 1)], [("Bob_B", 1, "Cy_C", 2)]]
    fx.write_lfw(tmp_path, people, same, different)
    assert (tmp_path / "pairs.txt").read_text().splitlines()[:3] == ["2\t1", "Ann_A\t1\t2", "Ann_A\t1\tBob_B\t1"]
    source = load_dataset("lfw", root=str(tmp_path), split=None, image_size=8)
    # used images sorted: Ann_A 1, Ann_A 2, Bob_B 1, Cy_C 1, Cy_C 2, Cy_C 3
    assert source.class_names == ["Ann_A", "Bob_B", "Cy_C"] and source.labels.tolist() == [0, 0, 1, 2, 2, 2]
    pairs = source.pairs
    assert pairs.left.tolist() == [0, 0, 3, 2] and pairs.right.tolist() == [1, 2, 5, 4]
    assert pairs.same.tolist() == [True, False, True, False] and pairs.fold.tolist() == [0, 0, 1, 1]
    assert np.abs(source.read([2])[0].astype(int) - COLOURS[1]).max() <= 3
    (tmp_path / "pairs.txt").write_text("1\t1\nAnn_A\t1\tBob_B\t1\nAnn_A\t1\tBob_B\t1\n")
    with pytest.raises(ValueError, match=r"pairs.txt line 2: expected a same-person line"):
        load_dataset("lfw", root=str(tmp_path), split="pairs")
    (tmp_path / "pairs.txt").write_text("10\t300\nAnn_A\t1\t2\n")
    with pytest.raises(ValueError, match=r"1 pair lines, the header '10\\t300' announces 6000"):
        load_dataset("lfw", root=str(tmp_path), split="pairs")

"""Writers of tiny data sets in the exact published on-disk formats, for the dataset-reader tests.

Each writer follows the format as distributed (file names, key types, byte order, magic numbers), written
independently of the readers in compat_core.data.formats.
"""
from __future__ import annotations

import gzip
import io
import pickle
import struct
from pathlib import Path

import numpy as np
from PIL import Image

# --- pickles written the way Python 2's cPickle wrote the CIFAR batches -------------------------------------------

class Py2StylePickler(pickle._Pickler):
    """Protocol-2 pickler emitting strings as Python 2 ``str`` opcodes (SHORT_BINSTRING / BINSTRING) and numpy
    globals under their historical module ``numpy.core.multiarray``, like the published CIFAR python batches."""

    dispatch = pickle._Pickler.dispatch.copy()

    def save_py2_string(self, obj):
        raw = obj.encode("latin1") if isinstance(obj, str) else obj
        if len(raw) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(raw)]) + raw)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(raw)) + raw)
        self.memoize(obj)

    dispatch[bytes] = save_py2_string
    dispatch[str] = save_py2_string

    def save_global(self, obj, name=None):
        module = obj.__module__
        name = name or obj.__qualname__
        if module.startswith("numpy._core"):
            module = "numpy.core" + module[len("numpy._core"):]
        self.write(pickle.GLOBAL + module.encode() + b"\n" + name.encode() + b"\n")
        self.memoize(obj)


def py2_pickle_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    Py2StylePickler(buffer, protocol=2).dump(obj)
    return buffer.getvalue()


def planar_rows(images: np.ndarray) -> np.ndarray:
    """(N, S, S, 3) uint8 -> (N, 3*S*S) rows of the R, G, B planes, each row-major (the CIFAR/ImageNet32 layout)."""
    return np.ascontiguousarray(images.transpose(0, 3, 1, 2).reshape(len(images), -1))


def write_cifar10(root: Path, train_batches: list[tuple[np.ndarray, list[int]]], test: tuple[np.ndarray, list[int]],
                  label_names: list[str]) -> Path:
    """cifar-10-batches-py/ with data_batch_1..5, test_batch and batches.meta (keys b'data', b'labels', ...)."""
    base = Path(root) / "cifar-10-batches-py"
    base.mkdir(parents=True, exist_ok=True)
    if len(train_batches) != 5:
        raise ValueError("CIFAR-10 has exactly five training batches")
    for number, (images, labels) in enumerate(train_batches, start=1):
        record = {b"batch_label": f"training batch {number} of 5".encode(), b"labels": list(labels),
                  b"data": planar_rows(images), b"filenames": [f"img_{number}_{i}.png".encode() for i in range(len(labels))]}
        (base / f"data_batch_{number}").write_bytes(py2_pickle_bytes(record))
    images, labels = test
    record = {b"batch_label": b"testing batch 1 of 1", b"labels": list(labels), b"data": planar_rows(images),
              b"filenames": [f"test_{i}.png".encode() for i in range(len(labels))]}
    (base / "test_batch").write_bytes(py2_pickle_bytes(record))
    meta = {b"num_cases_per_batch": len(train_batches[0][1]), b"label_names": [n.encode() for n in label_names], b"num_vis": 3072}
    (base / "batches.meta").write_bytes(py2_pickle_bytes(meta))
    return base


def write_cifar100(root: Path, train: tuple[np.ndarray, list[int], list[int]], test: tuple[np.ndarray, list[int], list[int]],
                   fine_names: list[str], coarse_names: list[str]) -> Path:
    """cifar-100-python/ with train, test, meta (keys b'data', b'fine_labels', b'coarse_labels', ...)."""
    base = Path(root) / "cifar-100-python"
    base.mkdir(parents=True, exist_ok=True)
    for split, (images, fine, coarse) in (("train", train), ("test", test)):
        record = {b"filenames": [f"{split}_{i}.png".encode() for i in range(len(fine))], b"batch_label": f"{split}ing batch 1 of 1".encode(),
                  b"fine_labels": list(fine), b"coarse_labels": list(coarse), b"data": planar_rows(images)}
        (base / split).write_bytes(py2_pickle_bytes(record))
    meta = {b"fine_label_names": [n.encode() for n in fine_names], b"coarse_label_names": [n.encode() for n in coarse_names]}
    (base / "meta").write_bytes(py2_pickle_bytes(meta))
    return base


def write_imagenet32_batch(path: Path, images: np.ndarray, labels_1based: list[int], with_mean: bool = True) -> None:
    """One downsampled-ImageNet batch: a Python 3 pickle of {'data', 'labels' (1-based), 'mean'}."""
    rows = planar_rows(images)
    record = {"data": rows, "labels": list(labels_1based)}
    if with_mean:
        record["mean"] = rows.mean(axis=0)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(pickle.dumps(record, protocol=4))


# --- encoded images ------------------------------------------------------------------------------------------------

def encode_image(image: np.ndarray, fmt: str = "JPEG") -> bytes:
    buffer = io.BytesIO()
    array = image[..., 0] if image.ndim == 3 and image.shape[-1] == 1 else image
    Image.fromarray(array).save(buffer, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def flat_image(color: tuple[int, int, int], size: tuple[int, int]) -> np.ndarray:
    """A (H, W, 3) image of one colour (decodes back from JPEG within a few levels)."""
    height, width = size
    return np.broadcast_to(np.asarray(color, dtype=np.uint8), (height, width, 3)).copy()


def write_image(path: Path, image: np.ndarray, fmt: str = "JPEG") -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_image(image, fmt))
    return path


# --- text-file data sets -------------------------------------------------------------------------------------------

def write_tinyimagenet(root: Path, train: dict[str, list[np.ndarray]], val: list[tuple[str, np.ndarray]],
                       words: dict[str, str], wnids_order: list[str]) -> Path:
    """tiny-imagenet-200/ with wnids.txt, words.txt, train/<wnid>/images/<wnid>_<k>.JPEG, val/images + annotations."""
    base = Path(root) / "tiny-imagenet-200"
    base.mkdir(parents=True, exist_ok=True)
    (base / "wnids.txt").write_text("".join(f"{w}\n" for w in wnids_order))
    (base / "words.txt").write_text("".join(f"{w}\t{n}\n" for w, n in words.items()))
    for wnid, images in train.items():
        boxes = []
        for k, image in enumerate(images):
            write_image(base / "train" / wnid / "images" / f"{wnid}_{k}.JPEG", image)
            boxes.append(f"{wnid}_{k}.JPEG\t0\t0\t{image.shape[1] - 1}\t{image.shape[0] - 1}\n")
        (base / "train" / wnid / f"{wnid}_boxes.txt").write_text("".join(boxes))
    lines = []
    for k, (wnid, image) in enumerate(val):
        write_image(base / "val" / "images" / f"val_{k}.JPEG", image)
        lines.append(f"val_{k}.JPEG\t{wnid}\t0\t0\t{image.shape[1] - 1}\t{image.shape[0] - 1}\n")
    (base / "val" / "val_annotations.txt").write_text("".join(lines))
    return base


def write_cub(root: Path, class_names: list[str], images: list[tuple[int, bool, np.ndarray]]) -> Path:
    """CUB_200_2011/ text files; ``images`` rows are (1-based class id, is_training_image, pixels)."""
    base = Path(root) / "CUB_200_2011"
    base.mkdir(parents=True, exist_ok=True)
    (base / "classes.txt").write_text("".join(f"{i} {n}\n" for i, n in enumerate(class_names, start=1)))
    paths, labels, split = [], [], []
    for image_id, (class_id, is_train, pixels) in enumerate(images, start=1):
        relative = f"{class_names[class_id - 1]}/{class_names[class_id - 1].split('.', 1)[1]}_{image_id:04d}.jpg"
        write_image(base / "images" / relative, pixels)
        paths.append(f"{image_id} {relative}\n")
        labels.append(f"{image_id} {class_id}\n")
        split.append(f"{image_id} {1 if is_train else 0}\n")
    (base / "images.txt").write_text("".join(paths))
    (base / "image_class_labels.txt").write_text("".join(labels))
    (base / "train_test_split.txt").write_text("".join(split))
    return base


def write_celeba(root: Path, rows: list[tuple[str, int, int, np.ndarray]]) -> Path:
    """img_align_celeba/*.jpg, identity_CelebA.txt and list_eval_partition.txt; rows = (file, identity, partition, pixels)."""
    base = Path(root)
    for filename, _, _, pixels in rows:
        write_image(base / "img_align_celeba" / filename, pixels)
    (base / "identity_CelebA.txt").write_text("".join(f"{f} {i}\n" for f, i, _, _ in rows))
    (base / "list_eval_partition.txt").write_text("".join(f"{f} {p}\n" for f, _, p, _ in rows))
    return base


def write_lfw(root: Path, people: dict[str, list[np.ndarray]], same: list[list[tuple[str, int, int]]],
              different: list[list[tuple[str, int, str, int]]]) -> Path:
    """lfw/<name>/<name>_<NNNN>.jpg and pairs.txt ('<folds>\\t<n>' then per fold n same and n different lines)."""
    base = Path(root)
    for name, images in people.items():
        for number, pixels in enumerate(images, start=1):
            write_image(base / "lfw" / name / f"{name}_{number:04d}.jpg", pixels)
    folds, per_half = len(same), len(same[0])
    lines = [f"{folds}\t{per_half}\n"]
    for fold_same, fold_different in zip(same, different):
        lines += [f"{n}\t{i}\t{j}\n" for n, i, j in fold_same]
        lines += [f"{a}\t{i}\t{b}\t{j}\n" for a, i, b, j in fold_different]
    (base / "pairs.txt").write_text("".join(lines))
    return base


# --- IDX -----------------------------------------------------------------------------------------------------------

def idx_bytes(array: np.ndarray) -> bytes:
    """uint8 IDX: big-endian magic 0x0000 08 <ndim>, then the dimensions as big-endian uint32, then the bytes."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    return struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def write_fashion_mnist(root: Path, train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray],
                        gzipped: bool = True) -> Path:
    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    suffix = ".gz" if gzipped else ""
    for prefix, (images, labels) in (("train", train), ("t10k", test)):
        for stem, array in ((f"{prefix}-images-idx3-ubyte", images), (f"{prefix}-labels-idx1-ubyte", labels)):
            data = idx_bytes(array)
            (base / (stem + suffix)).write_bytes(gzip.compress(data) if gzipped else data)
    return base


# --- MXNet RecordIO (InsightFace train.rec / train.idx) --------------------------------------------------------------

RECORDIO_MAGIC = 0xCED7230A


def irheader_payload(label, payload: bytes = b"", record_id: int = 0) -> bytes:
    """mxnet.recordio.pack: IRHeader '<IfQQ'; a scalar label sets flag 0, a sequence sets flag = its length, the
    header label field 0 and the float32 values in front of the payload."""
    if np.isscalar(label):
        return struct.pack("<IfQQ", 0, float(label), record_id, 0) + payload
    values = np.asarray(label, dtype="<f4")
    return struct.pack("<IfQQ", values.size, 0.0, record_id, 0) + values.tobytes() + payload


def recordio_frame(payload: bytes) -> bytes:
    """dmlc RecordIOWriter::WriteRecord: split at 4-byte-aligned occurrences of the magic word (cflag 1/2/3), each part
    framed by [magic][cflag << 29 | length], the whole record zero-padded to 4 bytes."""
    magic = struct.pack("<I", RECORDIO_MAGIC)
    out = bytearray()
    start = 0
    for i in range(0, len(payload) - len(payload) % 4, 4):
        if payload[i:i + 4] == magic:
            out += magic + struct.pack("<I", ((1 if start == 0 else 2) << 29) | (i - start)) + payload[start:i]
            start = i + 4
    out += magic + struct.pack("<I", ((3 if start else 0) << 29) | (len(payload) - start)) + payload[start:]
    out += b"\x00" * (-len(payload) % 4)
    return bytes(out)


def write_recordio(rec_path: Path, idx_path: Path, records: dict[int, bytes]) -> None:
    """An indexed RecordIO pair: records written in key order, idx lines '<key>\\t<offset>'."""
    data = bytearray()
    lines = []
    for key in sorted(records):
        lines.append(f"{key}\t{len(data)}\n")
        data += recordio_frame(records[key])
    Path(rec_path).write_bytes(bytes(data))
    Path(idx_path).write_text("".join(lines))


def write_insightface_rec(root: Path, identities: list[list[bytes]]) -> Path:
    """train.rec/train.idx as InsightFace packs a face set: key 0 = header (first identity key, end key), keys
    1..M = images (scalar label = identity), then one record per identity with its (first image key, end image key)."""
    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    records: dict[int, bytes] = {}
    key = 1
    ranges = []
    for identity, images in enumerate(identities):
        start = key
        for jpeg in images:
            records[key] = irheader_payload(float(identity), jpeg, record_id=key)
            key += 1
        ranges.append((start, key))
    first_identity_key = key
    for start, end in ranges:
        records[key] = irheader_payload([float(start), float(end)], b"", record_id=key)
        key += 1
    records[0] = irheader_payload([float(first_identity_key), float(key)], b"")
    write_recordio(base / "train.rec", base / "train.idx", records)
    return base

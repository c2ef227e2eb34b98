"""CASIA-WebFace as a folder per identity, or as InsightFace's ``train.rec`` / ``train.idx`` (MXNet RecordIO).

The RecordIO reader is written from the published layout, without mxnet:

* ``train.idx``: text, one ``"<key>\\t<byte offset>"`` line per record.
* ``train.rec``: records ``[magic 0xced7230a][lrecord][payload][zero pad to 4 bytes]`` (little-endian uint32s);
  ``lrecord`` holds the payload length in its lower 29 bits and a continuation flag ``cflag`` in the upper 3 bits.
  A payload that contains the magic word is split at each occurrence: parts with cflag 1 (first), 2 (middle),
  3 (last) are joined with the magic word re-inserted; cflag 0 is a whole record.
* payload: ``IRHeader`` = struct ``'<IfQQ'`` (flag, label, id, id2); when ``flag > 0`` the label is the ``flag``
  float32 values that follow the header; the rest is the encoded (JPEG) image.
* InsightFace convention: record 0 has ``flag = 2`` and label ``(first identity key, end key)``; image records are keys
  ``1 .. first identity key - 1``; each identity record (keys ``first identity key .. end key - 1``) has label
  ``(first image key, end image key)`` of that identity's images.
"""
from __future__ import annotations

import os
import struct
import threading

import numpy as np

from compat_core import io
from compat_core.data.datasets import register_dataset
from compat_core.data.formats._shared import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    EncodedImageSource,
    check_image_files,
    require_root,
)

RECORDIO_MAGIC = 0xCED7230A
IRHEADER = struct.Struct("<IfQQ")
_LENGTH_BITS = 29
_LENGTH_MASK = (1 << _LENGTH_BITS) - 1
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")

FOLDER_LAYOUT = "<root>/CASIA-WebFace/<identity folder>/*.jpg (one folder per identity; labels follow sorted folder names)"
RECORD_LAYOUT = (
    "<root>/ (or <root>/faces_webface_112x112/) with InsightFace's train.rec and train.idx: idx lines "
    "'<key>\\t<offset>', rec records [uint32 magic 0xced7230a][uint32 cflag<<29 | length][IRHeader '<IfQQ' "
    "(flag, label, id, id2), flag float32 labels when flag > 0][JPEG bytes], record 0 = (first identity key, end key)"
)
LAYOUT = f"either {FOLDER_LAYOUT}, or {RECORD_LAYOUT}"


class RecordIOFile:
    """Random access to the records of an MXNet indexed RecordIO pair (``.rec`` + ``.idx``)."""

    def __init__(self, rec_uri: str, idx_uri: str) -> None:
        self.rec_uri = rec_uri
        self.idx_uri = idx_uri
        self.offsets = self._read_index(idx_uri)
        self._handle = None
        self._lock = threading.Lock()

    @staticmethod
    def _read_index(idx_uri: str) -> dict[int, int]:
        offsets: dict[int, int] = {}
        text = io.read_bytes(idx_uri).decode("ascii", errors="replace")
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            fields = line.split("\t")
            try:
                key, offset = int(fields[0]), int(fields[1])
            except (ValueError, IndexError):
                raise ValueError(f"{idx_uri} line {number}: expected '<key>\\t<byte offset>' (two integers), got {line!r}") from None
            offsets[key] = offset
        if not offsets:
            raise ValueError(f"{idx_uri} is empty; expected one '<key>\\t<byte offset>' line per record")
        return offsets

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_handle"] = None
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _read_at(self, offset: int) -> bytes:
        with self._lock:
            if self._handle is None:
                self._handle = io.open_input(self.rec_uri)
            handle = self._handle
            handle.seek(offset)
            payload = bytearray()
            while True:
                head = handle.read(8)
                if len(head) != 8:
                    raise ValueError(f"{self.rec_uri}: truncated record header at byte {handle.tell()}; expected 8 bytes")
                magic, lrecord = struct.unpack("<II", head)
                if magic != RECORDIO_MAGIC:
                    raise ValueError(
                        f"{self.rec_uri}: bad magic 0x{magic:08x} at byte {handle.tell() - 8}; expected 0x{RECORDIO_MAGIC:08x} "
                        "(MXNet RecordIO)"
                    )
                cflag, length = lrecord >> _LENGTH_BITS, lrecord & _LENGTH_MASK
                padded = (length + 3) & ~3
                chunk = handle.read(padded)
                if len(chunk) != padded:
                    raise ValueError(f"{self.rec_uri}: truncated record at byte {handle.tell()}; expected {padded} bytes")
                payload += chunk[:length]
                if cflag in (0, 3):
                    return bytes(payload)
                if cflag not in (1, 2):
                    raise ValueError(f"{self.rec_uri}: invalid continuation flag {cflag} (expected 0..3)")
                # The writer split the payload at an occurrence of the magic word: put it back.
                payload += struct.pack("<I", RECORDIO_MAGIC)

    def read_record(self, key: int) -> bytes:
        """The raw payload of record ``key`` (IRHeader + image bytes)."""
        try:
            offset = self.offsets[int(key)]
        except KeyError:
            raise KeyError(f"{self.idx_uri} has no record key {key}") from None
        return self._read_at(offset)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def unpack_irheader(payload: bytes, where: str) -> tuple[int, float | np.ndarray, int, int, bytes]:
    """Split a record payload into ``(flag, label, id, id2, image bytes)``; ``label`` is an array when flag > 0."""
    if len(payload) < IRHEADER.size:
        raise ValueError(f"{where}: record of {len(payload)} bytes is shorter than the {IRHEADER.size}-byte IRHeader '<IfQQ'")
    flag, label, id1, id2 = IRHEADER.unpack_from(payload)
    rest = payload[IRHEADER.size:]
    if flag > 0:
        if len(rest) < 4 * flag:
            raise ValueError(f"{where}: IRHeader flag {flag} announces {flag} float32 labels but only {len(rest)} bytes follow")
        label = np.frombuffer(rest[: 4 * flag], dtype="<f4").copy()
        rest = rest[4 * flag:]
    return flag, label, id1, id2, rest


class _RecordImageFetcher:
    """fetch(location) for EncodedImageSource: image bytes of record ``int(location)``, label checked."""

    def __init__(self, records: RecordIOFile, expected_labels: dict[int, int]) -> None:
        self.records = records
        self.expected_labels = expected_labels

    def __call__(self, location: str) -> bytes:
        key = int(location)
        where = f"{self.records.rec_uri} record {key}"
        flag, label, _, _, image = unpack_irheader(self.records.read_record(key), where)
        header_label = int(label[0]) if flag > 0 else int(label)
        expected = self.expected_labels.get(key)
        if expected is not None and header_label != expected:
            raise ValueError(f"{where}: header label {header_label} disagrees with its identity record (identity {expected})")
        return image


def _load_recordio(base: str, num_classes: int | None, image_size: int, cache_size: int) -> EncodedImageSource:
    records = RecordIOFile(io.join(base, "train.rec"), io.join(base, "train.idx"))
    where = f"{records.rec_uri} record 0"
    flag, label, _, _, _ = unpack_irheader(records.read_record(0), where)
    keys, labels = [], []
    if flag > 0 and len(label) >= 2:
        first_identity, end_identity = int(label[0]), int(label[1])
        if not 1 <= first_identity <= end_identity:
            raise ValueError(f"{where}: identity key range ({first_identity}, {end_identity}) is not increasing from 1")
        for identity, key in enumerate(range(first_identity, end_identity)):
            id_flag, id_label, _, _, _ = unpack_irheader(records.read_record(key), f"{records.rec_uri} record {key}")
            if id_flag < 2:
                raise ValueError(
                    f"{records.rec_uri} record {key}: identity records need a label (first image key, end image key), got flag {id_flag}"
                )
            start, end = int(id_label[0]), int(id_label[1])
            keys += range(start, end)
            labels += [identity] * (end - start)
        expected = dict(zip(keys, labels))
    else:
        # No identity table: every indexed record is an image and carries its own label.
        for key in sorted(records.offsets):
            rec_flag, rec_label, _, _, _ = unpack_irheader(records.read_record(key), f"{records.rec_uri} record {key}")
            keys.append(key)
            labels.append(int(rec_label[0]) if rec_flag > 0 else int(rec_label))
        expected = {}
    labels_arr = np.asarray(labels, dtype=np.int64)
    total = int(labels_arr.max()) + 1 if labels_arr.size else 0
    if num_classes is not None and num_classes > total:
        raise ValueError(f"casia_webface: num_classes={num_classes} but {records.rec_uri} holds only {total} identities")
    keep = np.arange(len(keys)) if num_classes is None else np.flatnonzero(labels_arr < num_classes)
    count = total if num_classes is None else num_classes
    return EncodedImageSource(
        "casia_webface/train" + ("" if num_classes is None else f"/first{num_classes}"),
        [str(keys[i]) for i in keep],
        labels_arr[keep],
        [str(i) for i in range(count)],
        image_size=image_size,
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
        hflip=True,
        fetch=_RecordImageFetcher(records, expected),
        cache_size=cache_size,
    )


def _load_folders(base: str, num_classes: int | None, image_size: int, cache_size: int) -> EncodedImageSource:
    identities = [n for n in io.list_dir(base) if io.is_dir(io.join(base, n))]
    if not identities:
        raise FileNotFoundError(f"casia_webface: no identity folders in {base}; expected {FOLDER_LAYOUT}")
    if num_classes is not None:
        if num_classes > len(identities):
            raise ValueError(f"casia_webface: num_classes={num_classes} but {base} holds only {len(identities)} identity folders")
        identities = identities[:num_classes]
    locations, labels = [], []
    for label, identity in enumerate(identities):
        folder = io.join(base, identity)
        files = [n for n in io.list_dir(folder) if n.lower().endswith(IMAGE_EXTENSIONS)]
        locations += [io.join(folder, f) for f in files]
        labels += [label] * len(files)
    if not io.is_remote(base):
        _check_links(base, identities)
    # every image exists (a dangling link does not), is not empty and looks like an image, before any is decoded
    check_image_files("casia_webface", locations, root=base)
    return EncodedImageSource(
        "casia_webface/train" + ("" if num_classes is None else f"/first{num_classes}"),
        locations,
        np.asarray(labels, dtype=np.int64),
        identities,
        image_size=image_size,
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
        hflip=True,
        cache_size=cache_size,
    )


def _check_links(base: str, identities: list[str]) -> None:
    """ValueError naming the entry when an identity folder or an image in one is a symbolic link to a place outside
    ``base`` (a folder listing cannot name ``../``, but a link can lead out of the data root); FileNotFoundError
    when a link leads nowhere."""
    local_base = io.resolve(base)[1]
    real_base = os.path.realpath(local_base)
    for identity in identities:
        folder = os.path.join(local_base, identity)
        links = [folder] if os.path.islink(folder) else []
        links += [entry.path for entry in os.scandir(folder) if entry.is_symlink()]
        for link in links:
            target = os.path.realpath(link)
            if os.path.commonpath([real_base, target]) != real_base:
                raise ValueError(f"casia_webface: {link} is a link to {target}, outside the data folder {base}; "
                                 f"identity folders and images must lie inside it")
            if not os.path.exists(target):  # a listing skips it silently: the image would just be missing
                raise FileNotFoundError(f"casia_webface: {link} is a link to {target}, which does not exist")


@register_dataset(
    "casia_webface",
    summary="CASIA-WebFace, 10,575 identities / 494,414 face images (folder per identity or InsightFace RecordIO)",
    splits=("train",),
    layout=LAYOUT,
    options={
        "format": "'auto' (RecordIO when train.rec exists, else folders), 'recordio' or 'folder'",
        "num_classes": "keep only the first n identities (0-based labels < n; 3525/7050/10575 in the papers); default all",
        "image_size": "side in pixels of the square images read() returns (default 112, InsightFace's crop size)",
        "cache_size": "decoded images kept in memory (LRU, default 256; 0 disables)",
    },
)
def load_casia_webface(
    root: str | None,
    split: str,
    format: str = "auto",
    num_classes: int | None = None,
    image_size: int = 112,
    cache_size: int = 256,
) -> EncodedImageSource:
    """CASIA-WebFace; labels are 0-based identities (record identity order, or sorted folder names)."""
    if format not in ("auto", "recordio", "folder"):
        raise ValueError(f"casia_webface: format must be 'auto', 'recordio' or 'folder', got {format!r}")
    if num_classes is not None and int(num_classes) <= 0:
        raise ValueError(f"casia_webface: num_classes must be a positive number of identities, got {num_classes}")
    num_classes = None if num_classes is None else int(num_classes)
    root = require_root("casia_webface", root, LAYOUT)
    if format in ("auto", "recordio"):
        for base in (root, io.join(root, "faces_webface_112x112")):
            if io.exists(io.join(base, "train.rec")):
                if not io.exists(io.join(base, "train.idx")):
                    raise FileNotFoundError(f"casia_webface: {io.join(base, 'train.rec')} has no train.idx beside it; expected {RECORD_LAYOUT}")
                return _load_recordio(base, num_classes, image_size, cache_size)
        if format == "recordio":
            raise FileNotFoundError(f"casia_webface: no train.rec under {root}; expected {RECORD_LAYOUT}")
    base = io.join(root, "CASIA-WebFace") if io.is_dir(io.join(root, "CASIA-WebFace")) else root
    if not io.is_dir(base):
        raise FileNotFoundError(f"casia_webface: {root} is not a folder; expected {LAYOUT}")
    return _load_folders(base, num_classes, image_size, cache_size)

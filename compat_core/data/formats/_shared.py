"""Helpers shared by the readers of published dataset formats.

Everything here reads through :mod:`compat_core.io`, so a dataset root may be a local folder or an ``s3://`` URI.
Nothing is ever downloaded: a missing file raises ``FileNotFoundError`` naming the file and the layout expected.
"""
from __future__ import annotations

import io as _stdio
import os
import pickle
import posixpath
import re
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Sequence

import numpy as np

from compat_core import io
from compat_core.data.encoded import EncodedImages, decode_image

# ImageNet statistics (fractions of 255), the normalisation every ImageNet/DINO-pretrained backbone expects; used
# for the natural-image and face sets whose authors publish no statistics of their own.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# GETs in flight per process for images on an object store: one GET costs a round trip (milliseconds to tens of
# milliseconds) and a few kilobytes, so one input worker needs many at once to keep a GPU fed
REMOTE_FETCHES_IN_FLIGHT = 16


def require_root(dataset: str, root: str | None, layout: str) -> str:
    """``root`` as a string, or FileNotFoundError explaining the expected layout when none was given."""
    if root is None or str(root) == "":
        raise FileNotFoundError(
            f"{dataset}: no data root given (nothing is downloaded). Pass root=<local folder or s3://bucket/prefix> "
            f"holding {layout}"
        )
    return str(root)


def locate_dir(dataset: str, root: str, subdirs: Sequence[str], markers: Sequence[str], layout: str) -> str:
    """The folder under ``root`` (``root/<subdir>`` or ``root`` itself) that holds every file in ``markers``."""
    candidates = [io.join(root, sub) for sub in subdirs] + [root]
    for candidate in candidates:
        if all(io.exists(io.join(candidate, marker)) for marker in markers):
            return candidate
    tried = ", ".join(io.join(c, markers[0]) for c in candidates)
    raise FileNotFoundError(f"{dataset}: expected {layout}; did not find {markers[0]!r} (looked for {tried})")


def require_file(dataset: str, uri: str, expected: str) -> str:
    if not io.exists(uri):
        raise FileNotFoundError(f"{dataset}: missing file {uri}; expected {expected}")
    return uri


def read_text_lines(dataset: str, uri: str, expected: str) -> list[tuple[int, list[str]]]:
    """Non-empty lines of a text file as ``(1-based line number, whitespace-split fields)``."""
    require_file(dataset, uri, expected)
    text = io.read_bytes(uri).decode("utf-8")
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            rows.append((number, line.split()))
    return rows


def parse_int(dataset: str, uri: str, line_number: int, value: str, expected: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{dataset}: {uri} line {line_number}: {value!r} is not an integer; expected {expected}") from None


def add_unique(dataset: str, uri: str, line: int, table: dict, lines: dict, key, value) -> None:
    """``table[key] = value`` from ``uri`` line ``line``; ValueError naming both lines when ``key`` was listed before
    (a duplicate id would silently relabel an image)."""
    if key in table:
        raise ValueError(f"{dataset}: {uri} line {line}: id {key!r} is listed twice (first on line {lines[key]}); "
                         f"every id must appear once")
    table[key] = value
    lines[key] = line


def contained_path(dataset: str, base: str, relative: str, uri: str, line: int) -> str:
    """``base/relative`` for a path listed in an index file; ValueError naming the file and line when the path is
    absolute or leaves ``base`` (``../``), so no listed path reads outside the data root."""
    text = str(relative)
    normal = posixpath.normpath(text.replace("\\", "/"))
    if (not text or text.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", text) or "://" in text
            or normal == ".." or normal.startswith("../")):
        raise ValueError(f"{dataset}: {uri} line {line}: path {text!r} leaves the data folder {base}; listed paths "
                         f"must be relative paths inside it")
    return io.join(base, normal)


IMAGE_SIGNATURES = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a", b"BM")


def check_image_files(dataset: str, locations: Sequence[str], origins: Sequence[str] | None = None,
                      root: str | None = None) -> None:
    """Every listed image exists and is not empty, checked before any image is decoded (one listing per folder,
    local or ``s3://``; or one recursive listing of ``root`` when every image lies under it, for layouts with
    thousands of small folders); the error names the file and the index line it came from."""
    import pyarrow.fs as pafs

    sizes: dict[str, int] = {}
    if root is not None:
        prefix = str(root).rstrip("/")
        if any(not str(location).startswith(prefix + "/") for location in locations):
            raise ValueError(f"{dataset}: check_image_files root {root} does not hold every listed image")
        listings = [(prefix, True)]
    else:
        listings = [(folder, False) for folder in sorted({posixpath.dirname(str(location)) for location in locations})]
    for folder, recursive in listings:
        fs, path = io.resolve(folder)
        try:
            infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True, recursive=recursive))
        except OSError:
            infos = []
        for info in infos:
            if info.type == pafs.FileType.File:
                relative = posixpath.relpath(info.path, path) if recursive else info.base_name
                sizes[posixpath.join(folder, relative)] = int(info.size or 0)
    for index, location in enumerate(locations):
        where = f" (listed in {origins[index]})" if origins is not None else ""
        size = sizes.get(str(location))
        if size is None:
            raise FileNotFoundError(f"{dataset}: image {location}{where} does not exist")
        if size == 0:
            raise ValueError(f"{dataset}: image {location}{where} is empty (0 bytes); expected JPEG or PNG bytes")
        if not io.is_remote(location):  # local files: the first bytes say whether PIL can decode them at all
            with open(io.resolve(location)[1], "rb") as handle:
                head = handle.read(12)
            if not head.startswith(IMAGE_SIGNATURES) and not (head[:4] == b"RIFF" and head[8:12] == b"WEBP"):
                raise ValueError(f"{dataset}: image {location}{where} is not a JPEG, PNG, GIF, BMP or WebP file "
                                 f"(starts with {head[:8].hex()})")


# --- pickles --------------------------------------------------------------------------------------------------

def _numpy_reconstruct():
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy < 2
        from numpy.core import multiarray  # type: ignore[no-redef]
    return multiarray


class _ArrayOnlyUnpickler(pickle.Unpickler):
    """Unpickler for dataset batches: plain containers plus numpy arrays, no other globals.

    Published CIFAR / downsampled-ImageNet batches hold dicts of lists, strings and numpy arrays. Arbitrary pickles can
    run code, so every global except numpy's array reconstruction is refused.
    """

    def find_class(self, module: str, name: str):
        multiarray = _numpy_reconstruct()
        allowed = {
            ("numpy.core.multiarray", "_reconstruct"): multiarray._reconstruct,
            ("numpy._core.multiarray", "_reconstruct"): multiarray._reconstruct,
            ("numpy.core.multiarray", "scalar"): multiarray.scalar,
            ("numpy._core.multiarray", "scalar"): multiarray.scalar,
            ("numpy", "ndarray"): np.ndarray,
            ("numpy", "dtype"): np.dtype,
            # Python 3 writes bytes with protocol <= 2 as codecs.encode(text, "latin1").
            ("_codecs", "encode"): _latin1_encode,
        }
        try:
            return allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"refusing global {module}.{name}: dataset pickles may only contain dicts, lists, strings and numpy arrays"
            ) from None


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    if encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"unexpected codecs.encode encoding {encoding!r} in a dataset pickle")
    return text.encode("latin1")


def load_pickle_dict(dataset: str, uri: str, expected: str) -> dict[str, object]:
    """Load a pickled dict (Python 2 or 3 pickle) with keys normalised to ``str``; refuses non-array globals."""
    require_file(dataset, uri, expected)
    data = io.read_bytes(uri)
    try:
        # encoding="bytes" keeps Python 2 strings as bytes (the published CIFAR keys are b"data", b"labels").
        obj = _ArrayOnlyUnpickler(_stdio.BytesIO(data), encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"{dataset}: {uri} is not a readable dataset pickle ({exc}); expected {expected}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{dataset}: {uri} holds a {type(obj).__name__}, expected a pickled dict: {expected}")
    return {(k.decode("latin1") if isinstance(k, bytes) else str(k)): v for k, v in obj.items()}


def require_key(dataset: str, uri: str, record: dict, key: str, expected: str):
    if key not in record:
        raise ValueError(f"{dataset}: {uri} has no key {key!r} (keys: {sorted(record)}); expected {expected}")
    return record[key]


def decode_names(values: Iterable) -> list[str]:
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in values]


def planar_rows_to_images(dataset: str, uri: str, data: np.ndarray) -> np.ndarray:
    """(N, 3*S*S) uint8 rows with the R, G and B planes of an SxS image each row-major -> (N, S, S, 3)."""
    data = np.asarray(data)
    if data.ndim != 2 or data.dtype != np.uint8:
        raise ValueError(
            f"{dataset}: {uri}: 'data' must be a uint8 array (N, 3*S*S) of R, G, B planes, "
            f"got dtype {data.dtype} shape {data.shape}"
        )
    side = int(round((data.shape[1] / 3) ** 0.5))
    if 3 * side * side != data.shape[1]:
        raise ValueError(f"{dataset}: {uri}: row length {data.shape[1]} is not 3*S*S for a square SxS RGB image")
    return np.ascontiguousarray(data.reshape(-1, 3, side, side).transpose(0, 2, 3, 1))


# --- encoded images ---------------------------------------------------------------------------------------------

class EncodedImageSource:
    """An ImageSource over encoded images (JPEG/PNG) decoded on :meth:`read`.

    ``locations[i]`` names sample ``i`` (a file URI, or a record key); ``fetch(location) -> bytes`` loads it
    (default: :func:`compat_core.io.read_bytes`). Decoded images are resized to ``image_size`` and kept in a small
    LRU of ``cache_size`` images (0 disables it).

    fetch_threads: GETs in flight while :meth:`read` / :meth:`encoded_images` load a batch (a bounded thread pool
    per process); default ``REMOTE_FETCHES_IN_FLIGHT`` when the locations are ``s3://`` URIs read by the default
    fetch, else 1 (local files, and record readers whose ``fetch`` shares one file handle).
    """

    def __init__(
        self,
        name: str,
        locations: Sequence[str],
        labels: np.ndarray,
        class_names: list[str],
        *,
        image_size: int,
        mean: tuple[float, ...] = IMAGENET_MEAN,
        std: tuple[float, ...] = IMAGENET_STD,
        hflip: bool = True,
        coarse_labels: np.ndarray | None = None,
        fetch: Callable[[str], bytes] | None = None,
        cache_size: int = 256,
        fetch_threads: int | None = None,
    ) -> None:
        labels = np.asarray(labels, dtype=np.int64)
        if labels.shape != (len(locations),):
            raise ValueError(f"{name}: labels must have shape ({len(locations)},), got {labels.shape}")
        if labels.size and (labels.min() < 0 or labels.max() >= len(class_names)):
            raise ValueError(f"{name}: labels must lie in [0, {len(class_names)}), got [{labels.min()}, {labels.max()}]")
        if int(image_size) <= 0:
            raise ValueError(f"{name}: image_size must be a positive number of pixels, got {image_size}")
        if int(cache_size) < 0:
            raise ValueError(f"{name}: cache_size must be >= 0 images, got {cache_size}")
        if fetch_threads is None:
            remote = fetch is None and len(locations) > 0 and io.is_remote(locations[0])
            fetch_threads = REMOTE_FETCHES_IN_FLIGHT if remote else 1
        if int(fetch_threads) < 1:
            raise ValueError(f"{name}: fetch_threads must be >= 1 GETs in flight, got {fetch_threads}")
        self.name = name
        self.locations = list(locations)
        self.labels = labels
        self.class_names = list(class_names)
        self.coarse_labels = None if coarse_labels is None else np.asarray(coarse_labels, dtype=np.int64)
        self.image_size = int(image_size)
        self.mean = tuple(mean)
        self.std = tuple(std)
        self.hflip = bool(hflip)
        self._fetch = fetch
        self.cache_size = int(cache_size)
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self.fetch_threads = int(fetch_threads)
        self._pool: tuple[int, ThreadPoolExecutor] | None = None  # (pid, pool): a forked input worker makes its own

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return (self.image_size, self.image_size, 3)

    def __len__(self) -> int:
        return len(self.locations)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def _fetch_all(self, locations: list[str]) -> list[bytes]:
        """The bytes of ``locations``, in order, with up to ``fetch_threads`` GETs in flight."""
        fetch = self._fetch or io.read_bytes
        if self.fetch_threads <= 1 or len(locations) <= 1:
            return [fetch(location) for location in locations]
        if self._pool is None or self._pool[0] != os.getpid():
            self._pool = (os.getpid(), ThreadPoolExecutor(self.fetch_threads, thread_name_prefix="compat-fetch"))
        return list(self._pool[1].map(fetch, locations))

    def _remember(self, location: str, image: np.ndarray) -> None:
        if self.cache_size:
            self._cache[location] = image
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def encoded_bytes(self, index: int) -> bytes:
        """The stored (JPEG/PNG) bytes of sample ``index``, as published (used by ``compat ingest``)."""
        return (self._fetch or io.read_bytes)(self.locations[int(index)])

    def encoded_images(self, indices: np.ndarray):
        """The published bytes of samples ``indices`` as replay-shard images, decoded on read exactly as
        :meth:`read` decodes them (PIL, ``image_size``)."""
        locations = [self.locations[int(i)] for i in np.asarray(indices).reshape(-1)]
        return EncodedImages(self._fetch_all(locations), self.image_shape, "pil")

    def read(self, indices: np.ndarray) -> np.ndarray:
        """uint8 images ``(n, image_size, image_size, 3)`` for 0-based sample ``indices``."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size and (indices.min() < -len(self) or indices.max() >= len(self)):
            raise IndexError(f"{self.name}: sample indices must lie in [0, {len(self)}), got [{indices.min()}, {indices.max()}]")
        out = np.empty((indices.size, self.image_size, self.image_size, 3), dtype=np.uint8)
        locations = [self.locations[int(index)] for index in indices]
        images: dict[str, np.ndarray] = {}
        for location in locations:
            cached = self._cache.get(location)
            if cached is not None:
                self._cache.move_to_end(location)
                images[location] = cached
        missing = list(dict.fromkeys(location for location in locations if location not in images))
        for location, data in zip(missing, self._fetch_all(missing)):
            images[location] = decode_image(data, self.image_size, f"{self.name}: {location}")
            self._remember(location, images[location])
        for row, location in enumerate(locations):
            out[row] = images[location]
        return out

    def subset(self, indices: np.ndarray, name: str | None = None) -> "EncodedImageSource":
        """The samples at ``indices`` (class ids, names and normalisation kept)."""
        indices = np.asarray(indices, dtype=np.int64)
        return EncodedImageSource(
            name or self.name,
            [self.locations[int(i)] for i in indices],
            self.labels[indices],
            self.class_names,
            image_size=self.image_size,
            mean=self.mean,
            std=self.std,
            hflip=self.hflip,
            coarse_labels=None if self.coarse_labels is None else self.coarse_labels[indices],
            fetch=self._fetch,
            cache_size=self.cache_size,
            fetch_threads=self.fetch_threads,
        )

    def __getstate__(self) -> dict:
        # Decoded images stay behind when the source is shipped to another process (e.g. a Ray worker).
        state = dict(self.__dict__)
        state["_cache"] = OrderedDict()
        state["_pool"] = None  # threads never travel; the receiving process starts its own
        return state

    def __repr__(self) -> str:
        return (
            f"EncodedImageSource(name={self.name!r}, samples={len(self)}, classes={self.num_classes}, "
            f"image_shape={self.image_shape})"
        )

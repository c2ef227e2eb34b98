"""Reading inputs from a local path or an object-store URI (``s3://bucket/key``) through ``pyarrow.fs``.

compat_core stays free of boto3: S3 access goes through pyarrow's own S3 client. By default it is configured from the
standard AWS environment variables (``AWS_ENDPOINT_URL``, ``AWS_REGION``; credentials through the AWS SDK's own chain).
The cluster layer installs a fully configured filesystem (profiles, addressing style, clear errors) with
:func:`set_s3_filesystem_factory`, so every reader and writer that goes through :func:`resolve` uses it.
Credentials are never logged.
"""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

import pyarrow.fs as pafs

S3FilesystemFactory = Callable[[], pafs.FileSystem]
_s3_factory: S3FilesystemFactory | None = None
S3_SCHEME = "s3://"


@dataclass(frozen=True)
class S3Uri:
    """An object-store location: ``bucket`` and ``key`` (the object name or prefix inside it, "" for the bucket
    itself). ``str()`` is the ``s3://bucket/key`` URI, :attr:`path` the ``bucket/key`` path of ``pyarrow.fs``."""

    bucket: str
    key: str = ""

    @classmethod
    def parse(cls, uri: str | os.PathLike) -> "S3Uri":
        """``s3://bucket/key`` -> S3Uri; ValueError naming the URI when it is not one (no scheme, no bucket)."""
        text = os.fspath(uri)
        if not is_s3(text):
            raise ValueError(f"{text!r}: expected an s3://BUCKET/KEY URI")
        bucket, _, key = text[len(S3_SCHEME):].partition("/")
        if not bucket:
            raise ValueError(f"{text!r}: no bucket; expected s3://BUCKET/KEY")
        return cls(bucket, key)

    @classmethod
    def from_path(cls, path: str) -> "S3Uri":
        """The location of a ``pyarrow.fs`` S3 path ``bucket/key`` (a leading '/' ignored; "" is the endpoint)."""
        bucket, _, key = path.lstrip("/").partition("/")
        return cls(bucket, key)

    def __str__(self) -> str:
        return f"{S3_SCHEME}{self.path}"

    @property
    def path(self) -> str:
        """``bucket/key`` (``bucket`` alone for the bucket itself): the path inside the S3 filesystem."""
        return f"{self.bucket}/{self.key}" if self.key else self.bucket

    def where(self) -> str:
        """Words naming the location for an error message: bucket, key and URI ("the store" for the endpoint)."""
        if not self.bucket:
            return "the store"
        return f"bucket {self.bucket!r}, key {self.key!r} ({self})" if self.key else f"bucket {self.bucket!r}"


def is_s3(uri: object) -> bool:
    """True for an ``s3://`` URI string."""
    return isinstance(uri, str) and uri.startswith(S3_SCHEME)


def set_s3_filesystem_factory(factory: S3FilesystemFactory | None) -> S3FilesystemFactory | None:
    """Install the callable that :func:`resolve` uses for ``s3://`` URIs; ``None`` restores the default.

    Returns the previously installed factory (``None`` for the default) so callers can restore it.
    The factory is called on every ``s3://`` resolve, so it should return a cached filesystem.
    """
    global _s3_factory
    if factory is not None and not callable(factory):
        raise TypeError(f"S3 filesystem factory must be callable or None, got {type(factory).__name__}")
    previous, _s3_factory = _s3_factory, factory
    return previous


def s3_filesystem() -> pafs.FileSystem:
    """The filesystem used for ``s3://`` URIs: the installed factory's, else one built from the environment."""
    if _s3_factory is not None:
        filesystem = _s3_factory()
        if not isinstance(filesystem, pafs.FileSystem):
            raise TypeError(
                f"the installed S3 filesystem factory returned {type(filesystem).__name__}, "
                "expected a pyarrow.fs.FileSystem"
            )
        return filesystem
    return _s3_filesystem()


def _s3_filesystem() -> pafs.S3FileSystem:
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    kwargs: dict = {}
    if endpoint:
        scheme, _, rest = endpoint.partition("://")
        kwargs["endpoint_override"] = rest or scheme
        kwargs["scheme"] = scheme if rest else "https"
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        kwargs["region"] = region
    return pafs.S3FileSystem(**kwargs)


def is_remote(uri: str | os.PathLike) -> bool:
    """True for a string URI with a non-file scheme (``s3://...``); local paths and ``file://`` URIs are not remote."""
    return isinstance(uri, str) and "://" in uri and not uri.startswith("file://")


def resolve(uri: str | os.PathLike) -> tuple[pafs.FileSystem, str]:
    """Split a URI into (filesystem, path inside it). Local paths and ``file://`` URIs use the local filesystem."""
    text = os.fspath(uri)
    if is_s3(text):
        return s3_filesystem(), S3Uri.parse(text).path
    if text.startswith("file://"):
        text = text[len("file://"):]
    if "://" in text:
        raise ValueError(f"unsupported URI scheme in {text!r}: expected a local path, file:// or s3://")
    return pafs.LocalFileSystem(), str(Path(text).expanduser().absolute())


def join(base: str | os.PathLike, *parts: str) -> str:
    """Join path parts onto a local path or a URI with '/'."""
    text = os.fspath(base).rstrip("/")
    for part in parts:
        text = f"{text}/{part.strip('/')}" if part else text
    return text


def exists(uri: str | os.PathLike) -> bool:
    """True when a file or folder (an S3 object or prefix) is at ``uri``."""
    fs, path = resolve(uri)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def is_dir(uri: str | os.PathLike) -> bool:
    """True when ``uri`` is a folder (on S3: a prefix with objects below it or a directory marker)."""
    fs, path = resolve(uri)
    return fs.get_file_info(path).type == pafs.FileType.Directory


def open_input(uri: str | os.PathLike) -> BinaryIO:
    """Open a file for binary reading; raises FileNotFoundError naming the URI when it is missing."""
    fs, path = resolve(uri)
    try:
        return fs.open_input_file(path)
    except FileNotFoundError as error:
        if type(error) is not FileNotFoundError:
            raise  # a more specific subclass (e.g. a missing bucket) already says what is wrong
        raise FileNotFoundError(f"no such file: {os.fspath(uri)}") from None


def read_bytes(uri: str | os.PathLike) -> bytes:
    """The whole file as stored (no decompression); FileNotFoundError naming ``uri`` when it is missing."""
    with open_input(uri) as handle:
        return handle.read()


def read_range(uri: str | os.PathLike, offset: int, length: int) -> bytes:
    """``length`` bytes starting at 0-based byte ``offset`` (a ranged GET on S3); fewer only at the end of the file."""
    for name, value in (("offset", offset), ("length", length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"read_range {name} must be an integer >= 0 (bytes), got {value!r}")
    with open_input(uri) as handle:
        return handle.read_at(length, offset)


def write_bytes(uri: str | os.PathLike, data: bytes) -> str:
    """Write ``data`` to a file, replacing it; locally via a temporary name and a rename. Returns ``uri``.

    Parent folders are created locally; on S3 an object PUT is atomic, so readers never see a partial object.
    The bytes are stored as given, whatever the name's extension (a ``.gz`` name is not compressed again).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"write_bytes to {os.fspath(uri)}: expected bytes, got {type(data).__name__}")
    fs, path = resolve(uri)
    if isinstance(fs, pafs.LocalFileSystem):
        parent, _, name = path.rpartition("/")
        fs.create_dir(parent, recursive=True)
        temporary = f"{parent}/.tmp-{uuid.uuid4().hex}-{name}"
        try:
            # compression=None: pyarrow would otherwise gzip a name ending in ".gz" a second time
            with fs.open_output_stream(temporary, compression=None) as handle:
                handle.write(data)
            fs.move(temporary, path)
        finally:
            if fs.get_file_info(temporary).type != pafs.FileType.NotFound:
                fs.delete_file(temporary)
    else:
        with fs.open_output_stream(path, compression=None) as handle:
            handle.write(data)
    return os.fspath(uri)


def list_dir(uri: str | os.PathLike) -> list[str]:
    """Names (not paths) of the entries directly inside a folder or prefix, sorted."""
    fs, path = resolve(uri)
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=False, recursive=False))
    return sorted(info.base_name for info in infos)

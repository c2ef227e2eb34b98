"""Reading inputs from a local path or an object-store URI (``s3://bucket/key``) through ``pyarrow.fs``.

compat_core stays free of boto3: S3 access goes through pyarrow's own S3 client, configured from the standard AWS
environment/config chain (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ...). Credentials are never logged.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

import pyarrow.fs as pafs


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
    return isinstance(uri, str) and "://" in uri and not uri.startswith("file://")


def resolve(uri: str | os.PathLike) -> tuple[pafs.FileSystem, str]:
    """Split a URI into (filesystem, path inside it). Local paths and ``file://`` URIs use the local filesystem."""
    text = os.fspath(uri)
    if text.startswith("s3://"):
        return _s3_filesystem(), text[len("s3://"):]
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
    fs, path = resolve(uri)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def is_dir(uri: str | os.PathLike) -> bool:
    fs, path = resolve(uri)
    return fs.get_file_info(path).type == pafs.FileType.Directory


def open_input(uri: str | os.PathLike) -> BinaryIO:
    """Open a file for binary reading; raises FileNotFoundError naming the URI when it is missing."""
    fs, path = resolve(uri)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"no such file: {os.fspath(uri)}")
    return fs.open_input_file(path)


def read_bytes(uri: str | os.PathLike) -> bytes:
    with open_input(uri) as handle:
        return handle.read()


def list_dir(uri: str | os.PathLike) -> list[str]:
    """Names (not paths) of the entries directly inside a folder or prefix, sorted."""
    fs, path = resolve(uri)
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=False, recursive=False))
    return sorted(info.base_name for info in infos)

"""compat_core.io on the local filesystem, and the hook that lets the cluster layer install the s3:// filesystem."""
from __future__ import annotations

import gzip
import os

import pyarrow.fs as pafs
import pytest

from compat_core import io as cio


@pytest.fixture
def restore_factory():
    previous = cio.set_s3_filesystem_factory(None)
    cio.set_s3_filesystem_factory(previous)
    yield
    cio.set_s3_filesystem_factory(previous)


def test_resolve_local_paths_and_file_uris(tmp_path):
    fs, path = cio.resolve(tmp_path / "a.bin")
    assert isinstance(fs, pafs.LocalFileSystem)
    assert path == str(tmp_path / "a.bin")
    assert cio.resolve(f"file://{tmp_path}/b.bin")[1] == f"{tmp_path}/b.bin"
    with pytest.raises(ValueError, match=r"gs://bucket/x"):
        cio.resolve("gs://bucket/x")


def test_join_adds_single_slashes():
    assert cio.join("s3://bkt/run/", "/manifests/", "a.json") == "s3://bkt/run/manifests/a.json"
    assert cio.join("/tmp/run", "", "x") == "/tmp/run/x"


def test_write_bytes_creates_parents_leaves_no_temporaries_and_replaces(tmp_path):
    target = tmp_path / "deep" / "er" / "blob.bin"
    cio.write_bytes(str(target), b"first version")
    cio.write_bytes(str(target), b"second")
    assert target.read_bytes() == b"second"
    assert os.listdir(target.parent) == ["blob.bin"]  # temporaries renamed away
    with pytest.raises(TypeError, match="expected bytes"):
        cio.write_bytes(str(target), "text")


def test_write_and_read_keep_compressed_names_byte_exact(tmp_path):
    # pyarrow's streams default to compression="detect"; a .gz name must not be gzipped again or unpacked on read.
    payload = gzip.compress(b"IDX payload")
    target = tmp_path / "train-images-idx3-ubyte.gz"
    cio.write_bytes(str(target), payload)
    assert target.read_bytes() == payload
    assert cio.read_bytes(str(target)) == payload


def test_read_range_is_a_byte_slice(tmp_path):
    data = bytes(range(256)) * 4  # 1024 bytes, byte i == i % 256
    cio.write_bytes(str(tmp_path / "r.bin"), data)
    assert cio.read_range(str(tmp_path / "r.bin"), 300, 5) == bytes([44, 45, 46, 47, 48])  # 300 % 256 = 44
    assert cio.read_range(str(tmp_path / "r.bin"), 1020, 100) == bytes([252, 253, 254, 255])  # short at the end
    with pytest.raises(ValueError, match="offset"):
        cio.read_range(str(tmp_path / "r.bin"), -1, 3)


def test_open_input_missing_names_the_uri(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no such file: .*missing\.bin"):
        cio.open_input(str(tmp_path / "missing.bin"))


def test_list_dir_exists_is_dir(tmp_path):
    for name in ("b.txt", "a.txt"):
        (tmp_path / name).write_text("x")
    (tmp_path / "sub").mkdir()
    assert cio.list_dir(tmp_path) == ["a.txt", "b.txt", "sub"]
    assert cio.exists(tmp_path / "a.txt") and not cio.exists(tmp_path / "zz")
    assert cio.is_dir(tmp_path / "sub") and not cio.is_dir(tmp_path / "a.txt")


def test_installed_factory_serves_s3_uris(tmp_path, restore_factory):
    # a local folder standing in for an object store: s3://bucket/key -> tmp_path/bucket/key
    stand_in = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    calls = []

    def factory():
        calls.append(1)
        return stand_in

    previous = cio.set_s3_filesystem_factory(factory)
    (tmp_path / "bkt").mkdir()
    (tmp_path / "bkt" / "obj.txt").write_bytes(b"through the factory")
    assert cio.read_bytes("s3://bkt/obj.txt") == b"through the factory"
    assert cio.list_dir("s3://bkt") == ["obj.txt"]
    fs, path = cio.resolve("s3://bkt/obj.txt")
    assert fs is stand_in and path == "bkt/obj.txt"
    assert len(calls) == 3
    assert cio.set_s3_filesystem_factory(previous) is factory


def test_default_s3_filesystem_follows_the_environment(monkeypatch, restore_factory):
    cio.set_s3_filesystem_factory(None)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    fs, path = cio.resolve("s3://bkt/key")
    assert isinstance(fs, pafs.S3FileSystem) and path == "bkt/key"
    assert fs.region == "eu-west-3"


def test_factory_validation(restore_factory):
    with pytest.raises(TypeError, match="callable"):
        cio.set_s3_filesystem_factory("not callable")
    cio.set_s3_filesystem_factory(lambda: "not a filesystem")
    with pytest.raises(TypeError, match="pyarrow.fs.FileSystem"):
        cio.resolve("s3://bkt/key")


# ---- S3Uri: the one s3:// parse / format ----------------------------------------------------------------------------
@pytest.mark.parametrize("text, bucket, key, path", [
    ("s3://runs/demo-er/manifests/k.json", "runs", "demo-er/manifests/k.json", "runs/demo-er/manifests/k.json"),
    ("s3://runs/prefix/", "runs", "prefix/", "runs/prefix/"),
    ("s3://runs", "runs", "", "runs"),
])
def test_s3_uri_parse_and_format_round_trip(text, bucket, key, path):
    from compat_core.io import S3Uri

    location = S3Uri.parse(text)
    assert (location.bucket, location.key, location.path) == (bucket, key, path)
    assert str(location) == text and S3Uri.parse(str(location)) == location
    assert S3Uri.from_path(path) == location and S3Uri.from_path("/" + path) == location


@pytest.mark.parametrize("text", ["s3:///key", "s3://", "/local/path", "file:///x", "runs/key"])
def test_s3_uri_errors_name_the_uri(text):
    from compat_core.io import S3Uri

    with pytest.raises(ValueError) as error:
        S3Uri.parse(text)
    assert repr(text) in str(error.value) and "s3://BUCKET/KEY" in str(error.value)


def test_s3_uri_words_for_messages_and_resolve_uses_its_path():
    from compat_core import io as cio
    from compat_core.io import S3Uri

    assert S3Uri("b", "k/x").where() == "bucket 'b', key 'k/x' (s3://b/k/x)"
    assert S3Uri("b").where() == "bucket 'b'" and S3Uri.from_path("").where() == "the store"
    assert cio.is_s3("s3://b/k") and not cio.is_s3("/b/k") and not cio.is_s3(None)
    assert cio.resolve("s3://bucket/a/b.json")[1] == "bucket/a/b.json"
    with pytest.raises(ValueError, match=r"'s3:///a': no bucket"):
        cio.resolve("s3:///a")

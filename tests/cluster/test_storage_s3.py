"""Object storage against a REAL S3-compatible server (SeaweedFS ``weed mini`` on 127.0.0.1, see tests/conftest.py).

Covers configuration from the AWS chain, secrets never shown, multipart writes, ranged reads, listing, manifest-last
commits, fp16 feature shards, replay-shard corruption, a wrong secret, a missing bucket, and the server stopped
mid-run (clear error, restart on the same port, resume with nothing lost).
"""
from __future__ import annotations

import hashlib
import logging
import pickle

import numpy as np
import pytest

from cluster.storage import s3 as storage
from cluster.storage.s3 import (
    BucketNotFoundError,
    S3Access,
    S3Settings,
    StorageAccessDeniedError,
    StorageUnavailableError,
)
from compat_core import io as cio
from compat_core.data.replay import ReplayMemory
from compat_core.data.replay_parquet import read_replay_shard, write_replay_shard
from compat_core.integrity import IntegrityError
from pipelines.stages.feature_store import read_features
from pipelines.store.run_store import RunStore, feature_blobs

MIB = 1024 * 1024


@pytest.fixture
def isolated_aws(monkeypatch, tmp_path):
    """No user-level AWS config may leak into a test: point the config files at empty paths."""
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION",
                 "AWS_MAX_ATTEMPTS", storage.ADDRESSING_STYLE_ENV):
        monkeypatch.delenv(name, raising=False)


def raw_client(endpoint_url: str, region: str):
    """A plain boto3 client of the test server, for checks independent of the product's pyarrow path."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint_url, region_name=region,
                        config=Config(request_checksum_calculation="when_required", s3={"addressing_style": "path"}))


def access_with_secret(monkeypatch, secret: str) -> S3Access:
    """The access the product builds from the AWS chain, with another secret key in the environment."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    return S3Access.from_environment()


@pytest.fixture
def s3(s3_env, s3_bucket, isolated_aws):
    """Object storage configured from the environment and installed into compat_core.io for one test."""
    with storage.object_storage(S3Access.from_environment()) as access:
        yield access


def test_settings_come_from_the_environment_chain(s3_server, s3, s3_bucket):
    settings = s3.settings
    assert settings.endpoint_url == s3_server.endpoint_url
    assert (settings.region, settings.addressing_style, settings.max_attempts) == ("us-east-1", "path", 3)
    assert s3.credentials_source == "env"
    fs, path = cio.resolve(f"s3://{s3_bucket}/x")
    assert fs is s3.filesystem() and path == f"{s3_bucket}/x"


def test_profile_in_aws_config_files_gives_endpoint_style_and_credentials(s3_server, s3_bucket, isolated_aws,
                                                                          tmp_path, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "aws-config"
    config.write_text(
        "[profile seaweed]\n"
        "region = eu-central-1\n"
        f"endpoint_url = {s3_server.endpoint_url}\n"
        "s3 =\n    addressing_style = path\n"
    )
    credentials = tmp_path / "aws-credentials"
    credentials.write_text(f"[seaweed]\naws_access_key_id = {s3_server.credentials.access_key}\n"
                           f"aws_secret_access_key = {s3_server.credentials.secret_key}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    access = S3Access.from_environment(profile="seaweed")
    assert access.settings.endpoint_url == s3_server.endpoint_url
    assert access.settings.region == "eu-central-1"
    assert access.settings.profile == "seaweed"
    assert access.credentials_source == "shared-credentials-file"
    with storage.object_storage(access):
        cio.write_bytes(f"s3://{s3_bucket}/from-profile.txt", b"profile credentials work")
        assert cio.read_bytes(f"s3://{s3_bucket}/from-profile.txt") == b"profile credentials work"
    with pytest.raises(storage.StorageConfigError, match="'nope'"):
        S3Access.from_environment(profile="nope")


def test_addressing_style_defaults_and_overrides(isolated_aws, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    assert S3Settings.from_environment().addressing_style == "path"  # custom endpoint -> path
    monkeypatch.setenv(storage.ADDRESSING_STYLE_ENV, "virtual")
    assert S3Settings.from_environment().addressing_style == "virtual"
    assert S3Settings.from_environment(addressing_style="path").addressing_style == "path"
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.delenv(storage.ADDRESSING_STYLE_ENV)
    aws = S3Settings.from_environment(region="ap-south-1")
    assert (aws.endpoint_url, aws.addressing_style) == (None, "virtual")  # AWS itself -> virtual hosts
    assert aws.endpoint_display == "https://s3.ap-south-1.amazonaws.com"
    with pytest.raises(storage.StorageConfigError, match="addressing_style"):
        S3Settings(endpoint_url=None, addressing_style="sideways")
    with pytest.raises(storage.StorageConfigError, match="must not embed credentials"):
        S3Settings(endpoint_url="http://user:pw@127.0.0.1:9")


def test_secret_never_appears_in_logs_reprs_pickles_or_errors(s3_server, s3_env, s3_bucket, isolated_aws, caplog,
                                                               monkeypatch, fresh_object_storage):
    secret = s3_server.credentials.secret_key
    wrong_secret = "WRONG-" + secret[::-1]
    caplog.set_level(logging.DEBUG)  # every logger, botocore's request signing included
    access = storage.configure_object_storage()  # undone after the test (fresh_object_storage)
    cio.write_bytes(f"s3://{s3_bucket}/logged.txt", b"x")
    bad = access_with_secret(monkeypatch, wrong_secret)
    with pytest.raises(StorageAccessDeniedError) as caught:
        bad.filesystem().open_input_stream(f"{s3_bucket}/logged.txt")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    assert any(r.name == "cluster.storage.s3" and "object storage configured" in r.getMessage()
               for r in caplog.records)
    assert any(r.name.startswith("botocore") for r in caplog.records)  # the capture saw the signed requests
    shown = [caplog.text, repr(access), str(access), repr(access.settings), repr(bad), str(caught.value)]
    for text in shown:
        assert secret not in text and wrong_secret not in text
    assert "secret_key='***'" in repr(access)
    assert s3_server.credentials.access_key not in repr(access)  # only a shortened hint of the key id
    pickled_access, pickled_fs = pickle.dumps(access), pickle.dumps(access.filesystem())
    assert secret.encode() not in pickled_access and secret.encode() not in pickled_fs
    # the pickle carries settings only; unpickling resolves credentials from the receiving process' environment
    restored = pickle.loads(pickled_access)
    assert restored.settings == access.settings and restored.credentials_source == "env"
    assert pickle.loads(pickled_fs).get_file_info(f"{s3_bucket}/logged.txt").size == 1


def test_wrong_secret_is_rejected_with_the_endpoint_named(s3_server, s3, s3_bucket, monkeypatch):
    cio.write_bytes(f"s3://{s3_bucket}/private.txt", b"only for the right key")
    wrong_secret = "not-the-secret-0123456789"
    bad = access_with_secret(monkeypatch, wrong_secret)
    with pytest.raises(StorageAccessDeniedError) as caught:
        bad.filesystem().open_input_file(f"{s3_bucket}/private.txt").read()
    message = str(caught.value)
    assert s3_server.endpoint_url in message and f"bucket '{s3_bucket}'" in message and "private.txt" in message
    assert wrong_secret not in message and s3_server.credentials.secret_key not in message
    assert isinstance(caught.value, PermissionError)


def test_missing_bucket_is_named(s3_server, s3):
    with pytest.raises(BucketNotFoundError, match=r"bucket 'no-such-bucket-x' does not exist at S3 endpoint "
                                                  + s3_server.endpoint_url.replace(".", r"\.")):
        cio.read_bytes("s3://no-such-bucket-x/some/key")
    # SeaweedFS would create a missing bucket on PUT; the store refuses so a typo cannot make a new bucket
    with pytest.raises(BucketNotFoundError, match="create it first"):
        cio.write_bytes("s3://no-such-bucket-y/some/key", b"x")
    client = raw_client(s3.settings.endpoint_url, s3.settings.region)
    assert "no-such-bucket-y" not in [b["Name"] for b in client.list_buckets()["Buckets"]]


def test_multipart_write_through_the_pyarrow_output_stream(s3, s3_bucket):
    data = np.random.default_rng(1).integers(0, 256, size=12 * MIB, dtype=np.uint8).tobytes()
    fs, path = cio.resolve(f"s3://{s3_bucket}/big/arrow.bin")
    with fs.open_output_stream(path) as handle:
        for start in range(0, len(data), 3 * MIB):  # written in pieces, as a Parquet writer would
            handle.write(data[start:start + 3 * MIB])
    head = raw_client(s3.settings.endpoint_url, s3.settings.region).head_object(Bucket=s3_bucket, Key="big/arrow.bin")
    assert head["ContentLength"] == 12 * MIB
    assert "-" in head["ETag"].strip('"')  # a multipart ETag is "<md5 of part md5s>-<parts>"
    assert cio.read_range(f"s3://{s3_bucket}/big/arrow.bin", 7 * MIB + 3, 6) == data[7 * MIB + 3: 7 * MIB + 9]
    assert hashlib.sha256(cio.read_bytes(f"s3://{s3_bucket}/big/arrow.bin")).hexdigest() == \
        hashlib.sha256(data).hexdigest()


def test_listing_and_manifest_last_commits_on_s3(s3, s3_bucket):
    store = RunStore(f"s3://{s3_bucket}/run")
    for key in ("train-t1", "extract-t0", "train-t0"):
        store.commit(key, {"task": key}, {"weights.bin": key.encode() * 3})
    assert store.stage_keys() == ["extract-t0", "train-t0", "train-t1"]
    assert cio.list_dir(f"s3://{s3_bucket}/run/manifests") == ["extract-t0.json", "train-t0.json", "train-t1.json"]
    assert cio.list_dir(f"s3://{s3_bucket}/run/artifacts/train-t0") == ["weights.bin"]
    # a blob whose manifest never arrived (a crash in between) is not a finished stage
    cio.write_bytes(store.blob_uri("train-t2", "weights.bin"), b"orphan")
    assert not store.has("train-t2")
    assert "train-t2" not in store.stage_keys()
    with pytest.raises(FileNotFoundError, match="train-t2"):
        store.load_record("train-t2")
    assert store.has("train-t1") and store.read_blob("train-t1", "weights.bin") == b"train-t1" * 3


def test_fp16_feature_shards_round_trip_through_s3(s3, s3_bucket):
    rng = np.random.default_rng(2)
    features = rng.standard_normal((300, 16)).astype(np.float32)
    labels = rng.integers(0, 10, 300)
    store = RunStore(f"s3://{s3_bucket}/feat")
    blobs, layout = feature_blobs(features, labels, shard_rows=128)
    store.commit("extract", {"layout": layout}, blobs)
    stored, stored_labels, coarse = read_features(store, "extract")
    assert stored.dtype == np.float16 and stored.shape == (300, 16) and coarse is None
    np.testing.assert_array_equal(stored, features.astype(np.float16))
    np.testing.assert_array_equal(stored_labels, labels)
    assert cio.list_dir(f"s3://{s3_bucket}/feat/artifacts/extract") == [
        "features-00000.npy", "features-00001.npy", "features-00002.npy", "labels.npy"]  # ceil(300 / 128) = 3


def _memory(rows: int = 6):
    return ReplayMemory(indices=np.arange(rows) + 100, labels=np.arange(rows) % 2, slots=np.arange(rows) % 2,
                        source_task=np.zeros(rows, np.int64))


def test_replay_shard_on_s3_round_trip_and_corruption_names_bucket_key_expected_actual(s3, s3_bucket):
    images = np.random.default_rng(4).integers(0, 256, size=(6, 8, 8, 3), dtype=np.uint8)
    root = f"s3://{s3_bucket}/run"
    manifest = write_replay_shard(root, 0, _memory(), images)
    key = "run/shards/replay/task-000.parquet"
    client = raw_client(s3.settings.endpoint_url, s3.settings.region)
    original = client.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
    assert hashlib.sha256(original).hexdigest() == manifest.sha256 and len(original) == manifest.size
    shard = read_replay_shard(root, 0)
    np.testing.assert_array_equal(shard.images, images)
    np.testing.assert_array_equal(shard.memory.indices, np.arange(6) + 100)

    corrupted = bytearray(original)
    corrupted[len(corrupted) // 3] ^= 0x55
    client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(corrupted))
    actual = hashlib.sha256(bytes(corrupted)).hexdigest()
    with pytest.raises(IntegrityError) as caught:
        read_replay_shard(root, 0)
    error = caught.value
    assert (error.bucket, error.key, error.field) == (s3_bucket, key, "sha256")
    assert (error.expected, error.actual) == (manifest.sha256, actual)
    for part in (f"bucket '{s3_bucket}'", f"key '{key}'", manifest.sha256, actual):
        assert part in str(error)


def test_server_stopped_mid_run_then_restarted_resumes_with_nothing_lost(s3_server, s3_bucket, s3_env,
                                                                         isolated_aws):
    endpoint_before = s3_server.endpoint_url
    # one attempt per request keeps the refused-connection path fast; retries are the default elsewhere
    access = S3Access.from_environment(max_attempts=1)
    with storage.object_storage(access):
        store = RunStore(f"s3://{s3_bucket}/resume")
        store.commit("stage-a", {"step": 1}, {"w.bin": b"a" * 1000})
        images = np.full((6, 2, 2, 1), 7, np.uint8)
        write_replay_shard(store, 0, _memory(), images)
        s3_server.stop()
        try:
            with pytest.raises(StorageUnavailableError) as caught:
                store.commit("stage-b", {"step": 2}, {"w.bin": b"b" * 1000})
            message = str(caught.value)
            assert endpoint_before in message and "cannot be reached" in message
            assert isinstance(caught.value, ConnectionError)
            with pytest.raises(StorageUnavailableError, match=endpoint_before.replace(".", r"\.")):
                read_replay_shard(store, 0)
        finally:
            s3_server.start()
    assert s3_server.endpoint_url == endpoint_before  # same port: clients keep working without reconfiguring
    # the resumed run, as a user starts it: the default retries (the one attempt above only keeps the
    # refused-connection path fast)
    with storage.object_storage(S3Access.from_environment()):
        store = RunStore(f"s3://{s3_bucket}/resume")
        # committed work survived the restart and verifies; the interrupted stage is simply not done
        assert store.has("stage-a") and not store.has("stage-b")
        assert store.read_blob("stage-a", "w.bin") == b"a" * 1000
        np.testing.assert_array_equal(read_replay_shard(store, 0).images, images)
        store.commit("stage-b", {"step": 2}, {"w.bin": b"b" * 1000})
        assert store.stage_keys() == ["stage-a", "stage-b"]
        assert store.load_record("stage-b") == {"step": 2}


def test_a_frozen_s3_server_is_waited_for_aloud_and_then_named(s3_server, s3_env, s3_bucket, isolated_aws,
                                                                 monkeypatch, capsys):
    """SIGSTOP on the real server (its port still accepts connections, nothing answers): a read says what it waits
    for, gives up after max_attempts tries of request_timeout_s without progress and names the endpoint; the same
    read works once the server runs again."""
    import os
    import signal

    monkeypatch.setenv(storage.REQUEST_TIMEOUT_ENV, "3")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    with storage.object_storage(S3Access.from_environment()) as access:
        assert (access.settings.request_timeout_s, access.settings.max_attempts) == (3.0, 2)
        uri = f"s3://{s3_bucket}/frozen/blob"
        cio.write_bytes(uri, b"kept")
        capsys.readouterr()
        os.killpg(s3_server.process.pid, signal.SIGSTOP)
        try:
            with pytest.raises(OSError) as raised:
                cio.read_bytes(uri)
        finally:
            os.killpg(s3_server.process.pid, signal.SIGCONT)
        assert s3_env["AWS_ENDPOINT_URL"] in str(raised.value)
        waited = capsys.readouterr().err
        assert f"waiting for the S3 endpoint {s3_env['AWS_ENDPOINT_URL']} (" in waited
        assert "giving up after 2 tries of 3 s without progress" in waited
        assert cio.read_bytes(uri) == b"kept"


def test_a_parquet_random_access_read_from_a_frozen_server_says_what_it_waits_for(s3_server, s3_env, s3_bucket,
                                                                                  isolated_aws, monkeypatch, capsys):
    """Ingested shards opened (footer read) while the server answers, then SIGSTOP: the row-group read that follows
    (a ranged GET of the open file, not a new open) says within 5 s what it waits for, naming bucket and key, and
    ends after the configured tries with an error naming the endpoint; the same file reads once the server runs."""
    import os
    import signal
    import sys
    from pathlib import Path

    import pyarrow.parquet as pq

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))
    import tiny_scenario_helpers as tiny

    from cluster.storage.ingest import ingest
    from compat_core.data.datasets import load_dataset

    tiny.register()
    monkeypatch.setenv(storage.REQUEST_TIMEOUT_ENV, "3")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    with storage.object_storage(S3Access.from_environment()):
        root = f"s3://{s3_bucket}/ingested"
        ingest("tiny-synth", None, "query", root, rows_per_part=11, workers=0, progress=None)
        shards = load_dataset("shards", root=root, split="query", verify="size")
        key = f"ingested/query/{shards.manifest.parts[1].name}"
        part = pq.ParquetFile(cio.open_input(f"s3://{s3_bucket}/{key}"))  # opened: its footer is read
        capsys.readouterr()
        os.killpg(s3_server.process.pid, signal.SIGSTOP)
        try:
            with pytest.raises(OSError) as raised:
                part.read_row_group(0, columns=["image"])
        finally:
            os.killpg(s3_server.process.pid, signal.SIGCONT)
        assert s3_env["AWS_ENDPOINT_URL"] in str(raised.value)
        waited = capsys.readouterr().err
        assert (f"waiting for the S3 endpoint {s3_env['AWS_ENDPOINT_URL']} (reading bucket {s3_bucket!r}, key "
                f"{key!r} (s3://{s3_bucket}/{key})): no answer for 5 s; giving up after 2 tries of 3 s without "
                f"progress") in waited
        # the server runs again: the same open file reads the row group, equal to the source's rows 11.. of part 1
        images = part.read_row_group(0, columns=["image"]).column("image").to_pylist()
        original = load_dataset("tiny-synth", split="query")
        np.testing.assert_array_equal(shards.read(np.arange(11, 11 + len(images))),
                                      original.read(np.arange(11, 11 + len(images))))

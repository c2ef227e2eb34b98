"""Every byte of a registered model is verified (real ``mlflow server`` on 127.0.0.1): a version's content tags
cover config.json and the weights; a registry copy that differs is refused naming the file; the download cache is
the user's own (created 0700, refused when others may write to it or another user owns it) and a cached file that
differs is downloaded again."""
from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))

from cluster.model_registry.model_cache import content_digest, content_tags, expected_files, private_dir  # noqa: E402
from cluster.model_registry.versions import MlflowModelResolver, register_version, write_model_folder  # noqa: E402
from compat_core.integrity import IntegrityError  # noqa: E402

pytestmark = pytest.mark.integration


def _model_files() -> dict[str, bytes]:
    from compat_core.models.compat_model import create_model, save_model

    torch.manual_seed(0)
    model = create_model("cnn4", 6, classifier="simplex", backbone_config={"in_chans": 1, "width": 4})
    with tempfile.TemporaryDirectory() as folder:
        save_model(model, folder)
        return {name: Path(folder, name).read_bytes() for name in ("config.json", "model.safetensors")}


def _register(client, name: str, files: dict[str, bytes], logged: dict[str, bytes], tmp_path: Path) -> str:
    """Register a version whose tags describe ``files`` while its run holds ``logged`` (the registry's copy)."""
    experiment = client.get_experiment_by_name("model-cache") or client.get_experiment(
        client.create_experiment("model-cache"))
    run = client.create_run(experiment.experiment_id)
    folder = write_model_folder(tmp_path / f"model-{run.info.run_id}", files["config.json"],
                                files["model.safetensors"])
    for file_name, data in logged.items():
        (folder / "artifacts" / file_name).write_bytes(data)
    client.log_artifacts(run.info.run_id, str(folder), "model")
    client.set_terminated(run.info.run_id)
    digests = {file_name: hashlib.sha256(data).hexdigest() for file_name, data in files.items()}
    client.create_registered_model(name)
    version = register_version(client, name, run.info.run_id, "stage-key",
                               {"sha256": digests["model.safetensors"], **content_tags(digests)}, ["task-1"])
    return str(version.version)


def test_content_digest_is_over_sorted_name_and_sha_pairs():
    files = {"model.safetensors": "b" * 64, "config.json": "a" * 64}
    by_hand = hashlib.sha256(json.dumps([["config.json", "a" * 64], ["model.safetensors", "b" * 64]],
                                        separators=(",", ":")).encode()).hexdigest()
    assert content_digest(files) == by_hand
    tags = content_tags(files)
    assert expected_files(tags, "v") == files
    with pytest.raises(IntegrityError, match="content_sha256"):
        expected_files({**tags, "content_sha256": "0" * 64}, "v")
    assert expected_files({"sha256": "c" * 64}, "v") == {"model.safetensors": "c" * 64}  # older: weights only


def test_cache_folder_is_private(tmp_path):
    created = private_dir(tmp_path / "new" / "cache")
    assert stat.S_IMODE(created.stat().st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(PermissionError, match=r"shared is writable by group and others \(mode 0777\)"):
        private_dir(shared)
    if os.getuid() == 0:  # only root can hand a folder to another user
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, 65534, -1)
        with pytest.raises(PermissionError, match="owned by uid 65534"):
            private_dir(foreign)
    link = tmp_path / "link"
    link.symlink_to(created)
    with pytest.raises(PermissionError, match="not a plain folder"):
        private_dir(link)


def test_registry_files_are_verified_before_use_and_the_cache_again_before_reuse(mlflow_server, tmp_path):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server.tracking_uri, registry_uri=mlflow_server.tracking_uri)
    files = _model_files()
    good = _register(client, "cache-good", files, {}, tmp_path)
    resolver = MlflowModelResolver(mlflow_server.tracking_uri, cache_dir=tmp_path / "cache")
    assert stat.S_IMODE((tmp_path / "cache").stat().st_mode) == 0o700
    folder = Path(resolver(f"models:/cache-good/{good}"))
    assert (folder / "config.json").read_bytes() == files["config.json"]

    (folder / "config.json").write_bytes(b'{"planted": "by another account"}')
    again = Path(resolver("models:/cache-good@task-1"))  # the cached copy differs: downloaded again, verified
    assert again == folder and (again / "config.json").read_bytes() == files["config.json"]

    tampered = files["config.json"].replace(b"{", b"{ ", 1)  # same meaning, other bytes
    assert tampered != files["config.json"]
    bad = _register(client, "cache-tampered", files, {"config.json": tampered}, tmp_path)
    with pytest.raises(IntegrityError, match=r"registered file config\.json .*config\.json.*sha256 expected") as error:
        MlflowModelResolver(mlflow_server.tracking_uri, cache_dir=tmp_path / "cache")(f"models:/cache-tampered/{bad}")
    assert error.value.expected == hashlib.sha256(files["config.json"]).hexdigest()
    assert error.value.actual == hashlib.sha256(tampered).hexdigest()

    os.chmod(tmp_path / "cache", 0o777)
    with pytest.raises(PermissionError, match="model cache"):
        MlflowModelResolver(mlflow_server.tracking_uri, cache_dir=tmp_path / "cache")
    with pytest.raises(PermissionError, match="model cache"):
        resolver("models:/cache-good@task-1")  # checked at every use, not only when the resolver was made


def test_a_version_logged_as_one_file_is_verified_by_its_digest(mlflow_server, tmp_path):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server.tracking_uri, registry_uri=mlflow_server.tracking_uri)
    experiment = client.get_experiment_by_name("model-cache") or client.get_experiment(
        client.create_experiment("model-cache"))
    adapter = b"adapter weights"
    versions = {}
    for name, logged in (("cache-adapter", adapter), ("cache-adapter-bad", b"planted weights")):
        run = client.create_run(experiment.experiment_id)
        (tmp_path / name).mkdir()
        (tmp_path / name / "procrustes.safetensors").write_bytes(logged)
        client.log_artifact(run.info.run_id, str(tmp_path / name / "procrustes.safetensors"), "adapters")
        client.create_registered_model(name)
        digest = hashlib.sha256(adapter).hexdigest()
        versions[name] = register_version(client, name, run.info.run_id, "adapter-key",
                                          {"sha256": digest, **content_tags({"procrustes.safetensors": digest})},
                                          ["procrustes-task-3"], artifact_path="adapters/procrustes.safetensors")
    resolver = MlflowModelResolver(mlflow_server.tracking_uri, cache_dir=tmp_path / "cache")
    assert Path(resolver("models:/cache-adapter@procrustes-task-3")).read_bytes() == adapter
    with pytest.raises(IntegrityError, match=r"registered file procrustes\.safetensors"):
        resolver("models:/cache-adapter-bad@procrustes-task-3")

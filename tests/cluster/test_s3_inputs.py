"""Dataset readers and weight loading from ``s3://`` URIs on a REAL S3 server (SeaweedFS, see tests/conftest.py).

Tiny data sets are written in their published formats by the dataset-reader tests' writers
(tests/compat_core/data/fixtures_published.py), uploaded object by object, and read back through
``compat_core.data.load_dataset(name, root="s3://bucket/prefix")``: one reader per family (pickle batches, IDX, text
files + JPEG, RecordIO). Every check compares with the fixture's own arrays and with the same reader on the local copy.
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save as safetensors_bytes

from cluster.storage.s3 import configure_object_storage
from compat_core import io as cio
from compat_core.data import load_dataset
from compat_core.models.compat_model import create_model, load_model, save_model
from compat_core.models.weights import load_external_weights

# The published-format writers live next to the dataset-reader tests (rootdir-style imports, no package).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compat_core" / "data"))
import fixtures_published as fx  # noqa: E402

pytestmark = pytest.mark.integration

COLOURS = [(200, 30, 40), (20, 180, 60), (30, 50, 210), (128, 128, 128), (250, 250, 10)]


@pytest.fixture
def object_store(s3_env, s3_bucket, monkeypatch, tmp_path, fresh_object_storage):
    """compat_core.io configured for the test server (from the AWS variables of ``s3_env``); the bucket name."""
    # No user-level AWS config may change the endpoint or credentials under test.
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    configure_object_storage()  # undone after the test (fresh_object_storage)
    yield s3_bucket


def _upload_tree(local_root: Path, uri: str) -> list[str]:
    """Copy every file below ``local_root`` to ``uri/<relative path>``; returns the relative paths."""
    uploaded = []
    for path in sorted(p for p in local_root.rglob("*") if p.is_file()):
        relative = path.relative_to(local_root).as_posix()
        cio.write_bytes(cio.join(uri, relative), path.read_bytes())
        uploaded.append(relative)
    return uploaded


def _all_images(source) -> np.ndarray:
    return source.read(np.arange(len(source)))


def test_cifar10_pickle_batches_from_s3(object_store, tmp_path):
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 256, (2, 32, 32, 3), dtype=np.uint8), [k, (k + 3) % 10]) for k in range(5)]
    test = (rng.integers(0, 256, (3, 32, 32, 3), dtype=np.uint8), [7, 0, 9])
    fx.write_cifar10(tmp_path / "local", batches, test, [f"class{i}" for i in range(10)])
    uri = f"s3://{object_store}/datasets/cifar"
    uploaded = _upload_tree(tmp_path / "local", uri)
    assert "cifar-10-batches-py/data_batch_5" in uploaded and "cifar-10-batches-py/batches.meta" in uploaded

    remote = load_dataset("cifar10", root=uri, split="train")
    local = load_dataset("cifar10", root=str(tmp_path / "local"), split="train")
    # batch k holds labels k and k+3, in file order data_batch_1..5
    assert remote.labels.tolist() == [0, 3, 1, 4, 2, 5, 3, 6, 4, 7]
    np.testing.assert_array_equal(remote.labels, local.labels)
    np.testing.assert_array_equal(_all_images(remote), np.concatenate([images for images, _ in batches]))
    np.testing.assert_array_equal(_all_images(remote), _all_images(local))
    assert remote.class_names == local.class_names == [f"class{i}" for i in range(10)]
    remote_test = load_dataset("cifar10", root=uri, split="test")
    assert remote_test.labels.tolist() == [7, 0, 9]
    np.testing.assert_array_equal(remote_test.read(np.array([2, 0])), test[0][[2, 0]])


def test_fashion_mnist_idx_from_s3(object_store, tmp_path):
    rng = np.random.default_rng(1)
    train = (rng.integers(0, 256, (4, 28, 28), dtype=np.uint8), np.array([9, 0, 3, 3], dtype=np.uint8))
    test = (rng.integers(0, 256, (2, 28, 28), dtype=np.uint8), np.array([1, 2], dtype=np.uint8))
    fx.write_fashion_mnist(tmp_path / "local", train, test, gzipped=True)
    uri = f"s3://{object_store}/datasets/fashion"
    assert len(_upload_tree(tmp_path / "local", uri)) == 4  # images + labels, train + t10k, .gz

    remote = load_dataset("fashion_mnist", root=uri)
    local = load_dataset("fashion_mnist", root=str(tmp_path / "local"))
    assert remote.labels.tolist() == [9, 0, 3, 3]
    np.testing.assert_array_equal(remote.labels, local.labels)
    np.testing.assert_array_equal(_all_images(remote)[..., 0], train[0])
    np.testing.assert_array_equal(_all_images(remote), _all_images(local))
    assert load_dataset("fashion_mnist", root=uri, split="test").labels.tolist() == [1, 2]


def test_celeba_text_files_and_jpeg_from_s3(object_store, tmp_path):
    # identities 40 and 7 in train (partition 0), 12 in valid (1), 3 in test (2); two images each
    rows, number = [], 1
    for identity, partition in ((40, 0), (7, 0), (12, 1), (3, 2)):
        for _ in range(2):
            rows.append((f"{number:06d}.jpg", identity, partition, fx.flat_image(COLOURS[identity % 5], (10, 8))))
            number += 1
    fx.write_celeba(tmp_path / "local", rows)
    uri = f"s3://{object_store}/datasets/celeba"
    uploaded = _upload_tree(tmp_path / "local", uri)
    assert {"identity_CelebA.txt", "list_eval_partition.txt", "img_align_celeba/000001.jpg"} <= set(uploaded)

    remote = load_dataset("celeba", root=uri, image_size=8)
    local = load_dataset("celeba", root=str(tmp_path / "local"), image_size=8)
    # train identities sorted (7, 40) -> labels 0, 1; files 1-2 are identity 40, files 3-4 identity 7
    assert remote.identity_ids.tolist() == [7, 40] and remote.labels.tolist() == [1, 1, 0, 0]
    np.testing.assert_array_equal(remote.labels, local.labels)
    pixels = _all_images(remote)
    np.testing.assert_array_equal(pixels, _all_images(local))  # the same JPEG bytes decode to the same pixels
    assert np.abs(pixels[0].astype(int) - COLOURS[40 % 5]).max() <= 3  # flat colour survives JPEG within 3 levels
    remote_test = load_dataset("celeba", root=uri, split="test", image_size=8)
    assert remote_test.identity_ids.tolist() == [3] and len(remote_test) == 2


def test_casia_recordio_rec_idx_from_s3(object_store, tmp_path):
    def png(colour):
        return fx.encode_image(fx.flat_image(colour, (6, 6)), "PNG")

    identities = [[png(COLOURS[0]), png(COLOURS[1])], [png(COLOURS[2])], [png(COLOURS[3]), png(COLOURS[4])]]
    fx.write_insightface_rec(tmp_path / "local" / "faces_webface_112x112", identities)
    uri = f"s3://{object_store}/datasets/casia"
    assert _upload_tree(tmp_path / "local", uri) == ["faces_webface_112x112/train.idx",
                                                     "faces_webface_112x112/train.rec"]

    remote = load_dataset("casia_webface", root=uri, image_size=6)
    local = load_dataset("casia_webface", root=str(tmp_path / "local"), image_size=6)
    assert remote.labels.tolist() == [0, 0, 1, 2, 2] and remote.num_classes == 3
    np.testing.assert_array_equal(remote.labels, local.labels)
    expected = np.stack([fx.flat_image(colour, (6, 6)) for colour in COLOURS])  # PNG payloads decode exactly
    np.testing.assert_array_equal(_all_images(remote), expected)
    np.testing.assert_array_equal(remote.read(np.array([4, 1])), expected[[4, 1]])



def test_lfw_and_casia_folders_from_s3_check_every_image_before_decoding(object_store, tmp_path):
    """The readers list the image tree once (one recursive listing) and refuse a missing or empty object, naming it
    and, for LFW, its pairs.txt line, when the pool is opened; intact data reads as the local copy."""
    people = {"Ann_A": [fx.flat_image(COLOURS[0], (8, 8))] * 2, "Bob_B": [fx.flat_image(COLOURS[1], (8, 8))]}
    fx.write_lfw(tmp_path / "lfw", people, [[("Ann_A", 1, 2)]], [[("Ann_A", 1, "Bob_B", 1)]])
    for identity, colours in (("0000045", COLOURS[:2]), ("0000099", COLOURS[2:3])):
        for k, colour in enumerate(colours):
            fx.write_image(tmp_path / "casia" / "CASIA-WebFace" / identity / f"{k + 1:03d}.jpg",
                           fx.flat_image(colour, (8, 8)))
    lfw, casia = f"s3://{object_store}/datasets/lfw", f"s3://{object_store}/datasets/casia"
    _upload_tree(tmp_path / "lfw", lfw)
    _upload_tree(tmp_path / "casia", casia)
    for name, uri, local in (("lfw", lfw, tmp_path / "lfw"), ("casia_webface", casia, tmp_path / "casia")):
        remote = load_dataset(name, root=uri, split=None, image_size=8)
        here = load_dataset(name, root=str(local), split=None, image_size=8)
        np.testing.assert_array_equal(remote.labels, here.labels)
        np.testing.assert_array_equal(_all_images(remote), _all_images(here))
    cio.write_bytes(f"{lfw}/lfw/Bob_B/Bob_B_0001.jpg", b"")
    with pytest.raises(ValueError, match=rf"image {lfw}/lfw/Bob_B/Bob_B_0001.jpg \(listed in {lfw}/pairs.txt "
                                         rf"line 3\) is empty"):
        load_dataset("lfw", root=lfw, split="pairs", image_size=8)
    fs, path = cio.resolve(f"{lfw}/lfw/Bob_B/Bob_B_0001.jpg")
    fs.delete_file(path)
    with pytest.raises(FileNotFoundError, match=r"Bob_B_0001.jpg \(listed in .*pairs.txt line 3\) does not exist"):
        load_dataset("lfw", root=lfw, split="pairs", image_size=8)
    cio.write_bytes(f"{casia}/CASIA-WebFace/0000099/001.jpg", b"")
    with pytest.raises(ValueError, match=rf"image {casia}/CASIA-WebFace/0000099/001.jpg is empty"):
        load_dataset("casia_webface", root=casia, image_size=8)

def test_external_weights_and_model_round_trip_on_s3(object_store):
    torch.manual_seed(0)
    source = create_model("cnn4", 6, backbone_config={"width": 4})
    payload = safetensors_bytes({name: tensor.contiguous() for name, tensor in source.state_dict().items()})
    digest = hashlib.sha256(payload).hexdigest()
    weights_uri = f"s3://{object_store}/weights/model.safetensors"
    cio.write_bytes(weights_uri, payload)

    torch.manual_seed(1)
    target = create_model("cnn4", 6, backbone_config={"width": 4})
    report = load_external_weights(target, weights_uri, sha256=digest)
    assert report.ok, report.summary()
    assert report.sha256 == digest and report.format == "safetensors"
    assert report.loaded == sorted(source.state_dict())
    for name, tensor in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name
    wrong = "f" * 64
    with pytest.raises(ValueError) as error:
        load_external_weights(target, weights_uri, sha256=wrong)
    assert wrong in str(error.value) and digest in str(error.value)

    model_uri = f"s3://{object_store}/models/cnn4-k6"
    assert save_model(source, model_uri) == model_uri
    assert cio.list_dir(model_uri) == ["config.json", "model.safetensors"]
    reloaded = load_model(model_uri)
    assert (reloaded.config["backbone"], reloaded.config["num_slots"], reloaded.config["backbone_config"]) == \
        ("cnn4", 6, {"width": 4})
    images = torch.randn(3, 3, 32, 32)
    source.eval(), reloaded.eval()
    with torch.no_grad():
        assert torch.equal(source(images).logits, reloaded(images).logits)
        assert torch.equal(source(images).features, reloaded(images).features)

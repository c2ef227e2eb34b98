"""`compat report` / `compare` on ``s3://`` run folders: the run's top-level files (config.yaml, matrix.json,
metrics.json, ...) are read through the standard AWS chain (profile endpoints included) into a private temporary
folder; reports written there go back to the run folder under its lease."""
from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Iterator

from cluster.storage.s3 import configure_object_storage, installed_access
from compat_core import io as cio
from pipelines.results.run_files import CONFIG_FILE, MATRIX_FILE
from pipelines.store.lease import run_lease


def is_remote(location: object) -> bool:
    return str(location).startswith("s3://")


def _configured() -> None:
    if installed_access() is None:
        configure_object_storage()  # S3 settings and credentials from the standard AWS chain


@contextlib.contextmanager
def local_copies(locations: list[str]) -> Iterator[list[Path]]:
    """Local folders for ``locations``: local paths as given, ``s3://`` runs copied (top-level files only: never
    the artifacts) into a temporary folder that is removed afterwards."""
    if not any(is_remote(location) for location in locations):
        yield [Path(location) for location in locations]
        return
    _configured()
    with tempfile.TemporaryDirectory(prefix="compat-run-") as temporary:
        folders = []
        for index, location in enumerate(locations):
            if not is_remote(location):
                folders.append(Path(location))
                continue
            root = str(location).rstrip("/")
            if not cio.is_dir(root):
                raise FileNotFoundError(f"{root}: not a run folder (nothing there; expected the run directory "
                                        f"written by `compat run`)")
            names = [name for name in cio.list_dir(root) if not cio.is_dir(cio.join(root, name))]
            parent = variant_parent(root, names)
            if parent is None:
                local = Path(temporary) / str(index) / root.rsplit("/", 1)[-1]
            else:  # the run's config.yaml one level up, where the report reader looks for it
                local = Path(temporary) / str(index) / parent.rsplit("/", 1)[-1] / root.rsplit("/", 1)[-1]
                local.parent.mkdir(parents=True)
                (local.parent / CONFIG_FILE).write_bytes(cio.read_bytes(cio.join(parent, CONFIG_FILE)))
            local.mkdir(parents=True)
            for name in names:
                (local / name).write_bytes(cio.read_bytes(cio.join(root, name)))
            folders.append(local)
        yield folders


def variant_parent(root: str, names: list[str] | None = None) -> str | None:
    """The run folder of an ``s3://`` ``compat eval`` variant folder (``RUN/eval-*/``: matrix.json, no config.yaml,
    the run's config.yaml one level up), else None. names: the files directly in ``root``, when already listed."""
    names = cio.list_dir(root) if names is None else names
    if CONFIG_FILE in names or MATRIX_FILE not in names or not cio.S3Uri.parse(root).key:
        return None
    parent = root.rsplit("/", 1)[0]
    return parent if cio.exists(cio.join(parent, CONFIG_FILE)) else None


def upload_reports(location: str, paths: dict) -> dict:
    """Copy written report files back to the ``s3://`` run folder, holding its lease (a running driver's folder is
    refused); returns the uploaded URIs by the same keys."""
    root = str(location).rstrip("/")
    uploaded = {}
    with run_lease(variant_parent(root) or root):  # a variant folder lies inside its run: the run's lease
        for key, path in paths.items():
            uploaded[key] = cio.join(root, Path(path).name)
            cio.write_bytes(uploaded[key], Path(path).read_bytes())
    return uploaded


__all__ = ["is_remote", "local_copies", "upload_reports", "variant_parent"]

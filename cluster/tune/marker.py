"""The marker of a search folder (``compat-tune.json``): it says `compat tune` created the folder and pins what
``--resume`` reads before it unpickles anything: ``search.json`` and Ray Tune's ``tuner.pkl``, each by an
HMAC-SHA256 keyed with a secret of this user (``$COMPAT_HOME/tune-resume.key``, created 0600), so a file planted or
changed in the folder, local or ``s3://``, is refused even by someone who can also rewrite the marker."""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path

from cluster.tracking.store import compat_home
from compat_core import io as cio

SEARCH_FILE = "search.json"
MARKER_FILE = "compat-tune.json"
TUNER_FILE = "tuner.pkl"  # Ray Tune's pickled Tuner, written once when the search starts, unpickled on resume
KEY_FILE = "tune-resume.key"
DIGEST = "hmac-sha256"
UNPINNED_NOTE = (f"{MARKER_FILE} pins {SEARCH_FILE} and {TUNER_FILE} only; Ray Tune's experiment-state and "
                 f"searcher-state files, which Tune rewrites while the search runs, are not pinned and are unpickled "
                 f"too, so resume only a folder that nobody else can write")


def resume_key() -> bytes:
    """This user's secret for search markers (32 random bytes, created once, mode 0600)."""
    path = compat_home() / KEY_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process created it in between
            return path.read_bytes()
        with os.fdopen(handle, "wb") as out:
            out.write(secrets.token_bytes(32))
    return path.read_bytes()


def file_digest(data: bytes) -> str:
    """The marker's digest of a file's bytes: HMAC-SHA256 with :func:`resume_key` (hex)."""
    return hmac.new(resume_key(), data, hashlib.sha256).hexdigest()


def write_marker(experiment_path: str, search_bytes: bytes) -> None:
    """The marker of a new search folder, pinning its ``search.json``."""
    marker = {"created_by": "compat tune", "digest": DIGEST, "search": file_digest(search_bytes)}
    cio.write_bytes(cio.join(str(experiment_path), MARKER_FILE), json.dumps(marker).encode("utf-8"))


def seal_tuner_state(experiment_path: str) -> None:
    """Pin ``tuner.pkl`` (written by ``tune.Tuner(...)``, before any trial) in the marker."""
    marker_uri = cio.join(str(experiment_path), MARKER_FILE)
    marker = json.loads(cio.read_bytes(marker_uri).decode("utf-8"))
    marker["tuner"] = file_digest(cio.read_bytes(cio.join(str(experiment_path), TUNER_FILE)))
    cio.write_bytes(marker_uri, json.dumps(marker).encode("utf-8"))


def check_marker(experiment_path: str) -> None:
    """Refuse, before anything in it is read or unpickled, a folder that `compat tune` did not create or whose
    ``search.json`` or ``tuner.pkl`` is not the one it pinned. PermissionError naming the folder and the file."""
    marker_uri = cio.join(str(experiment_path), MARKER_FILE)
    search_uri = cio.join(str(experiment_path), SEARCH_FILE)
    tuner_uri = cio.join(str(experiment_path), TUNER_FILE)
    missing = [name for name, uri in ((MARKER_FILE, marker_uri), (SEARCH_FILE, search_uri)) if not cio.exists(uri)]
    if missing:
        raise PermissionError(f"--resume {experiment_path}: {' and '.join(missing)} missing there; only a folder "
                              f"created by `compat tune` can be resumed (resuming unpickles its Tune state)")
    try:
        marker = json.loads(cio.read_bytes(marker_uri).decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        marker = {}
    if not isinstance(marker, dict) or marker.get("created_by") != "compat tune" or marker.get("digest") != DIGEST:
        raise PermissionError(f"--resume {experiment_path}: {MARKER_FILE} is not a marker written by this version "
                              f"of `compat tune`; the folder is not resumed")
    pinned = [(SEARCH_FILE, search_uri, "search")]
    if cio.exists(tuner_uri):
        pinned.append((TUNER_FILE, tuner_uri, "tuner"))
    for name, uri, field_name in pinned:
        if not hmac.compare_digest(file_digest(cio.read_bytes(uri)), str(marker.get(field_name, ""))):
            raise PermissionError(
                f"--resume {experiment_path}: {name} does not match its {DIGEST} in {MARKER_FILE} (keyed with "
                f"{Path(compat_home(), KEY_FILE)}): it changed or appeared after `compat tune` wrote it, or the "
                f"search was started by another user or machine; nothing in the folder is unpickled and it is not "
                f"resumed ({UNPINNED_NOTE})")


__all__ = ["KEY_FILE", "MARKER_FILE", "SEARCH_FILE", "TUNER_FILE", "check_marker", "file_digest", "resume_key",
           "seal_tuner_state", "write_marker"]

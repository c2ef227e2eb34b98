"""Where external weights come from, without torch: URI scheme resolvers (``register_uri_resolver("models", fn)``:
the cluster layer maps MLflow ``models:/`` and ``runs:/`` URIs to local files; compat_core never imports mlflow), the
file a source names (:func:`resolve_weights_source`) and its content digest (:func:`sha256_of`). Stage keys and
preflight checks use these before any model is built; :mod:`compat_core.models.weights` loads the tensors."""
from __future__ import annotations

import hashlib
import os
import re
from typing import Callable

from compat_core import io as cio

_URI_RESOLVERS: dict[str, Callable[[str], str]] = {}
_HASH_CHUNK = 1 << 22


def register_uri_resolver(scheme: str, resolver: Callable[[str], str]) -> None:
    """Let ``load_external_weights`` accept ``scheme:...`` URIs; ``resolver(uri)`` returns a local file or folder."""
    if not isinstance(scheme, str) or not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
        raise ValueError(f"scheme must be a lower-case URI scheme such as 'models', got {scheme!r}")
    if scheme in ("s3", "file"):
        raise ValueError(f"scheme {scheme!r} is handled by compat_core.io and cannot be overridden")
    if not callable(resolver):
        raise TypeError(f"resolver for {scheme!r} must be callable (uri -> local path)")
    _URI_RESOLVERS[scheme] = resolver


def sha256_of(uri: str) -> str:
    """Hex SHA-256 of a local file or object-store object, streamed in 4 MiB chunks."""
    digest = hashlib.sha256()
    with cio.open_input(uri) as handle:
        while True:
            chunk = handle.read(_HASH_CHUNK)
            if not chunk:
                break
            digest.update(chunk)
    return digest.hexdigest()


def resolve_weights_source(source: str) -> str:
    """The file ``source`` names: a registered scheme resolver applied, a folder descended into its weights file;
    FileNotFoundError / ValueError naming it otherwise."""
    text = os.fspath(source)
    scheme, sep, _ = text.partition(":")
    if sep and scheme in _URI_RESOLVERS:
        text = os.fspath(_URI_RESOLVERS[scheme](text))
    elif sep and re.fullmatch(r"[a-z][a-z0-9+.-]+", scheme) and scheme not in ("s3", "file"):
        known = ", ".join(sorted(_URI_RESOLVERS)) or "none registered"
        raise ValueError(f"no resolver for URI scheme {scheme!r} in {text!r} (registered: {known}; "
                         "built in: local paths, file://, s3://)")
    if not cio.exists(text):
        raise FileNotFoundError(f"weights source not found: {text}")
    if not cio.is_remote(text) and not cio.is_dir(text) and not os.path.isfile(cio.resolve(text)[1]):
        # a device (/dev/zero), FIFO or socket never ends: refused before a byte is read
        raise ValueError(f"weights source {text} is not a regular file (a device, FIFO or socket)")
    if cio.is_dir(text):
        names = cio.list_dir(text)
        candidates = [n for n in ("model.safetensors", "pytorch_model.bin", "model.pt", "model.pth") if n in names]
        candidates += sorted(n for n in names if n.endswith(".safetensors") and n not in candidates)
        if not candidates:
            raise FileNotFoundError(f"folder {text} holds no weights file (expected model.safetensors or "
                                    f"*.safetensors, pytorch_model.bin, model.pt/.pth); found {names[:20]}")
        text = cio.join(text, candidates[0])
    return text


__all__ = ["register_uri_resolver", "resolve_weights_source", "sha256_of"]

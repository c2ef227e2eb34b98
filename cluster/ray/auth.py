"""Ray 2.60 token authentication on the client side (``compat submit`` / ``status`` / ``logs`` / ``run --address``).

A head started with ``RAY_AUTH_MODE=token`` (or a plain ``ray start --head`` on a machine that has a token in
``~/.ray/auth_token``) answers every job-API request without the token with 401. Ray's clients send the token only
when ``RAY_AUTH_MODE=token`` is set in the *client's* environment, which a user who never started the head that way
does not have. This module enables token mode for this process when a token is available in one of Ray's standard
places (``RAY_AUTH_TOKEN``, the file named by ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``) or given with
``--ray-token-file``; Ray's own client then adds the ``Authorization`` header. The token itself is never read into
this module's variables, printed, logged or forwarded to a job.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.error import URLError
from urllib.request import urlopen

MODE_VARIABLE = "RAY_AUTH_MODE"
TOKEN_VARIABLE = "RAY_AUTH_TOKEN"
TOKEN_PATH_VARIABLE = "RAY_AUTH_TOKEN_PATH"


def default_token_path() -> Path:
    """Ray's standard token file, ``~/.ray/auth_token`` (what ``ray get-auth-token --generate`` writes)."""
    return Path.home() / ".ray" / "auth_token"


def token_source() -> str | None:
    """Where a token is available to Ray's client, as words (never the token), or None."""
    if os.environ.get(TOKEN_VARIABLE):
        return f"${TOKEN_VARIABLE}"
    path = os.environ.get(TOKEN_PATH_VARIABLE)
    if path and Path(path).is_file():
        return f"{path} (${TOKEN_PATH_VARIABLE})"
    if default_token_path().is_file():
        return str(default_token_path())
    return None


def prepare_client_auth(token_file: str | None = None) -> str | None:
    """Make this process's Ray clients authenticate when a token is available; returns where it comes from.

    token_file: a file holding the token (``--ray-token-file``): it must exist; it becomes ``RAY_AUTH_TOKEN_PATH``.
    An explicit ``RAY_AUTH_MODE`` (e.g. ``disabled``) is respected unless a token file is given."""
    if token_file:
        path = Path(token_file).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"--ray-token-file {token_file}: no such file (the token of the cluster, as "
                                    f"written by `ray get-auth-token --generate` on the head)")
        os.environ[TOKEN_PATH_VARIABLE] = str(path)
        _set_mode("token")
        return str(path)
    if os.environ.get(MODE_VARIABLE):
        return token_source() if os.environ[MODE_VARIABLE].lower() == "token" else None
    source = token_source()
    if source is not None:
        _set_mode("token")
    return source


def _set_mode(mode: str) -> None:
    os.environ[MODE_VARIABLE] = mode
    try:  # Ray caches its config in the C++ layer: refresh it so this process sees the mode (as Ray itself does)
        from ray._raylet import Config

        Config.initialize("")
    except ImportError:  # a minimal client install without the raylet reads the variable directly
        pass


def head_requires_token(dashboard_url: str, timeout_s: float = 5.0) -> bool | None:
    """True / False when the head's public ``/api/authentication_mode`` says token / disabled; None when unknown."""
    try:
        with urlopen(dashboard_url.rstrip("/") + "/api/authentication_mode", timeout=timeout_s) as response:
            mode = json.loads(response.read().decode()).get("authentication_mode", "")
    except (URLError, OSError, ValueError, AttributeError):
        return None
    return str(mode).lower() == "token"


def require_token_if_needed(dashboard_url: str, source: str | None) -> None:
    """Raise PermissionError with the fix when the head wants a token and none is available here."""
    if source is None and os.environ.get(MODE_VARIABLE, "").lower() != "token" \
            and head_requires_token(dashboard_url):
        raise PermissionError(
            f"the Ray head at {dashboard_url} requires token authentication and no token is available here; copy "
            f"the cluster's token (on the head: `ray get-auth-token`) into {default_token_path()} (mode 600), or "
            f"give --ray-token-file FILE, or set {TOKEN_PATH_VARIABLE}=FILE (see docs/cluster.md)")


__all__ = ["default_token_path", "head_requires_token", "prepare_client_auth", "require_token_if_needed",
           "token_source"]

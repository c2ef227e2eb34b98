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
import stat
import sys
from pathlib import Path
from typing import Callable
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


def _note(line: str) -> None:
    print(line, file=sys.stderr)


def create_token_file(path: Path) -> Path:
    """A new token (Ray's own generator) in ``path``, created mode 0600 whatever the umask (its folder 0700 when
    created here); FileExistsError when another process created it first."""
    from ray._private.authentication.authentication_token_generator import generate_new_authentication_token

    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(generate_new_authentication_token())
    return path


def secure_token_file(path: Path, log: Callable[[str], None] = _note) -> None:
    """A token file other users can read: made 0600 (said through ``log``) when it is this user's, else refused
    (PermissionError naming the file, its owner and mode, and the fix). Never reads the token."""
    info = path.stat()
    if not info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        return
    mode = stat.filemode(info.st_mode)
    if info.st_uid == os.getuid():
        path.chmod(0o600)
        log(f"note: the Ray token file {path} was readable by other users ({mode}); made it 0600 (owner only)")
        return
    raise PermissionError(f"the Ray token file {path} belongs to uid {info.st_uid}, not to you (uid {os.getuid()}), "
                          f"and other users can read it ({mode}); it is not used: have its owner run chmod 600 on "
                          f"it, or point {TOKEN_PATH_VARIABLE} at a token file only you can read")


def token_for_embedded_ray(log: Callable[[str], None] = _note) -> None:
    """Before this process starts an embedded Ray: in token mode (Ray's default when ``RAY_AUTH_MODE`` is unset)
    Ray writes a missing ``~/.ray/auth_token`` with the umask's mode (0644), so it is created here first, 0600;
    an existing one readable by others is secured (:func:`secure_token_file`)."""
    if os.environ.get(MODE_VARIABLE, "token").lower() == "token":
        prepare_token_file(log)


def prepare_token_file(log: Callable[[str], None] = _note) -> None:
    """The token file Ray will read (``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``) secured, or the default
    one created 0600 when there is none; nothing when the token comes from ``RAY_AUTH_TOKEN``."""
    if os.environ.get(TOKEN_VARIABLE):
        return
    named = os.environ.get(TOKEN_PATH_VARIABLE)
    path = Path(named).expanduser() if named else default_token_path()
    if path.is_file():
        secure_token_file(path, log)
    elif not named:
        try:
            create_token_file(path)
        except FileExistsError:  # created by another process in between
            secure_token_file(path, log)


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


__all__ = ["create_token_file", "default_token_path", "head_requires_token", "prepare_client_auth",
           "prepare_token_file", "require_token_if_needed", "secure_token_file", "token_for_embedded_ray", "token_source"]

"""One place that keeps credentials out of what is printed, logged or stored: URIs with ``user:password@``."""
from __future__ import annotations

import re

_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^/@:\s]*):(?P<password>[^/@\s]*)@")
REDACTED = "***"


def redact_uri(text: object) -> str:
    """``text`` with the password of every ``scheme://user:password@host`` replaced by ``***`` (user kept)."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", str(text))


def split_uri_credentials(uri: str) -> tuple[str, str | None, str | None]:
    """(URI without ``user:password@``, user, password); user and password None when the URI has none."""
    match = _USERINFO.search(uri or "")
    if match is None:
        return uri, None, None
    return uri[: match.start()] + match["scheme"] + uri[match.end():], match["user"], match["password"]


__all__ = ["REDACTED", "redact_uri", "split_uri_credentials"]

"""Config -> MLflow params with secrets left out: dot-key flattening, credential detection and MLflow's value limit."""
from __future__ import annotations

import json
import re
from typing import Any

SECRET_KEY_PATTERN = re.compile(r"secret|password|passwd|token|access_key|secret_key|credential|api_key|private_key",
                                re.IGNORECASE)
_SECRET_VALUE_PATTERNS = (
    re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),                          # AWS access key id
    re.compile(r"^[a-z][a-z0-9+.-]*://[^/@:\s]+:[^/@\s]+@"),              # URL with user:password@
    re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\."),           # JWT
    re.compile(r"\b(ghp|gho|ghu|ghs|github_pat|hf|sk|xox[abprs])[_-][A-Za-z0-9_-]{16,}"),  # common API tokens
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
)
_HIGH_ENTROPY = re.compile(r"^[A-Za-z0-9+/=_-]{32,}$")
MAX_PARAM_VALUE = 6000  # characters MLflow 3 accepts for a param value


def looks_like_secret(value: Any) -> bool:
    """True for strings shaped like credentials (AWS key ids, URLs with a password, JWTs, API tokens, private keys,
    or 32+ characters of base64 mixing upper case, lower case and digits; lower-case hex digests are not secrets)."""
    if not isinstance(value, str):
        return False
    if any(pattern.search(value) for pattern in _SECRET_VALUE_PATTERNS):
        return True
    return bool(_HIGH_ENTROPY.match(value) and re.search(r"[A-Z]", value) and re.search(r"[a-z]", value)
                and re.search(r"[0-9]", value))


def flatten_params(data: dict, prefix: str = "") -> tuple[dict[str, str], list[str]]:
    """Flatten a config dict to ``{"a.b.c": str value}`` (lists of scalars as JSON, lists of dicts by index).

    Returns (params, excluded keys). Excluded: keys matching :data:`SECRET_KEY_PATTERN` anywhere in the dotted
    path and values :func:`looks_like_secret`. Values longer than MLflow's 6000-character limit are truncated.
    """
    if not isinstance(data, dict):
        raise ValueError(f"flatten_params: expected a dict of config sections, got {type(data).__name__}")
    params: dict[str, str] = {}
    excluded: list[str] = []

    def visit(value: Any, key: str) -> None:
        if SECRET_KEY_PATTERN.search(key):
            excluded.append(key)
            return
        if isinstance(value, dict):
            if not value:
                params[key] = "{}"
            for child, item in value.items():
                visit(item, f"{key}.{child}" if key else str(child))
            return
        if isinstance(value, (list, tuple)) and any(isinstance(item, (dict, list, tuple)) for item in value):
            for index, item in enumerate(value):
                visit(item, f"{key}.{index}")
            return
        if isinstance(value, (list, tuple)):
            if any(looks_like_secret(item) for item in value):
                excluded.append(key)
                return
            text = json.dumps(list(value))
        elif looks_like_secret(value):
            excluded.append(key)
            return
        elif value is None:
            return  # unset options are not params (MLflow shows no "None" noise; defaults are in config.yaml)
        else:
            text = str(value)
        params[key] = text if len(text) <= MAX_PARAM_VALUE else text[: MAX_PARAM_VALUE - 3] + "..."

    visit(data, prefix)
    return params, excluded


__all__ = ["MAX_PARAM_VALUE", "SECRET_KEY_PATTERN", "flatten_params", "looks_like_secret"]

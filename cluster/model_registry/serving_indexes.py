"""Which gallery indexes a registered model's versions serve: ``compat index build`` records each index root it
commits as a registered-model tag, so a rollback checks the target against every index the model is known to serve
without the user having to name them (``compat gate rollback --index`` adds more)."""
from __future__ import annotations

import hashlib
import os
from typing import Any

INDEX_TAG_PREFIX = "serving_index."


def index_location(root: str) -> str:
    """The root as recorded: s3:// URIs as given, local paths absolute."""
    text = str(root)
    return text if "://" in text else os.path.abspath(text)


def record_serving_index(client: Any, model: str, root: str) -> str:
    """Tag registered model ``model`` with the index at ``root`` (key ``serving_index.<sha256[:12] of the
    location>``); returns the recorded location."""
    location = index_location(root)
    key = INDEX_TAG_PREFIX + hashlib.sha256(location.encode("utf-8")).hexdigest()[:12]
    client.set_registered_model_tag(model, key, location)
    return location


def recorded_indexes(client: Any, model: str) -> list[str]:
    """The index locations recorded for registered model ``model``, sorted."""
    tags = client.get_registered_model(model).tags or {}
    return sorted(value for key, value in tags.items() if key.startswith(INDEX_TAG_PREFIX))


__all__ = ["INDEX_TAG_PREFIX", "index_location", "record_serving_index", "recorded_indexes"]

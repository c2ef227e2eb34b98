"""The one family of integrity errors: stored content that differs from what was recorded about it (a manifest, a
HEAD pointer, a content hash, a size, a row count) or that is missing although recorded. Run-store blobs, replay
shards, ingested dataset shards and gallery indexes all raise :class:`IntegrityError`; the command line turns one
that names its pipeline stage into the ``--recompute`` fix."""
from __future__ import annotations

import os
from typing import Any

from compat_core.io import S3Uri, is_s3


class IntegrityError(IOError):
    """Stored content that does not match its record. The message names the file (bucket and key on S3), what was
    expected and what was found.

    Attributes: ``uri`` of the file (None when only the message names it), ``bucket`` (None for a local file) and
    ``key`` (the local path for a local file), ``field`` checked, ``expected`` and ``actual`` values (None when not
    given), ``stage_key``: the committed pipeline stage the content belongs to, when known (``compat run --resume
    RUN_DIR --recompute KEY`` redoes it; a reader that knows the stage sets it before re-raising).
    """

    def __init__(self, message: str, *, uri: str | os.PathLike | None = None, field: str | None = None,
                 expected: Any = None, actual: Any = None, stage_key: str | None = None) -> None:
        super().__init__(message)
        self.uri = None if uri is None else os.fspath(uri)
        location = S3Uri.parse(self.uri) if is_s3(self.uri) else None
        self.bucket = location.bucket if location else None
        self.key = location.key if location else self.uri
        self.field, self.expected, self.actual = field, expected, actual
        self.stage_key = stage_key

    @classmethod
    def mismatch(cls, what: str, uri: str | os.PathLike, field: str, expected: Any, actual: Any,
                 detail: str = "", stage_key: str | None = None) -> "IntegrityError":
        """``<what> <uri> (bucket 'B', key 'K' | local file 'PATH'): <field> expected <expected>, actual <actual>``
        (then ``; <detail>`` when given)."""
        text = os.fspath(uri)
        where = (f"bucket {S3Uri.parse(text).bucket!r}, key {S3Uri.parse(text).key!r}" if is_s3(text)
                 else f"local file {text!r}")
        return cls(f"{what} {text} ({where}): {field} expected {expected}, actual {actual}"
                   + (f"; {detail}" if detail else ""), uri=text, field=field, expected=expected, actual=actual,
                   stage_key=stage_key)


__all__ = ["IntegrityError"]

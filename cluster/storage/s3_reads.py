"""Reads of an S3 object through the filesystem handler of :mod:`cluster.storage.s3`, one request at a time, so
that each says what it waits for and names the endpoint and object when it fails."""
from __future__ import annotations

import functools
from typing import Any


class GuardedReads:
    """An object stream (sequential) or file (``seekable``: random access, as Parquet reads) whose reads go through
    the handler's ``_call``: a stalled read says within 5 s what it waits for (endpoint, bucket/key), ends after the
    configured tries, and its error names the endpoint and the object, like every other request. Seeking only moves
    the position (no request)."""

    def __init__(self, stream, handler: Any, path: str, seekable: bool = False) -> None:
        self.stream, self.handler, self.path, self._seekable = stream, handler, path, seekable

    def read(self, size: int | None = -1) -> bytes:
        whole = size is None or size < 0
        return self.handler._call("reading", self.path, self.stream.read if whole else
                                  functools.partial(self.stream.read, size))

    def read_buffer(self, size: int | None = -1):
        """Like :meth:`read` without a copy (pyarrow's Python file wrapper uses it when present)."""
        whole = size is None or size < 0
        return self.handler._call("reading", self.path, self.stream.read_buffer if whole else
                                  functools.partial(self.stream.read_buffer, size))

    def seek(self, position: int, whence: int = 0) -> int:
        if not self._seekable:
            raise OSError(f"{self.path}: a sequential S3 stream cannot seek")
        return self.stream.seek(position, whence)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self._seekable

    def writable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.stream.tell()

    @property
    def closed(self) -> bool:
        return self.stream.closed

    def close(self) -> None:
        self.stream.close()


__all__ = ["GuardedReads"]

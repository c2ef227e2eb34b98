"""A gallery's per-row strings (item ids, payload URIs) held compactly: one Arrow string array in gallery position
order, its UTF-8 bytes plus one offset a row (4 bytes, 8 past 2 GiB of text), instead of a fixed-width numpy
unicode array (4 bytes a character of the longest string, every row) or one Python object a row. A value is
decoded only when it is read: a search decodes the ids of the k rows it answers.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["StringColumn", "gather_strings"]

_STRING_LIMIT = 2 ** 31 - 1     # bytes of text an Arrow ``string`` array (int32 offsets) can hold


class StringColumn:
    """(N,) strings (or None) in position order. ``column[i]`` is a str (None where null); ``column[rows]`` for an
    integer array or a slice is an object array of them; ``tolist()`` all of them."""

    def __init__(self, array: pa.Array | None, size: int) -> None:
        if array is not None and len(array) != size:
            raise ValueError(f"string column: {len(array)} values for {size} rows")
        # a column of nulls only holds nothing a row
        self._array = None if array is None or array.null_count == size else array
        self._size = int(size)

    def __len__(self) -> int:
        return self._size

    @property
    def shape(self) -> tuple[int]:
        return (self._size,)

    @property
    def nbytes(self) -> int:
        """Bytes of the Arrow buffers held (offsets, text, validity)."""
        return 0 if self._array is None else int(self._array.nbytes)

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            position = int(key)
            if not -self._size <= position < self._size:
                raise IndexError(f"position {position} outside a column of {self._size} rows")
            return None if self._array is None else self._array[position % self._size].as_py()
        rows = np.arange(self._size)[key] if isinstance(key, slice) else np.asarray(key, dtype=np.int64)
        if rows.ndim != 1:
            raise IndexError(f"rows: expected one dimension, got shape {rows.shape}")
        if rows.size and (rows.min() < -self._size or rows.max() >= self._size):
            raise IndexError(f"rows outside a column of {self._size} rows")
        out = np.empty(rows.size, dtype=object)
        if self._array is not None and rows.size:
            out[:] = self._array.take(pa.array(rows % self._size)).to_pylist()
        return out

    def tolist(self) -> list:
        return [None] * self._size if self._array is None else self._array.to_pylist()


def gather_strings(chunks: list[pa.Array], source: np.ndarray) -> pa.Array:
    """One string array whose row i is row ``source[i]`` of the chunks laid end to end (``source``: int64 rows of
    that concatenation); a large_string array when the text passes what int32 offsets address."""
    if not chunks:
        return pa.array([], pa.string())
    text = sum(int(chunk.nbytes) for chunk in chunks)
    if text > _STRING_LIMIT or any(chunk.type != pa.string() for chunk in chunks):
        chunks = [chunk.cast(pa.large_string()) for chunk in chunks]
    joined = pa.concat_arrays(chunks)
    if source.size == len(joined) and np.array_equal(source, np.arange(source.size)):
        return joined            # shards in position order, none overriding another: nothing to move
    return pc.take(joined, pa.array(source, pa.int64()))

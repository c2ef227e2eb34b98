"""Input checks shared across compat_core: each raises ValueError naming the field and what was expected.

Every helper takes the field's name first, so the message says which argument was wrong; numpy integer scalars
count as integers, ``bool`` never does (``True`` is an ``int`` in Python but never a meaningful count).
"""
from __future__ import annotations

import numbers
import sys
from typing import Iterable

import numpy as np


def check_int(name: str, value, minimum: int, maximum: int | None = None) -> int:
    """``value`` as a Python int when it is an integer in ``[minimum, maximum]`` (``maximum`` None: no upper bound).

    Raises ValueError ``"<name> must be an integer >= <minimum>..., got <value>"`` for a non-integer and
    ``"<name> must be >= <minimum>[ and <= <maximum>], got <value>"`` for an integer out of range.
    """
    bounds = f" >= {minimum}" + ("" if maximum is None else f" and <= {maximum}")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer{bounds}, got {value!r}")
    value = int(value)
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be{bounds}, got {value}")
    return value


def as_int_vector(name: str, values, items: str = "integers") -> np.ndarray:
    """``values`` as an int64 array of shape ``(N,)``; an empty input of any dtype gives an empty vector.

    ``items`` describes the entries in the messages (e.g. ``"integer class ids"``). Raises ValueError for any other
    number of dimensions or a non-integer dtype (floats are refused even when whole, so no id is silently rounded).
    """
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of {items}, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must hold {items}, got dtype {array.dtype}")
    return array.astype(np.int64)


def as_label_array(name: str, labels: Iterable[int] | np.ndarray) -> np.ndarray:
    """0-based class labels (any iterable, numpy array or torch tensor of any shape) flattened to int64 ``(N,)``.

    Raises ValueError naming ``name`` for a non-integer dtype or a negative label (listing the negatives).
    """
    torch = sys.modules.get("torch")  # a tensor exists only once torch is imported: this module never imports it
    if torch is not None and isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    array = np.asarray(list(labels) if not isinstance(labels, np.ndarray) else labels)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must be integer class labels, got dtype {array.dtype}")
    if array.min() < 0:
        negatives = sorted(set(array[array < 0].tolist()))
        raise ValueError(f"{name} must be 0-based non-negative class labels, got {negatives}")
    return array.astype(np.int64).reshape(-1)


__all__ = ["as_int_vector", "as_label_array", "check_int"]

"""Row reductions (sums, norms) that give identical rows bit-identical results on every device, which exact ties
need: the lowest index wins only when tied rows score exactly alike.

Two things can make a device reduce two identical rows differently. CUDA's reduction kernels split each row among
threads by the alignment of the row's address, so with a row length that is not a multiple of the vector width
(1023 fp64 values: rows start 8 bytes apart modulo 32) identical rows at different offsets are summed in different
orders. And the thread layout of a launch follows its shape, so rows reduced in launches of different shapes can
also differ. :func:`aligned_rows` pads rows with zeros to a multiple of 8 elements (adding an exact zero changes no
sum); :func:`same_shape_blocks` covers a range with blocks of one shape. A CPU reduces every row from its first
element whatever its address, so rows there are used as they are."""
from __future__ import annotations

import torch

ALIGN_ELEMENTS = 8   # 64 bytes of fp64, 32 of fp32: every row of a padded matrix starts on a vector boundary


def aligned_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (N, D) where a reduction along dim 1 runs the same arithmetic on every row: on an accelerator a
    zero-padded copy of D rounded up to a multiple of 8 when D is not one (or the rows are not contiguous); on the
    CPU ``rows`` itself."""
    dim = rows.shape[1]
    if rows.device.type == "cpu" or (dim % ALIGN_ELEMENTS == 0 and rows.is_contiguous()):
        return rows
    padded = torch.zeros((rows.shape[0], -(-dim // ALIGN_ELEMENTS) * ALIGN_ELEMENTS), dtype=rows.dtype,
                         device=rows.device)
    padded[:, :dim] = rows
    return padded


def same_shape_blocks(count: int, block: int, device: torch.device | None = None) -> list[int]:
    """Starts of blocks of ``min(block, count)`` rows covering rows 0..count-1, the last overlapping its
    predecessor, so every block has one shape (rows in the overlap are computed twice, identically); a block ends
    at ``min(count, start + block)``. With a CPU ``device``: consecutive blocks, the last one shorter (a CPU
    reduces rows alike in launches of any shape, and the overlap would be work for nothing)."""
    if count <= block:
        return [0]
    if device is not None and torch.device(device).type == "cpu":
        return list(range(0, count, block))
    starts = list(range(0, count - block + 1, block))
    return starts if starts[-1] == count - block else [*starts, count - block]

"""compat_core.retrieval.row_reduction: blocks of one shape covering a range, and rows padded for alike reductions."""
from __future__ import annotations

import pytest
import torch

from compat_core.retrieval.row_reduction import aligned_rows, same_shape_blocks


@pytest.mark.parametrize("count, block, device, starts", [
    (5, 8, None, [0]),                       # one block of the whole range
    (8, 8, None, [0]),
    (10, 4, None, [0, 4, 6]),                # the last block overlaps its predecessor: every block holds 4 rows
    (12, 4, None, [0, 4, 8]),
    (10, 4, "cuda", [0, 4, 6]),
    (10, 4, "cpu", [0, 4, 8]),               # the CPU: consecutive, the last one shorter
])
def test_same_shape_blocks_cover_the_range(count, block, device, starts):
    assert same_shape_blocks(count, block, device) == starts
    covered = set()
    for start in starts:
        stop = min(count, start + block)
        if device != "cpu":
            assert stop - start == min(count, block)
        covered |= set(range(start, stop))
    assert covered == set(range(count))


def test_aligned_rows_leave_cpu_rows_as_they_are():
    rows = torch.randn(5, 1023, dtype=torch.float64)
    assert aligned_rows(rows) is rows


@pytest.mark.parametrize("dim, padded", [(1023, 1024), (1017, 1024), (64, 64), (3, 8)])
def test_aligned_rows_pad_accelerator_rows_to_whole_vectors(dim, padded):
    rows = torch.empty(7, dim, device="meta")     # an accelerator's tensor without one: the layout alone
    out = aligned_rows(rows)
    assert out.shape == (7, padded)
    assert (out is rows) == (dim == padded)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.cuda
def test_aligned_rows_on_cuda_keep_values_and_sums_of_identical_rows_equal():
    row = torch.randn(1, 1023, dtype=torch.float64, device="cuda")
    rows = row.repeat(64, 1)                      # the same values at 64 offsets: every alignment
    out = aligned_rows(rows)
    assert torch.equal(out[:, :1023], rows) and not out[:, 1023:].any()
    sums = out.sum(dim=1)
    assert bool((sums == sums[0]).all())

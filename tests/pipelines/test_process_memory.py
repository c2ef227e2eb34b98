"""Host memory between stages (pipelines.engine.process_memory): the peak restarts per stage, large freed blocks go back to
the OS. Each case runs in a fresh interpreter so that the allocator starts in its default state."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# 20 MB blocks after one 30 MB block was freed: glibc's dynamic threshold (raised to 30 MB by that free) serves them
# from the heap; a 64 KB block kept after each of them pins the heap, so freeing them cannot shrink it by itself.
# The fixed threshold (1 MiB) maps each of them on its own.
FRAGMENTED_HEAP = """
import json, sys
import numpy as np
from pipelines.engine import process_memory as pm
limit = sys.argv[1] == "limit"
if limit:
    pm.limit_heap_caching()
big = np.ones(30 << 20, np.uint8); del big
before = pm.resident_bytes()
blocks, pins = [], []
for _ in range(8):
    blocks.append(np.ones(20 << 20, np.uint8))
    pins.append(np.ones(64 << 10, np.uint8))
grown = pm.resident_bytes()
del blocks
freed = pm.resident_bytes()
pm.release_freed_memory()
print(json.dumps({"before": before, "grown": grown, "freed": freed, "released": pm.resident_bytes()}))
"""

PEAK = """
import json
import numpy as np
from pipelines.engine import process_memory as pm
start = pm.resident_bytes()
block = np.ones(200 << 20, np.uint8); del block
high = pm.peak_resident_bytes()
reset = pm.reset_peak()
print(json.dumps({"start": start, "high": high, "reset": reset, "after_reset": pm.peak_resident_bytes(),
                  "now": pm.resident_bytes()}))
"""


def _run(code: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="procfs and glibc")
def test_large_freed_blocks_return_to_the_os():
    mb = 1 << 20
    default = _run(FRAGMENTED_HEAP, "default")
    limited = _run(FRAGMENTED_HEAP, "limit")
    for case in (default, limited):
        assert case["grown"] - case["before"] >= 150 * mb  # 160 MB touched
    # glibc's default keeps the freed 20 MB blocks resident (heap below a pinned top) ...
    assert default["freed"] - default["before"] >= 120 * mb
    # ... and malloc_trim hands them back between stages
    assert default["released"] - default["before"] <= 24 * mb
    # with the fixed threshold each block was a mapping of its own: gone as soon as it is freed
    assert limited["freed"] - limited["before"] <= 24 * mb


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="procfs")
def test_peak_restarts_at_the_current_size():
    mb = 1 << 20
    case = _run(PEAK)
    assert case["high"] - case["start"] >= 190 * mb  # the 200 MB block touched once
    assert case["reset"] is True
    # after the reset the peak is the resident size again, not the 200 MB block's
    assert case["after_reset"] - case["now"] <= 8 * mb
    assert case["high"] - case["after_reset"] >= 150 * mb

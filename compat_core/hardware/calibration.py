"""Measured speed of the arithmetic paths this machine offers, instead of guessing from CPU flags.

Machines differ in ways flags do not predict: a CPU with AVX512-BF16 but no AMX may run bf16 matrix products 4x
faster than fp32 (AMD Zen 4) or slower than fp32 (some Xeons), and int8 ``torch._int_mm`` may beat both. So the
candidates are timed once per machine and device and the result is cached as JSON:

- ``gemm``: GOP/s of one matrix product at a retrieval chunk shape (1024 queries x 1024 dims x 8192 gallery rows)
  in fp32, bf16, fp16 and int8 (``torch._int_mm``, exact int32 accumulation). The retrieval kernel's
  ``precision="auto"`` runs its candidate pass in the fastest (``fastest_matmul``).
- ``workloads``: seconds per step of a given model on a given batch shape, fp32 against half-precision autocast
  (bf16; fp16 on CUDA without bf16), for training (forward, backward, SGD step) or inference. ``training.autocast:
  auto`` uses the faster (``autocast_choice`` in :mod:`compat_core.hardware.workloads`); the model is measured
  on a copy, so its weights, its batch-norm statistics and the global RNG state are untouched (results do not
  depend on whether the cache existed).
- ``compile``: seconds of a training step eager and through ``torch.compile`` and the compile time itself
  (``compat_core.hardware.compile_probe``: ``training.compile: auto``).
- ``channels_last``: seconds of a training step of a conv net with contiguous and with channels_last weights and
  batches (``compat_core.hardware.layout_probe``: ``training.channels_last: auto``).

Cache: ``$COMPAT_CALIBRATION_DIR`` or ``$XDG_CACHE_HOME/compat/calibration`` (default ``~/.cache/compat/
calibration``), one file per key (device name, core count, torch threads, torch version, CPU-flag digest). A file
lock serialises measurements, so concurrent processes on one machine measure once and do not time each other.
``COMPAT_CALIBRATION=off`` measures nothing: ``auto`` then means fp32 everywhere (bit-reproducible across
machines; the test suite sets it). ``compat calibrate`` measures and prints; ``compat calibrate --show`` prints.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import functools
import hashlib
import json
import os
import platform
import re
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

__all__ = [
    "CACHE_ENV",
    "MODE_ENV",
    "GEMM_DTYPES",
    "GEMM_SHAPE",
    "cache_dir",
    "cache_path",
    "machine_key",
    "load",
    "gemm_rates",
    "fastest_matmul",
    "workload_signature",
    "cached_measurement",
    "training_signature",
    "calibration_enabled",
    "format_calibration",
]

CACHE_ENV = "COMPAT_CALIBRATION_DIR"
MODE_ENV = "COMPAT_CALIBRATION"
GEMM_DTYPES = ("fp32", "bf16", "fp16", "int8")
GEMM_SHAPE = (1024, 1024, 8192)          # (queries, dims, gallery rows): one chunk of a 50k x 10k x 1023 search
# first try, 1/16 of the full shape: a dtype far slower than fp32 never runs the full shape. Large enough that a
# loaded machine's thread hand-offs do not decide it (at 64 x 1024 x 512, load 4 on 2 cores, bf16 and int8
# measured 8.5 GOP/s, against 100-200 at the full shape)
_PROBE_SHAPE = (256, 1024, 2048)
_PROBE_KEEP = 0.1                        # on the small probe, paths below this fraction of fp32 are not timed further
_FULL_CALL_MAX_S = 1.5                   # nor paths whose probe rate predicts a longer call at the full shape
_ROUNDS = 5                              # interleaved timing rounds; the minimum per path is kept
# spread of a path's timings: (median - minimum) / minimum over the rounds. Above this the machine was too busy for
# the measurement to be trusted as final: it is used (and cached) as provisional and measured again by a process
# that finds it older than _RETRY_S, so a measurement taken while the machine was busy does not stay
_MAX_SPREAD = 0.15
_RETRY_S = 600.0
# a half path must beat fp32 by this factor to be chosen: a near-tie would flip between re-measurements and with
# it the numerics of a run; 2 % keeps "auto" within 2 % of the better path
_HALF_MARGIN = 1.02
_INT8_MARGIN = 1.25                      # int8 products must be this much faster than the best float path
_VERSION = 1


def calibration_enabled() -> bool:
    """False when ``COMPAT_CALIBRATION=off`` (auto precisions mean fp32 and nothing is measured)."""
    value = os.environ.get(MODE_ENV, "on").strip().lower()
    if value not in ("on", "off", ""):
        raise ValueError(f"{MODE_ENV}: expected 'on' or 'off', got {value!r}")
    return value != "off"


def cache_dir() -> Path:
    """The calibration cache folder (``$COMPAT_CALIBRATION_DIR``, else the user's cache folder)."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "compat" / "calibration"


@functools.lru_cache(maxsize=1)
def _cpu_identity() -> tuple[str, str]:
    """(CPU model name, 10-hex digest of its feature flags) from /proc/cpuinfo; platform values elsewhere."""
    name, flags = "", ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as handle:
            for line in handle:
                if not name and line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                elif not flags and line.startswith("flags"):
                    flags = " ".join(sorted(line.split(":", 1)[1].split()))
                if name and flags:
                    break
    except OSError:
        pass
    return name or platform.processor() or platform.machine(), hashlib.sha256(flags.encode()).hexdigest()[:10]


def machine_key(device: torch.device | str = "cpu") -> dict[str, Any]:
    """What a calibration is valid for: device type and name, cores (CPU) or multiprocessors (CUDA), torch threads,
    torch version and (CPU) a digest of the feature flags."""
    device = torch.device(device)
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        return {"device_type": "cuda", "device_name": properties.name, "cores": properties.multi_processor_count,
                "threads": torch.get_num_threads(), "torch": torch.__version__, "flags": ""}
    if device.type != "cpu":
        raise ValueError(f"device: calibration supports cpu and cuda, got {device.type!r}")
    name, flags = _cpu_identity()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"device_type": "cpu", "device_name": name, "cores": cores, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "flags": flags}


def cache_path(device: torch.device | str = "cpu") -> Path:
    """The JSON file holding the calibration of ``device`` under the current key."""
    key = machine_key(device)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", key["device_name"]).strip("-").lower()[:40] or "unknown"
    torch_version = re.sub(r"[^A-Za-z0-9.]+", "-", key["torch"])
    return cache_dir() / (f"{key['device_type']}-{slug}-c{key['cores']}-t{key['threads']}-torch{torch_version}"
                          f"{'-' + key['flags'] if key['flags'] else ''}.json")


def load(device: torch.device | str = "cpu") -> dict[str, Any] | None:
    """The cached calibration of ``device`` (None when there is none or it is unreadable/of another version)."""
    path = cache_path(device)
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(document, dict) or document.get("version") != _VERSION:
        return None
    return document


@contextlib.contextmanager
def _locked(device: torch.device | str):
    """Exclusive lock of this key's cache file (other processes wait instead of timing each other)."""
    path = cache_path(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield path
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cached_measurement(device: torch.device | str, section: str, name: str, valid: Callable[[Any], bool],
                       measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The entry ``name`` of ``section`` in this machine's cache when ``valid(entry)``, else ``measure()`` run under
    the cache's lock (once: a process that waited for the lock finds the other's entry) and stored."""
    def cached() -> dict[str, Any] | None:
        entry = ((load(device) or {}).get(section) or {}).get(name)
        return entry if isinstance(entry, dict) and valid(entry) else None

    entry = cached()
    if entry is None:
        with _locked(device):
            entry = cached()
            if entry is None:
                entry = measure()
                _update(device, section, name, entry)
    return entry


def _update(device: torch.device | str, section: str, name: str | None, value: dict[str, Any]) -> None:
    """Merge one measured section into the cache file (caller holds the lock); atomic replace."""
    path = cache_path(device)
    document = load(device) or {"version": _VERSION, "key": machine_key(device), "gemm": None, "workloads": {}}
    if name is None:
        document[section] = value
    else:
        document.setdefault(section, {})[name] = value
    temporary = path.with_suffix(f".tmp{os.getpid()}")
    temporary.write_text(json.dumps(document, indent=2, sort_keys=True))
    os.replace(temporary, path)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------------------------
# matrix products


def _gemm_operands(name: str, shape: tuple[int, int, int], device: torch.device) -> Callable[[], Any]:
    """A zero-argument product of ``shape`` in the layout the retrieval kernel uses for that dtype."""
    m, k, n = shape
    generator = torch.Generator().manual_seed(0)
    left = torch.randn(m, k, generator=generator).to(device)
    right = torch.randn(n, k, generator=generator).to(device)
    if name == "fp32":
        right_t = right.t()                                  # a transposed view: fp32 BLAS takes it at full speed
        return lambda: left @ right_t
    if name in ("bf16", "fp16"):
        dtype = torch.bfloat16 if name == "bf16" else torch.float16
        left_h, right_h = left.to(dtype), right.t().contiguous().to(dtype)   # (k, n) contiguous, as the kernel
        if device.type == "cuda":
            return lambda: torch.mm(left_h, right_h, out_dtype=torch.float32)
        return lambda: left_h @ right_h
    if name == "int8":
        left_i = (left * 40).round().clamp(-127, 127).to(torch.int8)
        right_i = (right * 40).round().clamp(-127, 127).to(torch.int8)
        right_t = right_i.t()                                 # (n, k) rows read transposed: the faster layout
        return lambda: torch._int_mm(left_i, right_t)
    raise ValueError(f"gemm dtype: expected one of {GEMM_DTYPES}, got {name!r}")


def _time_rounds(functions: dict[str, Callable[[], Any]], device: torch.device, rounds: int,
                 spread: dict[str, float] | None = None,
                 prepare: dict[str, Callable[[], Any]] | None = None) -> dict[str, float]:
    """Minimum seconds per call of each function over ``rounds`` interleaved rounds (after one warm-up call);
    ``spread`` (filled when given): (median - minimum) / minimum of each function's rounds; ``prepare[name]``, when
    given, runs untimed before each call of ``functions[name]``."""
    prepare = prepare or {}
    times: dict[str, list[float]] = {name: [] for name in functions}
    for name, function in functions.items():       # first calls pay for thread start-up and kernel selection
        prepare.get(name, _nothing)()
        function()
    for round_index in range(rounds + 1):
        for name, function in functions.items():
            prepare.get(name, _nothing)()
            _synchronize(device)
            start = time.perf_counter()
            function()
            _synchronize(device)
            if round_index:
                times[name].append(time.perf_counter() - start)
    best = {name: min(values) for name, values in times.items()}
    if spread is not None:
        for name, values in times.items():
            median = sorted(values)[len(values) // 2]
            spread[name] = (median - best[name]) / best[name]
    return best


def _nothing() -> None:
    return None


def _min_call_time(function: Callable[[], Any], device: torch.device, budget_s: float = 0.05,
                   max_calls: int = 50) -> float:
    """Fastest single call among as many as fit in ``budget_s`` (at least one after a warm-up call): on a shared
    machine many calls of a short product are preempted, the fastest one is the product's own speed."""
    function()
    best, spent, calls = float("inf"), 0.0, 0
    while calls < 1 or (spent < budget_s and calls < max_calls):
        _synchronize(device)
        start = time.perf_counter()
        function()
        _synchronize(device)
        elapsed = time.perf_counter() - start
        best, spent, calls = min(best, elapsed), spent + elapsed, calls + 1
    return best


def measure_gemm(device: torch.device | str = "cpu", shape: tuple[int, int, int] | None = None,
                 rounds: int = _ROUNDS) -> dict[str, Any]:
    """Time the candidate matrix products on ``device``; returns {"shape", "gops": {dtype: GOP/s}, "probe_only",
    "seconds", "measured_at"}. A dtype slower than a tenth of fp32 on the small probe shape, or whose probe rate
    predicts more than 1.5 s per full-shape call, keeps its probe rate (it cannot win; fp16 on CPUs without
    AMX-FP16 runs at ~1 GFLOP/s). Unsupported products get 0."""
    device = torch.device(device)
    shape = tuple(shape or GEMM_SHAPE)
    probe_shape = tuple(min(a, b) for a, b in zip(_PROBE_SHAPE, shape))
    started = time.perf_counter()
    probe_flops = 2.0 * probe_shape[0] * probe_shape[1] * probe_shape[2]
    runnable, gops = {}, {}
    for name in GEMM_DTYPES:
        try:
            runnable[name] = _gemm_operands(name, probe_shape, device)
            runnable[name]()
        except (RuntimeError, TypeError, NotImplementedError):
            runnable.pop(name, None)
            gops[name] = 0.0
    probe = {name: _min_call_time(function, device) for name, function in runnable.items()}
    probe_gops = {name: probe_flops / seconds / 1e9 for name, seconds in probe.items()}
    # fp32 is the baseline every other path is compared with: always timed at the full shape. The probe only
    # weeds out paths far slower than fp32 (fp16 without hardware support: ~0.03x); it is no ranking (small
    # products pay relatively more for re-packing operands and for thread hand-offs)
    # and a path whose probe rate predicts seconds per full-shape call is not timed there either
    baseline = probe_gops.get("fp32", max(probe_gops.values()))
    flops = 2.0 * shape[0] * shape[1] * shape[2]
    full = [name for name, rate in probe_gops.items()
            if name == "fp32" or (rate >= _PROBE_KEEP * baseline and flops / (rate * 1e9) <= _FULL_CALL_MAX_S)]
    spread: dict[str, float] = {}
    timed = _time_rounds({name: _gemm_operands(name, shape, device) for name in full}, device, rounds, spread)
    for name in GEMM_DTYPES:
        if name in timed:
            gops[name] = flops / timed[name] / 1e9
        elif name in probe_gops:
            gops[name] = probe_gops[name]
    return {"shape": list(shape), "gops": {name: float(f"{gops[name]:.4g}") for name in GEMM_DTYPES},
            "probe_only": sorted(set(probe_gops) - set(full)), "seconds": round(time.perf_counter() - started, 3),
            "measured_at": _now(), "measured_unix": time.time(),
            "spread": {name: round(value, 4) for name, value in spread.items()},
            "final": max(spread.values(), default=0.0) <= _MAX_SPREAD,
            "load_average": [round(value, 2) for value in os.getloadavg()] if hasattr(os, "getloadavg") else None}


def gemm_rates(device: torch.device | str = "cpu", measure: bool = True) -> dict[str, float] | None:
    """GOP/s per dtype of ``device`` from the cache, measured (and cached) on first use when ``measure``;
    None when calibration is off or nothing is cached and ``measure`` is False."""
    if not calibration_enabled():
        return None
    return _gemm_rates_cached(str(torch.device(device)), torch.get_num_threads(), str(cache_path(device)), measure)


@functools.lru_cache(maxsize=16)
def _gemm_rates_cached(device: str, threads: int, path: str, measure: bool) -> dict[str, float] | None:
    document = load(device)
    if not _settled(document):
        if not measure:
            return dict(document["gemm"]["gops"]) if document and document.get("gemm") else None
        with _locked(device):
            document = load(device)          # another process may have measured while we waited
            if not _settled(document):
                _update(device, "gemm", None, measure_gemm(device))
                document = load(device)
    return dict(document["gemm"]["gops"])


def _settled(document: dict[str, Any] | None) -> bool:
    """A cached product measurement to use as it is: a final one (spread within ``_MAX_SPREAD``; entries from
    before spreads were stored count as final), or a provisional one measured less than ``_RETRY_S`` ago (a busy
    machine is not re-measured by every process)."""
    gemm = (document or {}).get("gemm")
    if not gemm:
        return False
    if gemm.get("final", True):
        return True
    return time.time() - float(gemm.get("measured_unix", 0.0)) < _RETRY_S


def fastest_matmul(device: torch.device | str = "cpu", exclude: tuple[str, ...] = ()) -> str:
    """The candidate-pass arithmetic of the retrieval kernel's ``precision="auto"``: "int8", "bf16", "fp16" or
    "fp32", whichever measured fastest on ``device`` (bf16/fp16 must beat fp32 by 2 %, int8 the best of those by
    1.25x), leaving out ``exclude``; "fp32" when calibration is off."""
    rates = gemm_rates(device)
    if not rates:
        return "fp32"
    return _pick(rates, exclude)


def _pick(rates: dict[str, float], exclude: tuple[str, ...] = ()) -> str:
    floats = [name for name in ("bf16", "fp16") if name not in exclude]
    best = max(floats, key=lambda name: rates.get(name, 0.0)) if floats else "fp32"
    if rates.get(best, 0.0) <= _HALF_MARGIN * rates.get("fp32", 0.0):
        best = "fp32"
    # int8's candidate window is several times a bf16 one (8-bit codes on both sides), so it re-scores more
    # candidates (~1 us each against ~50-100 us per query for the product): it must beat the best float product
    # clearly; where the data make its window far too wide, the retrieval kernel's first chunk demotes it
    if "int8" not in exclude and rates.get("int8", 0.0) > _INT8_MARGIN * rates.get(best, 0.0):
        return "int8"
    return best


# ----------------------------------------------------------------------------------------------------------------
# model steps: their cache name (measured in compat_core.hardware.workloads)


def workload_signature(model: nn.Module, example: torch.Tensor, train: bool) -> str:
    """Cache name of a model step: train/infer, batch shape and a digest of the architecture (the backbone's, for
    models with a ``backbone``: a classifier growing by a few classes does not change the step's cost)."""
    body = getattr(model, "backbone", model)
    digest = hashlib.sha256(repr(body).encode()).hexdigest()[:12]
    shape = "x".join(str(size) for size in example.shape)
    return f"{'train' if train else 'infer'}-{type(body).__name__}-{digest}-in{shape}"


def training_signature(model: nn.Module, example: torch.Tensor, dtype: torch.dtype | None) -> str:
    """Cache name of a training step of ``model`` on ``example`` under autocast ``dtype`` (None: fp32)."""
    return f"{workload_signature(model, example, True)}-{str(dtype).replace('torch.', '') if dtype else 'fp32'}"


# ----------------------------------------------------------------------------------------------------------------
# showing it


def format_calibration(document: dict[str, Any] | None, path: Path | None = None) -> str:
    """Human-readable lines of a calibration document (what ``compat calibrate --show`` prints)."""
    if document is None:
        return f"no calibration cached{f' at {path}' if path else ''} (run `compat calibrate`)"
    key = document["key"]
    lines = [f"calibration of {key['device_type']} '{key['device_name']}', {key['cores']} cores, "
             f"{key['threads']} torch threads, torch {key['torch']}" + (f" ({path})" if path else "")]
    gemm = document.get("gemm")
    if gemm:
        rates = gemm["gops"]
        fp32 = rates.get("fp32") or float("nan")
        shape = "x".join(str(size) for size in gemm["shape"])
        status = "" if gemm.get("final", True) else ", provisional: too noisy, measured again later"
        load_average = gemm.get("load_average")
        load_note = f", load average {load_average[0]:.2f}" if load_average else ""
        lines.append(f"  matrix product {shape} (measured {gemm['measured_at']}{load_note}, {gemm['seconds']:.1f} s"
                     f"{status}):")
        for name in GEMM_DTYPES:
            note = " (small probe only: far slower)" if name in gemm.get("probe_only", []) else ""
            if name in gemm.get("spread", {}):
                note += f"  spread {100 * gemm['spread'][name]:.0f} %"
            rate = rates.get(name, 0.0)
            lines.append(f"    {name:5s} {rate:9.1f} GOP/s  {rate / fp32:5.2f}x fp32{note}")
        lines.append(f"    retrieval precision=auto candidate pass: {_pick(rates)}")
    for name, entry in sorted((document.get("workloads") or {}).items()):
        seconds = entry["seconds_per_step"]
        timings = ", ".join(f"{dtype} {value * 1e3:.1f} ms" for dtype, value in seconds.items())
        lines.append(f"  {name}: {timings} -> autocast auto = {entry['choice']}")
    for name, entry in sorted((document.get("compile") or {}).items()):
        lines.append(f"  compile {name}: eager {entry['eager_s'] * 1e3:.1f} ms, compiled {entry['compiled_s'] * 1e3:.1f} "
                     f"ms per step, compile {entry['compile_s']:.1f} s (auto decides per stage from its steps)")
    for name, entry in sorted((document.get("channels_last") or {}).items()):
        lines.append(f"  channels_last {name}: contiguous {entry['contiguous_s'] * 1e3:.1f} ms, channels_last "
                     f"{entry['channels_last_s'] * 1e3:.1f} ms per step -> channels_last auto = {entry.get('choice', '?')}")
    return "\n".join(lines)

"""Per-tensor byte ranges and sha256 digests of a safetensors file, so a reader can fetch and verify one tensor.

A safetensors file is ``<8-byte little-endian header length n><n bytes of JSON header><data>``; the header gives each
tensor's dtype, shape and ``data_offsets`` [begin, end) relative to the data section. :func:`tensor_index` records,
at write time, the digest of the header bytes and of every tensor's bytes; a reader then fetches the header (two
ranged reads), checks its digest (so the offsets it uses are the written ones), fetches the tensor's range and checks
that digest before building the tensor. No byte that was not verified is used.
"""
from __future__ import annotations

import hashlib
import json
import math
import struct

PREFIX_BYTES = 8  # the u64 header length
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit

# safetensors dtype -> (torch dtype name, bytes per value)
DTYPES = {"F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
          "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
          "BOOL": ("bool", 1)}


def header_length(prefix: bytes, where: str) -> int:
    """The JSON header's length in bytes from a file's first 8 bytes; ValueError naming ``where`` when invalid."""
    if len(prefix) < PREFIX_BYTES:
        raise ValueError(f"{where}: not a safetensors file ({len(prefix)} bytes, expected at least {PREFIX_BYTES})")
    (length,) = struct.unpack("<Q", prefix[:PREFIX_BYTES])
    if length > _MAX_HEADER_BYTES:
        raise ValueError(f"{where}: safetensors header of {length} bytes exceeds {_MAX_HEADER_BYTES}")
    return int(length)


def parse_header(header: bytes, where: str) -> dict[str, dict]:
    """Tensor name -> {"dtype", "shape", "offset", "length"} with ``offset`` absolute in the file (bytes)."""
    try:
        document = json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{where}: safetensors header is not JSON ({error})") from None
    start = PREFIX_BYTES + len(header)
    tensors = {}
    for name, entry in document.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        tensors[name] = {"dtype": entry["dtype"], "shape": list(entry["shape"]), "offset": start + int(begin),
                         "length": int(end) - int(begin)}
    return tensors


def tensor_index(data: bytes, where: str = "safetensors") -> dict:
    """What a writer stores beside a safetensors blob: {"header_bytes": 8 + n, "header_sha256", "tensors": {name:
    {"offset", "length", "sha256"}}} (offsets absolute, bytes)."""
    length = header_length(data[:PREFIX_BYTES], where)
    header = data[PREFIX_BYTES: PREFIX_BYTES + length]
    view = memoryview(data)
    tensors = {name: {"offset": entry["offset"], "length": entry["length"],
                      "sha256": hashlib.sha256(view[entry["offset"]: entry["offset"] + entry["length"]]).hexdigest()}
               for name, entry in parse_header(header, where).items()}
    return {"header_bytes": PREFIX_BYTES + length, "header_sha256": hashlib.sha256(data[:PREFIX_BYTES + length])
            .hexdigest(), "tensors": tensors}


def tensor_from_bytes(raw: bytes, dtype: str, shape: list[int], where: str):
    """A torch tensor (its own memory) from the little-endian bytes of one safetensors entry."""
    import torch  # only here: the run store indexes blobs with this module and never needs torch

    if dtype not in DTYPES:
        raise ValueError(f"{where}: safetensors dtype {dtype!r} is not supported here; supported: {sorted(DTYPES)}")
    name, width = DTYPES[dtype]
    expected = math.prod(shape) * width
    if len(raw) != expected:
        raise ValueError(f"{where}: {len(raw)} bytes for a {dtype} tensor of shape {shape} ({expected} expected)")
    torch_dtype = getattr(torch, name)
    if not raw:
        return torch.empty(shape, dtype=torch_dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch_dtype).reshape(shape)

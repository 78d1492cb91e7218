"""The safetensors container at the byte level: parse and write headers, locate each tensor's bytes.

The `safetensors` package reads whole tensors; streaming conversion needs each tensor's byte range (to
copy it in chunks, and to write one layer's slice into a stacked tensor at its offset). The format is an
8-byte little-endian header length, a JSON header `{name: {dtype, shape, data_offsets}}`, then the data;
files written here are read back by the `safetensors` package in the tests.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxmodel.errors import UserError

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),  # FP8 checkpoints' weights
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),  # and power-of-two scales, where stored as such
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
DTYPE_CODES = {dtype: code for code, dtype in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # the limit the safetensors package itself enforces


class SafetensorsError(ValueError, UserError):
    """A file that is not a complete, well-formed safetensors file; the message names the file."""


@dataclasses.dataclass(frozen=True)
class TensorLocation:
    """Where one tensor's bytes lie in a safetensors file."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: Path) -> tuple[dict[str, TensorLocation], dict[str, str]]:
    """Tensor locations and `__metadata__` of a safetensors file, checked against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: truncated or empty (no safetensors header)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > _MAX_HEADER or 8 + header_len > size:
            raise SafetensorsError(f"{path}: truncated or not a safetensors file (header length {header_len})")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise SafetensorsError(f"{path}: not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: not a safetensors file (header is not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + header_len
    tensors = {}
    for name, info in header.items():
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path}: tensor '{name}' has a malformed or unsupported header entry") from None
        if end - begin != math.prod(shape) * dtype.itemsize or begin < 0:
            raise SafetensorsError(f"{path}: tensor '{name}' byte range does not match its shape {list(shape)}")
        if data_start + end > size:
            raise SafetensorsError(
                f"{path}: truncated: tensor '{name}' ends at byte {data_start + end} but the file has {size} bytes"
            )
        tensors[name] = TensorLocation(name, dtype, shape, data_start + begin, end - begin)
    return tensors, metadata


def write_header(fd: int, tensors: list[tuple[str, np.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> dict[str, TensorLocation]:
    """Write the header for `tensors` (laid out in the given order) and size the file to hold their data.

    The data region is left for the caller to fill, at the returned offsets, in any order.
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    cursor = 0
    spans = []
    for name, dtype, shape in tensors:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {"dtype": DTYPE_CODES[np.dtype(dtype)], "shape": list(shape),
                        "data_offsets": [cursor, cursor + nbytes]}
        spans.append((name, np.dtype(dtype), tuple(shape), cursor, nbytes))
        cursor += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned, as the reference writer does
    os.pwrite(fd, struct.pack("<Q", len(encoded)) + encoded, 0)
    data_start = 8 + len(encoded)
    os.ftruncate(fd, data_start + cursor)
    return {name: TensorLocation(name, dtype, shape, data_start + begin, nbytes)
            for name, dtype, shape, begin, nbytes in spans}

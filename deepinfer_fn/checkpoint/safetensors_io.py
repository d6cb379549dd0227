"""A strict safetensors reader/writer on numpy memmaps (FP8, E8M0 and packed FP4 included).

Our own parser, so that every way a file can be broken (truncated, bad header, overlapping
or out-of-range offsets, unknown dtype, size mismatch) gives an error naming the file and
the tensor, and so that a tensor slice is read without loading the whole file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Iterable

import ml_dtypes
import numpy as np


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not match the model description."""


DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile:
    """Read-only view of one .safetensors file; tensors are memmap views (no copy)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise CheckpointError(f"missing checkpoint file {self.path}")
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{self.path}: truncated file ({size} bytes), no header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{self.path}: corrupt header length {n} for a "
                                      f"{size}-byte file")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{self.path}: corrupt JSON header ({e})") from e
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: header is not a JSON object")
        self.metadata = header.pop("__metadata__", {}) or {}
        self._data_start = 8 + n
        data_size = size - self._data_start
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        spans = []
        for name, info in header.items():
            try:
                dtype = DTYPES[info["dtype"]]
                shape = tuple(int(s) for s in info["shape"])
                begin, end = (int(o) for o in info["data_offsets"])
            except KeyError as e:
                raise CheckpointError(f"{self.path}: tensor {name!r} has unknown dtype or "
                                      f"missing field {e} in its header entry {info}") from e
            nbytes = math.prod(shape) * dtype.itemsize
            if not (0 <= begin <= end <= data_size) or end - begin != nbytes:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} ({info['dtype']} {list(shape)}) has offsets "
                    f"[{begin}, {end}) inconsistent with its size {nbytes} or the file's data "
                    f"size {data_size} (truncated or corrupt file)")
            self._entries[name] = (dtype, shape, begin, end)
            spans.append((begin, end, name))
        spans.sort()
        for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise CheckpointError(f"{self.path}: tensors {n0!r} and {n1!r} overlap")
        self._mmap = None

    def keys(self) -> Iterable[str]:
        return self._entries.keys()

    def dtype_name(self, name: str) -> str:
        return NAMES[self._entries[name][0]]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only memmap view (slice it to read part of it)."""
        if name not in self._entries:
            raise CheckpointError(f"{self.path}: no tensor {name!r}")
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        dtype, shape, begin, end = self._entries[name]
        raw = self._mmap[self._data_start + begin:self._data_start + end]
        return raw.view(dtype).reshape(shape)


def save_file(tensors: dict[str, np.ndarray], path: str | os.PathLike,
              metadata: dict[str, str] | None = None) -> None:
    """Writes tensors (numpy arrays of the dtypes above) in safetensors format."""
    header: dict[str, object] = {}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if arr.dtype not in NAMES:
            raise CheckpointError(f"cannot store tensor {name!r} of dtype {arr.dtype}")
        header[name] = {"dtype": NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = os.fspath(path) + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())
    os.replace(tmp, path)

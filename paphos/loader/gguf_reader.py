"""Reads a GGUF file's header: metadata key/values and the tensor table, with memory-mapped data.

Data flow: `GGUFCheckpoint` (gguf_loader.py) -> `read_gguf(path)` -> `GGUFFile{metadata, tensors}`;
each `GGUFTensor.data` is a zero-copy view of the file in the layout `gguf.quants.dequantize`
(and our torch dequantizers, paphos/quant/gguf/dequant.py) read: uint8 [..., bytes per row].

Why not `gguf.GGUFReader`: it builds a numpy view per element of every metadata array, so a
49k-token vocabulary costs 3-7 s of CPU before the first tensor is read (and a 128k vocabulary with
its merges several times that). The header format is small and fixed (magic, version, counts,
key/values, tensor infos, aligned data), so we walk it with `struct` and skip the bodies of long
arrays, which only the tokenizer conversion needs (transformers reads those itself). Type codes and
block sizes still come from the `gguf` package. Tests compare this reader with `gguf.GGUFReader`.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Arrays longer than this (vocabulary, merges, scores, token types) are summarized by their length.
MAX_ARRAY_ITEMS = 256

_SCALARS = {  # GGUFValueType code -> struct format
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}  # fmt: skip


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy/torch order (slowest dimension first), in elements
    data: np.ndarray  # raw view: uint8 [..., bytes per row] for block types, as dequantize wants
    n_bytes: int


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buf: Any) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        start, self.pos = self.pos, self.pos + n
        return bytes(self.buf[start : self.pos]).decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise GGUFFormatError(f"unknown metadata value type {vtype} at byte {self.pos}")
        item_type, count = self.unpack("<I"), self.unpack("<Q")
        if item_type in _NUMPY:  # fixed size: read all at once (or just skip)
            dtype = np.dtype(_NUMPY[item_type]).newbyteorder("<")
            start, self.pos = self.pos, self.pos + count * dtype.itemsize
            if count > MAX_ARRAY_ITEMS:
                return count
            return np.frombuffer(self.buf, dtype, count, start).tolist()
        if count > MAX_ARRAY_ITEMS:
            for _ in range(count):
                self.skip_value(item_type)
            return count
        return [self.value(item_type) for _ in range(count)]

    def skip_value(self, vtype: int) -> None:
        if vtype == _STRING:
            self.skip_string()
        elif vtype in _SCALARS:
            self.pos += struct.calcsize(_SCALARS[vtype])
        else:
            self.value(vtype)


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse the header of `path`; tensor data stays memory-mapped (read-only)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as e:  # empty file
            raise GGUFFormatError(f"cannot map the file: {e}") from e
    cur = _Cursor(buf)
    try:
        if bytes(buf[:4]) != b"GGUF":
            raise GGUFFormatError("bad magic (not a GGUF file)")
        cur.pos = 4
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"unsupported GGUF version {version} (big-endian or too old?)")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("<I")
            dims = [cur.unpack("<Q") for _ in range(n_dims)]
            infos.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
    except struct.error as e:
        raise GGUFFormatError(f"truncated header ({e})") from e
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-cur.pos // alignment) * alignment
    whole = np.frombuffer(buf, dtype=np.uint8)
    tensors = []
    for name, dims, type_code, offset in infos:
        try:
            ggml_type = GGMLQuantizationType(type_code)
            block, type_size = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError) as e:
            raise GGUFFormatError(f"tensor {name!r}: unknown ggml type {type_code}") from e
        shape = tuple(int(d) for d in reversed(dims)) or (1,)
        if shape[-1] % block:
            raise GGUFFormatError(f"tensor {name!r}: row of {shape[-1]} is not a multiple of {block}")
        row_bytes = shape[-1] // block * type_size
        n_bytes = row_bytes * int(np.prod(shape[:-1], dtype=np.int64))
        start = data_start + offset
        if start + n_bytes > len(whole):
            raise GGUFFormatError(f"tensor {name!r}: data runs past the end of the file (truncated?)")
        data = whole[start : start + n_bytes].reshape(*shape[:-1], row_bytes)
        tensors.append(GGUFTensor(name, ggml_type, shape, data, n_bytes))
    return GGUFFile(path, version, metadata, tensors)

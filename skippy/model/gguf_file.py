"""A GGUF file's metadata and tensor table, read straight into Python values.

The `gguf` package's GGUFReader keeps every metadata item as numpy views, one per
vocabulary entry and merge: opening the bundled 49k-token model took ~1 s and 162
MiB of RSS, the largest part of a stage's load peak. Here a string array is one
Python list and a number array one list, and the tensors are views of one
read-only memory map, shaped as GGUFReader shapes them (quantized types as rows of
block bytes). `tests/test_model_loading.py` holds it to GGUFReader's answers.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types: struct formats of the scalar ones
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
PLAIN_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                GGMLQuantizationType.I64: np.int64}  # fmt: skip


class GGUFFormatError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # as GGUF lists dimensions: innermost first
    n_bytes: int
    data: np.ndarray        # a read-only view of the file


class GGUFFile:
    """`fields`: every metadata key's value (str, int, float, bool, or a list of them);
    `tensors`: the tensor table, in file order; `data`: the whole file, memory-mapped."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.data = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buffer = memoryview(self.data)
        self._at = 0
        if bytes(self._take(4)) != MAGIC:
            raise GGUFFormatError(f"{self.path} is not a GGUF file (no GGUF magic)")
        version, num_tensors, num_fields = self._unpack("<IQQ")
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} is not supported (2 and 3 are; big-endian files are not)")
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            (kind,) = self._unpack("<I")
            self.fields[key] = self._value(kind)
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self._at // alignment) * alignment
        self.header_bytes = start  # metadata and tensor index: what the model fingerprint hashes
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _take(self, n: int) -> memoryview:
        if self._at + n > len(self._buffer):
            raise GGUFFormatError(f"{self.path} ends inside its header (at byte {self._at}, needs {n} more)")
        view = self._buffer[self._at : self._at + n]
        self._at += n
        return view

    def _unpack(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        return struct.unpack_from(fmt, self._take(size))

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        return str(self._take(length), "utf-8", "replace")

    def _value(self, kind: int) -> Any:
        if kind in SCALARS:
            return self._unpack("<" + SCALARS[kind])[0]
        if kind == STRING:
            return self._string()
        if kind == ARRAY:
            item_kind, count = self._unpack("<IQ")
            if item_kind in SCALARS and item_kind != 7:  # numbers in one read
                dtype = np.dtype("<" + SCALARS[item_kind])
                return np.frombuffer(self._take(count * dtype.itemsize), dtype=dtype).tolist()
            return [self._value(item_kind) for _ in range(count)]
        raise GGUFFormatError(f"{self.path}: unknown metadata value type {kind} at byte {self._at}")

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        (num_dims,) = self._unpack("<I")
        shape = self._unpack(f"<{num_dims}Q")
        kind, offset = self._unpack("<IQ")
        try:
            return name, tuple(int(d) for d in shape), GGMLQuantizationType(kind), offset
        except ValueError:
            raise GGUFFormatError(f"{self.path}: tensor {name} has unknown type {kind}") from None

    def _tensor(self, start: int, name: str, shape: tuple[int, ...], kind: GGMLQuantizationType,
                offset: int) -> GGUFTensor:
        elements = int(np.prod(shape))
        block, block_bytes = GGML_QUANT_SIZES[kind]
        n_bytes = elements // block * block_bytes
        begin = start + offset
        if begin + n_bytes > len(self.data):
            raise GGUFFormatError(f"{self.path} is truncated: tensor {name} ends past the end of the file")
        raw = self.data[begin : begin + n_bytes]
        numpy_shape = tuple(reversed(shape))
        if kind in PLAIN_DTYPES:
            data = raw.view(PLAIN_DTYPES[kind]).reshape(numpy_shape)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(numpy_shape, kind))
        return GGUFTensor(name, kind, shape, n_bytes, data)

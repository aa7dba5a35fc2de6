"""A GGUF file's metadata and tensor table, read straight into Python values.

The `gguf` package's GGUFReader keeps every metadata item as numpy views, one per
vocabulary entry and merge: opening the bundled 49k-token model took ~1 s and 162
MiB of RSS, the largest part of a stage's load peak. Here a string array is one
Python list and a number array one list, and the tensors are views of one
read-only memory map, shaped as GGUFReader shapes them (quantized types as rows of
block bytes). `tests/test_model_loading.py` holds it to GGUFReader's answers.

`GGUFIndex` is the same walk over a header alone (bytes, not a file): where the
metadata ends, the tensor table and where the data starts, decoding only the keys
asked for. A holder serves it and a stage builds its slice from it (slice.py).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
PREAMBLE = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata count
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
class TensorInfo:
    """One entry of the tensor table; `offset` is from the start of the data section."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # as GGUF lists dimensions: innermost first
    offset: int
    n_bytes: int


@dataclass(frozen=True, slots=True)
class GGUFIndex:
    """A GGUF header's layout: the metadata is bytes [PREAMBLE.size, kv_end), the tensor
    table [kv_end, table_end), the data starts at `data_start` (aligned). `fields`: the
    metadata values that `keep` asked for."""

    version: int
    kv_count: int
    kv_end: int
    table_end: int
    data_start: int
    alignment: int
    tensors: list[TensorInfo]
    fields: dict[str, Any]
    offsets: dict[str, int]  # where each kept key's entry starts

    @classmethod
    def parse(cls, buffer, where: str = "GGUF header", keep: Callable[[str], bool] = lambda key: True) -> GGUFIndex:
        """Walk the header at the start of `buffer` (bytes, or a memory map of the whole file)."""
        cursor = _Cursor(memoryview(buffer), where)
        magic, version, num_tensors, num_fields = cursor.unpack(PREAMBLE.format)
        if magic != MAGIC:
            raise GGUFFormatError(f"{where} is not a GGUF file (no GGUF magic)")
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} is not supported (2 and 3 are; big-endian files are not)")
        fields: dict[str, Any] = {}
        offsets: dict[str, int] = {}
        alignment = DEFAULT_ALIGNMENT
        for _ in range(num_fields):
            entry = cursor.at
            key = cursor.string()
            (kind,) = cursor.unpack("<I")
            if key == "general.alignment" or keep(key):
                offsets[key] = entry
                fields[key] = cursor.value(kind)
                if key == "general.alignment":
                    alignment = int(fields[key])
            else:
                cursor.skip(kind)
        kv_end = cursor.at
        tensors = [cursor.tensor_info() for _ in range(num_tensors)]
        if alignment <= 0:
            raise GGUFFormatError(f"{where}: general.alignment is {alignment}")
        kept = [key for key in fields if keep(key)]
        return cls(version, num_fields, kv_end, cursor.at, align(cursor.at, alignment), alignment, tensors,
                   {key: fields[key] for key in kept}, {key: offsets[key] for key in kept})


def align(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment


def tensor_bytes(tensor_type: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    block, block_bytes = GGML_QUANT_SIZES[tensor_type]
    return int(np.prod(shape)) // block * block_bytes


class _Cursor:
    """Reads a GGUF header front to back, checking every length against the buffer."""

    def __init__(self, buffer: memoryview, where: str):
        self.buffer, self.where, self.at = buffer, where, 0

    def take(self, n: int) -> memoryview:
        if self.at + n > len(self.buffer):
            raise GGUFFormatError(f"{self.where} ends inside its header (at byte {self.at}, needs {n} more)")
        view = self.buffer[self.at : self.at + n]
        self.at += n
        return view

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack_from(fmt, self.take(struct.calcsize(fmt)))

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        return str(self.take(length), "utf-8", "replace")

    def value(self, kind: int) -> Any:
        if kind in SCALARS:
            return self.unpack("<" + SCALARS[kind])[0]
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item_kind, count = self.unpack("<IQ")
            if item_kind in SCALARS and item_kind != 7:  # numbers in one read
                dtype = np.dtype("<" + SCALARS[item_kind])
                return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()
            return [self.value(item_kind) for _ in range(count)]
        raise GGUFFormatError(f"{self.where}: unknown metadata value type {kind} at byte {self.at}")

    def skip(self, kind: int) -> None:
        """Step over a value without building it (a vocabulary is 100k strings)."""
        if kind in SCALARS:
            self.take(struct.calcsize(SCALARS[kind]))
        elif kind == STRING:
            (length,) = self.unpack("<Q")
            self.take(length)
        elif kind == ARRAY:
            item_kind, count = self.unpack("<IQ")
            if item_kind in SCALARS:
                self.take(count * struct.calcsize(SCALARS[item_kind]))
            else:
                for _ in range(count):
                    self.skip(item_kind)
        else:
            raise GGUFFormatError(f"{self.where}: unknown metadata value type {kind} at byte {self.at}")

    def tensor_info(self) -> TensorInfo:
        name = self.string()
        (num_dims,) = self.unpack("<I")
        shape = tuple(int(d) for d in self.unpack(f"<{num_dims}Q"))
        kind, offset = self.unpack("<IQ")
        try:
            tensor_type = GGMLQuantizationType(kind)
        except ValueError:
            raise GGUFFormatError(f"{self.where}: tensor {name} has unknown type {kind}") from None
        return TensorInfo(name, tensor_type, shape, offset, tensor_bytes(tensor_type, shape))


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
        self.index = index = GGUFIndex.parse(self.data, str(self.path))
        self.fields: dict[str, Any] = index.fields
        self.header_bytes = index.data_start  # metadata and tensor index: what the model fingerprint hashes
        self.tensors = [self._tensor(index.data_start, info) for info in index.tensors]

    def _tensor(self, start: int, info: TensorInfo) -> GGUFTensor:
        begin = start + info.offset
        if begin + info.n_bytes > len(self.data):
            raise GGUFFormatError(f"{self.path} is truncated: tensor {info.name} ends past the end of the file")
        raw = self.data[begin : begin + info.n_bytes]
        numpy_shape = tuple(reversed(info.shape))
        if info.tensor_type in PLAIN_DTYPES:
            data = raw.view(PLAIN_DTYPES[info.tensor_type]).reshape(numpy_shape)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(numpy_shape, info.tensor_type))
        return GGUFTensor(info.name, info.tensor_type, info.shape, info.n_bytes, data)

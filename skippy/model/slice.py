"""A stage's slice of a GGUF, as a GGUF of its own: the source's metadata byte for byte, a
tensor table of only the slice's tensors (source.slice_tensor_names), their bytes as the
source stores them, and four keys that make the file check itself:

    skippy.slice.source    the source file's fingerprint (the plan's)
    skippy.slice.layers    [start, end)
    skippy.slice.digests   sha256 of each tensor, in table order
    skippy.slice.metadata  sha256 of the source's metadata bytes and this tensor table

Every byte of the file is then covered by a digest or checked against the plan: a stage
checks its cached slice's header before loading it (`check_slice_header`) and its tensors
while it loads (`check_slice_tensors`), and names the tensor that does not match
(`verify_slice` does both at once). Any GGUF reader loads it; skippy loads it as any file.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelLoadError
from .fingerprint import header_fingerprint
from .gguf_file import ARRAY, PREAMBLE, STRING, GGUFFile, GGUFFormatError, GGUFIndex, align
from .gguf_loader import open_gguf
from .source import DIGEST, DIGEST_BYTES, digest_spans, layer_keys, num_layers_of, slice_tensor_names

UINT32 = 4
SOURCE_KEY, LAYERS_KEY, DIGESTS_KEY, METADATA_KEY = (
    "skippy.slice.source", "skippy.slice.layers", "skippy.slice.digests", "skippy.slice.metadata")


def slice_file_name(layer_start: int, layer_end: int) -> str:
    return f"layers-{layer_start}-{layer_end}.gguf"


@dataclass(frozen=True, slots=True)
class SliceTensor:
    name: str
    source_index: int   # its position in the source's tensor table
    offset: int         # where its bytes start in the slice file
    n_bytes: int
    digest: bytes


@dataclass(frozen=True)
class SliceLayout:
    """The slice file to be: its header (every byte before the data) and where each tensor goes."""

    header: bytes
    tensors: list[SliceTensor]
    size: int

    @property
    def share(self) -> int:
        """Tensor bytes: what the slice takes of the source's weights."""
        return sum(t.n_bytes for t in self.tensors)


def plan_slice(source_header: bytes, source_size: int, source_fingerprint: str, digests: list[bytes],
               layer_start: int, layer_end: int) -> SliceLayout:
    """The slice of layers [start, end) of the GGUF whose header is `source_header`; ValueError
    unless that header is the planned file's (its fingerprint) and `digests` has one per tensor."""
    found = header_fingerprint(source_header, source_size)
    if found != source_fingerprint:
        raise ValueError(f"the holder's model (fingerprint {found}) is not the planned one ({source_fingerprint})")
    index = GGUFIndex.parse(source_header, "the holder's GGUF header", keep=layer_keys)
    if len(digests) != len(index.tensors) or any(len(d) != DIGEST_BYTES for d in digests):
        raise ValueError(f"expected {len(index.tensors)} digests of {DIGEST_BYTES} bytes, got {len(digests)}")
    names = set(slice_tensor_names(index.tensors, layer_start, layer_end, num_layers_of(index)))
    chosen = [(i, t) for i, t in enumerate(index.tensors) if t.name in names]
    table, offsets, at = [], [], 0
    for _, tensor in chosen:
        at = align(at, index.alignment)
        offsets.append(at)
        table.append(_string(tensor.name) + struct.pack(f"<I{len(tensor.shape)}QIQ", len(tensor.shape), *tensor.shape,
                                                         int(tensor.tensor_type), at))
        at += tensor.n_bytes
    table_bytes = b"".join(table)
    source_kv = source_header[PREAMBLE.size : index.kv_end]
    own_kv = (_entry(SOURCE_KEY, STRING, _string(source_fingerprint))
              + _entry(LAYERS_KEY, ARRAY, struct.pack("<IQII", UINT32, 2, layer_start, layer_end))
              + _entry(DIGESTS_KEY, ARRAY, struct.pack("<IQ", STRING, len(chosen))
                       + b"".join(_string(digests[i].hex()) for i, _ in chosen))
              + _entry(METADATA_KEY, STRING, _string(hashlib.new(DIGEST, source_kv + table_bytes).hexdigest())))
    header = PREAMBLE.pack(b"GGUF", 3, len(chosen), index.kv_count + 4) + source_kv + own_kv + table_bytes
    data_start = align(len(header), index.alignment)
    header += bytes(data_start - len(header))
    tensors = [SliceTensor(t.name, i, data_start + offset, t.n_bytes, digests[i])
               for (i, t), offset in zip(chosen, offsets)]
    return SliceLayout(header, tensors, data_start + at)


def verify_slice(path: Path, source_fingerprint: str, layer_start: int, layer_end: int) -> None:
    """ModelLoadError unless `path` is an intact slice of layers [start, end) of the planned
    model: its metadata and every tensor match their digests (the first that does not is named)."""
    check_slice_tensors(check_slice_header(path, source_fingerprint, layer_start, layer_end))


def check_slice_header(path: Path, source_fingerprint: str, layer_start: int, layer_end: int) -> GGUFFile:
    """The slice at `path`, once its metadata, tensor table and size are checked (cheap: no
    tensor is read). Its parse is the one the loader reuses (gguf_loader.open_gguf)."""
    try:
        reader = open_gguf(path)
        index, fields, data = reader.index, reader.fields, reader.data
        if not {SOURCE_KEY, LAYERS_KEY, DIGESTS_KEY, METADATA_KEY} <= fields.keys():
            raise ModelLoadError(f"{path} is not a slice skippy wrote (no skippy.slice.* metadata). {_fix(path)}")
        if fields[SOURCE_KEY] != source_fingerprint:
            raise ModelLoadError(f"{path} is a slice of another model (fingerprint {fields[SOURCE_KEY]}, "
                                 f"the plan's is {source_fingerprint}). {_fix(path)}")
        if list(fields[LAYERS_KEY]) != [layer_start, layer_end]:
            raise ModelLoadError(f"{path} holds layers {fields[LAYERS_KEY]}, not [{layer_start}, {layer_end}). "
                                 f"{_fix(path)}")
        table_start = min(index.offsets[key] for key in (SOURCE_KEY, LAYERS_KEY, DIGESTS_KEY, METADATA_KEY))
        metadata = hashlib.new(DIGEST, data[PREAMBLE.size : table_start].tobytes()
                               + data[index.kv_end : index.table_end].tobytes())
        if metadata.hexdigest() != fields[METADATA_KEY]:
            raise ModelLoadError(f"{path}: its metadata or tensor table does not match its digest: the file is "
                                 f"corrupt. {_fix(path)}")
        end = max((index.data_start + t.offset + t.n_bytes for t in index.tensors), default=index.data_start)
        if len(data) != end or len(fields[DIGESTS_KEY]) != len(index.tensors):
            raise ModelLoadError(f"{path} is {len(data)} bytes, its tensor table says {end}: the file is "
                                 f"truncated or corrupt. {_fix(path)}")
        return reader
    except (OSError, GGUFFormatError, ValueError) as error:
        raise ModelLoadError(f"{path} cannot be read as a slice: {error}. {_fix(path)}") from error


def check_slice_tensors(reader: GGUFFile, *, background: bool = False) -> None:
    """Every tensor of a slice whose header checked against its digest: the first that does
    not match is named. `background`: beside the model's load (source.digest_spans)."""
    index = reader.index
    found = digest_spans(reader.data, [(index.data_start + t.offset, t.n_bytes) for t in index.tensors],
                         background=background)
    for tensor, expected, digest in zip(index.tensors, reader.fields[DIGESTS_KEY], found):
        if digest.hex() != expected:
            raise ModelLoadError(f"{reader.path}: tensor {tensor.name} does not match its digest ({DIGEST} "
                                 f"{expected[:16]}..., found {digest.hex()[:16]}...): the file is corrupt. "
                                 f"{_fix(reader.path)}")


def _fix(path: Path) -> str:
    return f"Fix: delete {path}; the stage then fetches its layers again."


def _string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _entry(key: str, kind: int, value: bytes) -> bytes:
    return _string(key) + struct.pack("<I", kind) + value

"""A whole GGUF as a holder serves it: its header, tensor table, fingerprint and one digest
per tensor, and which tensors a stage's slice takes from it.

The digests (sha256, the hash this CPU runs fastest: 715 MB/s against blake2b's 463 on one
core) are computed once and cached next to the file as `<file>.skippy-digests.json`, keyed by
the file's size, mtime and fingerprint; where that directory is read-only, under
`cache_root()/models/<fingerprint>/`. Hashing runs on every core: hashlib lets go of the GIL.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .args import LayerRange
from .fingerprint import header_fingerprint
from .gguf_file import GGUFIndex, TensorInfo
from .locate import cache_root
from .threads import lower_priority
from .weights import needed_tensor_names

DIGEST = "sha256"
DIGEST_BYTES = 32
DIGESTS_SUFFIX = ".skippy-digests.json"
HASH_STEP = 16 << 20  # bytes per hashlib update: the GIL is let go for each
EMBEDDING_AND_HEAD = {"token_embd.weight", "output_norm.weight", "output.weight"}


def slice_tensor_names(tensors: Sequence[TensorInfo], layer_start: int, layer_end: int,
                       num_layers: int) -> list[str]:
    """The tensors a stage of layers [start, end) loads, in file order: every `blk.N.*` of its
    blocks, the embedding and head as the sparse-load rule gives them (weights.py), and any
    model-wide tensor outside the blocks (rope_freqs.weight: read with the hyperparameters)."""
    names = [t.name for t in tensors]
    head = set(needed_tensor_names(LayerRange(layer_start, layer_end, num_layers), "output.weight" not in names))
    blocks = tuple(f"blk.{i}." for i in range(layer_start, layer_end))

    def wanted(name: str) -> bool:
        if name.startswith("blk."):
            return name.startswith(blocks)
        return name in head or name not in EMBEDDING_AND_HEAD
    return [name for name in names if wanted(name)]


def num_layers_of(index: GGUFIndex) -> int:
    """`<architecture>.block_count` of a header parsed with `keep=layer_keys`."""
    arch = index.fields.get("general.architecture")
    count = index.fields.get(f"{arch}.block_count")
    if count is None:
        raise ValueError(f"GGUF metadata is missing {arch}.block_count")
    return int(count)


def layer_keys(key: str) -> bool:
    return key == "general.architecture" or key.endswith(".block_count")


@dataclass(frozen=True)
class SourceModel:
    """A full GGUF file: what a holder sends before any tensor (its header and digests)."""

    path: Path
    index: GGUFIndex
    header: bytes           # every byte before the data: what the fingerprint hashes
    size: int
    fingerprint: str
    digests: list[bytes]    # one per tensor, in file order

    @classmethod
    def open(cls, path: str | Path) -> SourceModel:
        """Read the header; digest every tensor unless a cached list still fits the file."""
        path = Path(path).resolve()
        with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            index = GGUFIndex.parse(data, str(path), keep=layer_keys)
            header, size = bytes(data[:index.data_start]), len(data)
            for tensor in index.tensors:
                if index.data_start + tensor.offset + tensor.n_bytes > size:
                    raise ValueError(f"{path} is truncated: tensor {tensor.name} ends past the end of the file")
            fingerprint = header_fingerprint(header, size)
            digests = _cached_digests(path, fingerprint)
            if digests is None or len(digests) != len(index.tensors):
                digests = digest_spans(data, [(index.data_start + t.offset, t.n_bytes) for t in index.tensors])
                _save_digests(path, fingerprint, digests)
        return cls(path, index, header, size, fingerprint, digests)

    @property
    def num_layers(self) -> int:
        return num_layers_of(self.index)

    def slice_indices(self, layer_start: int, layer_end: int) -> list[int]:
        """Positions in the tensor table of the slice of layers [start, end)."""
        names = set(slice_tensor_names(self.index.tensors, layer_start, layer_end, self.num_layers))
        return [i for i, t in enumerate(self.index.tensors) if t.name in names]


def digest_spans(data, spans: Sequence[tuple[int, int]], *, background: bool = False) -> list[bytes]:
    """sha256 of each (offset, length) of `data` (a memory map), on every core; `background`:
    on every core but one, at the lowest priority (while a model loads beside it)."""
    view = memoryview(data)
    cores = os.cpu_count() or 1
    workers, start = (max(1, cores - 1), lower_priority) if background else (cores, None)

    def one(span: tuple[int, int]) -> bytes:
        offset, length = span
        digest = hashlib.new(DIGEST)
        for at in range(offset, offset + length, HASH_STEP):
            with view[at : min(at + HASH_STEP, offset + length)] as step:
                digest.update(step)
        return digest.digest()

    try:
        with ThreadPoolExecutor(max_workers=workers, initializer=start) as pool:
            return list(pool.map(one, spans))
    finally:
        view.release()


def _digest_files(path: Path, fingerprint: str) -> list[Path]:
    """Where the digest list may be cached: beside the file, else in skippy's cache."""
    return [path.with_name(path.name + DIGESTS_SUFFIX), cache_root() / "models" / fingerprint / "source-digests.json"]


def _stamp(path: Path, fingerprint: str) -> dict:
    stat = path.stat()
    return {"algorithm": DIGEST, "fingerprint": fingerprint, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _cached_digests(path: Path, fingerprint: str) -> list[bytes] | None:
    stamp = _stamp(path, fingerprint)
    for file in _digest_files(path, fingerprint):
        try:
            cached = json.loads(file.read_text())
            if {key: cached.get(key) for key in stamp} == stamp:
                return [bytes.fromhex(d) for d in cached["digests"]]
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def _save_digests(path: Path, fingerprint: str, digests: list[bytes]) -> None:
    record = json.dumps({**_stamp(path, fingerprint), "digests": [d.hex() for d in digests]})
    for file in _digest_files(path, fingerprint):
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            temporary = file.with_name(f"{file.name}.{os.getpid()}.tmp")
            temporary.write_text(record)
            temporary.replace(file)  # whole or not at all
            return
        except OSError:
            continue  # a read-only directory: the next place

"""A model's identity, cheap to compute: which file a chain was planned for.

A GGUF's fingerprint hashes its header (every metadata key and the tensor index: names,
shapes, types, offsets) and its size; a Hugging Face directory's hashes config.json and
each safetensors file's header (its tensor index) and size. Two files that differ in
architecture, vocabulary, quantization or layout differ here; reading it touches a few
megabytes, never the weights.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

from .errors import ModelLoadError
from .gguf_loader import open_gguf


def model_fingerprint(path: str | Path) -> str:
    """32 hex digits (blake2b-128) identifying the model at `path`."""
    path = Path(path)
    if not path.is_dir():
        reader = open_gguf(path)
        return header_fingerprint(memoryview(reader.data)[:reader.header_bytes], len(reader.data))
    digest = hashlib.blake2b(b"skippy-model-v1\0", digest_size=16)
    digest.update((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")):
        with file.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            digest.update(file.name.encode() + handle.read(length) + struct.pack("<Q", file.stat().st_size))
    return digest.hexdigest()


def header_fingerprint(header, file_size: int) -> str:
    """A GGUF's fingerprint from its header (every byte before the data) and its size: what a
    stage that fetches its layers checks the holder's header against."""
    digest = hashlib.blake2b(b"skippy-model-v1\0", digest_size=16)
    digest.update(header)
    digest.update(struct.pack("<Q", file_size))
    return digest.hexdigest()


def check_model(path: str | Path, expected: str | None, who: str) -> None:
    """ModelLoadError unless the model at `path` is the one the chain was planned for."""
    if expected is None:
        return
    found = model_fingerprint(path)
    if found != expected:
        raise ModelLoadError(f"{who}: the model at {path} (fingerprint {found}) is not the one the chain was planned "
                             f"for (fingerprint {expected}). Fix: point it at the same file with --model PATH, or "
                             f"plan the chain again with this one.")

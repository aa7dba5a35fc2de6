"""What makes two prefix-cache entries the same entry, and which lengths to try (spec §4.2, §4.3).

No torch here: identities are bytes in, hex digests out.

A key is blake2b-256 over, in order:
    a domain tag, the canonical JSON of a `CacheNamespace` (model digest, layer range,
    KV dtype and layout, platform, context size, the request namespace),
    token_start (u64 LE), then every token id (i32 LE).
Every field is length-delimited or fixed-width, so no two different identities
feed the hash the same bytes; a 256-bit digest makes accidental collisions moot,
which is why a hit carries no token check.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import hashlib
import json
import os
import platform
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

KEY_DOMAIN = b"skippy-prefix-key-v1\0"
KV_LAYOUT = "skippy-kv-v1:[layers,kv_heads,tokens,head_dim]"  # model.kv_cache.KVSnapshot
PLATFORM = f"{platform.machine() or 'unknown'}/{sys.byteorder}/{struct.calcsize('P') * 8}bit"

DIGEST_SAMPLE_BYTES = 1 << 20   # each sampled block of a weights file
DIGEST_NUM_SAMPLES = 16         # evenly spaced blocks, plus the first and the last


@dataclass(frozen=True, slots=True)
class CacheNamespace:
    """Everything but the tokens that an entry's KV depends on.

    Build one per stage at start-up, then `with_namespace(prompt_cache_key)` per
    request: a client key partitions the cache; None is the shared default.
    """

    model_digest: str           # model_digest(path) of the weights this stage loaded
    layer_start: int
    layer_end: int              # half-open
    kv_dtype: str               # e.g. "float32", "bfloat16"
    ctx_size: int
    namespace: str | None = None
    kv_layout: str = KV_LAYOUT
    platform: str = PLATFORM    # the disk tier stores raw bytes in native byte order
    weights: str = ""           # StageModel.weight_format: q4 and float32 weights fill different KVs

    def __post_init__(self) -> None:
        if not self.model_digest:
            raise ValueError("Expected a model digest, got an empty string")
        if not 0 <= self.layer_start < self.layer_end:
            raise ValueError(f"Expected 0 <= layer_start < layer_end, got [{self.layer_start}, {self.layer_end})")
        if self.ctx_size < 1:
            raise ValueError(f"Expected ctx_size >= 1, got {self.ctx_size}")

    def with_namespace(self, namespace: str | None) -> CacheNamespace:
        return dataclasses.replace(self, namespace=namespace)

    def header(self) -> bytes:
        # JSON keeps None ("null") distinct from "" and quotes every string
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":")).encode()


@functools.lru_cache(maxsize=256)
def _namespace_hasher(ns: CacheNamespace) -> "hashlib._Hash":
    header = ns.header()
    h = hashlib.blake2b(digest_size=32)
    h.update(KEY_DOMAIN + struct.pack("<Q", len(header)) + header)
    return h  # only ever used through .copy()


def _pack_tokens(tokens: Sequence[int]) -> bytes:
    packed = array.array("i", tokens)  # C int: 4 bytes on every supported platform
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def prefix_keys(ns: CacheNamespace, tokens: Sequence[int], lengths: Iterable[int],
                token_start: int = 0) -> dict[int, str]:
    """{n: key of tokens[:n]} for each n in lengths, hashing the tokens once."""
    h = _namespace_hasher(ns).copy()
    h.update(struct.pack("<Q", token_start))
    keys, done = {}, 0
    for n in sorted(set(lengths)):
        if not 0 < n <= len(tokens):
            raise ValueError(f"Expected prefix lengths in [1, {len(tokens)}], got {n}")
        h.update(_pack_tokens(tokens[done:n]))
        keys[n], done = h.copy().hexdigest(), n
    return keys


def prefix_key(ns: CacheNamespace, tokens: Sequence[int], token_start: int = 0) -> str:
    return prefix_keys(ns, tokens, [len(tokens)], token_start)[len(tokens)]


def cacheable_prefix_length(prompt_len: int) -> int:
    """The last prompt token is fed with the first decode, so it is never cached (spec §4.3)."""
    return max(prompt_len - 1, 0)


def candidate_lengths(num_tokens: int, stride: int = 128, min_tokens: int = 64) -> list[int]:
    """The exact length, then every multiple of `stride` below it, longest first, none under
    `min_tokens`. Lookup probes them all, and the longest hit wins (spec §4.3)."""
    if stride < 1:
        raise ValueError(f"Expected stride >= 1, got {stride}")
    if num_tokens < max(min_tokens, 1):
        return []
    aligned = range((num_tokens - 1) // stride * stride, max(min_tokens, 1) - 1, -stride)
    return [num_tokens, *aligned]


def record_lengths(num_tokens: int, stride: int = 128, min_tokens: int = 64, limit: int = 4) -> list[int]:
    """The lengths to record, longest first: the exact length, then aligned lengths whose
    distance below the longest aligned one doubles (0, 1, 2, 4, 8... strides, then the lowest).

    Prompts sharing a system prompt of B tokens need an entry at or below B; the original
    [exact, A] (spec §4.3) misses it once their tails pass the next stride. With doubling gaps
    a prefix shared by prompts at most 2**(limit - 3) strides longer is always recorded, at
    up to `limit` copies of the prompt's KV per record (within the cache's byte budget).
    """
    ladder = candidate_lengths(num_tokens, stride, min_tokens)
    aligned = ladder[1:]
    doubling = [0, *(2**j for j in range(len(aligned).bit_length())), len(aligned) - 1]
    picks = sorted({min(i, len(aligned) - 1) for i in doubling})
    return ([num_tokens] + [aligned[i] for i in picks if i >= 0])[:limit] if ladder else []


def model_digest(path: str | Path, *, full: bool = False) -> str:
    """A digest of a weights file, or of every file under a checkpoint directory.

    Sampled (default): file size, mtime and 18 blocks of 1 MiB (first, last, 16 evenly
    spaced) — milliseconds for a multi-GB GGUF. It misses an in-place edit that keeps the
    size and the mtime and spares every sampled block; a fine-tune or a re-quantization
    changes the sampled blocks. A copy or a `touch` changes the mtime: a safe miss.
    full=True: every byte (about 1 s per GB), independent of the mtime.
    Results are cached per (path, size, mtime), so the second call is free.
    """
    root = Path(path).resolve()
    if not root.is_dir():
        return _file_digest(str(root), *_stat(root), full)
    h = hashlib.blake2b(digest_size=32)
    files = sorted(p for p in root.rglob("*")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts))
    if not files:
        raise ValueError(f"Expected model files under {root}, got an empty directory")
    for file in files:
        name = file.relative_to(root).as_posix().encode()
        h.update(struct.pack("<Q", len(name)) + name)
        h.update(_file_digest(str(file), *_stat(file), full).encode())
    return f"dir-{'full' if full else 'sampled'}:{h.hexdigest()}"


def _stat(path: Path) -> tuple[int, int]:
    st = os.stat(path)  # FileNotFoundError names the path
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=64)
def _file_digest(path: str, size: int, mtime_ns: int, full: bool) -> str:
    h = hashlib.blake2b(digest_size=32)
    h.update(struct.pack("<Q", size))
    with open(path, "rb") as f:
        if full or size <= (DIGEST_NUM_SAMPLES + 2) * DIGEST_SAMPLE_BYTES:
            while chunk := f.read(1 << 22):
                h.update(chunk)
            return f"full:{h.hexdigest()}"
        h.update(struct.pack("<Q", mtime_ns))
        last = size - DIGEST_SAMPLE_BYTES
        for i in range(DIGEST_NUM_SAMPLES + 2):
            f.seek(last * i // (DIGEST_NUM_SAMPLES + 1))
            h.update(f.read(DIGEST_SAMPLE_BYTES))
    return f"sampled:{h.hexdigest()}"

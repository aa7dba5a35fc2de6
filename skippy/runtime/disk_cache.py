"""The prefix cache's disk tier (`--kv-disk-dir`, `--kv-disk-budget`; spec §4.6).

One file per entry, named `<key hex>.kv`, content-addressed by the prefix key:
    magic 8s | format version u32 | header length u32 | blake2b-128 of the header 16s
    header: JSON (num_tokens, dtype, k_shape, v_shape, byteorder, payload_bytes,
            payload_digest = blake2b-256 of the payload), space-padded to a 64-byte boundary
    payload: k bytes then v bytes, C order, native byte order (no pickle)
A file appears under its final name only through os.replace of a fsynced temp file in
the same directory, so a reader sees a whole file or none, and a crash leaves only a
temp file (removed at the next start). A file that fails any check moves to
`quarantine/` and reads as a miss: never an exception, never wrong data.
The byte budget evicts the least recently used file first: a hit bumps the mtime, so
the order survives a restart. Thread-safe; one process per directory keeps the budget exact.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..model.kv_cache import KVSnapshot
from ..protocol.configs import KvCacheConfig

log = logging.getLogger(__name__)

MAGIC = b"SKPYKV\r\n"
FORMAT_VERSION = 1
PREFIX = struct.Struct("<8sII16s")  # magic, version, header length, header digest
PAYLOAD_ALIGN = 64
ENTRY_SUFFIX, TMP_SUFFIX = ".kv", ".tmp"
QUARANTINE_DIR = "quarantine"
MAX_QUARANTINED = 16            # oldest quarantined files beyond this are deleted
STALE_TMP_SECONDS = 3600        # a temp file this old is abandoned even if its pid lives
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
_KEY = re.compile(r"[0-9a-f]{64}")


class CorruptEntryError(ValueError):
    """A cache file failed verification (it is quarantined, never read)."""


@dataclass(slots=True)
class DiskCacheStats:
    hits: int = 0
    misses: int = 0
    writes: int = 0
    write_errors: int = 0
    evictions: int = 0
    quarantined: int = 0
    num_files: int = 0      # gauges, filled in by DiskCache.stats
    num_bytes: int = 0


class DiskCache:
    def __init__(self, root: str | Path, budget_bytes: int = 0):
        self.root = Path(root)
        self.budget_bytes = budget_bytes  # 0 = no budget
        self.quarantine_dir = self.root / QUARANTINE_DIR
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.quarantine_dir.mkdir(exist_ok=True, mode=0o700)
        self._lock = threading.Lock()
        self._index: dict[str, tuple[int, int]] = {}  # key -> (file size, last use in ns)
        self._stats = DiskCacheStats()
        self._scan()

    @classmethod
    def from_config(cls, config: KvCacheConfig) -> DiskCache | None:
        """The store under `disk_dir`, or None when the config names none."""
        if config.disk_dir is None or config.mode == "disabled":
            return None
        return cls(config.disk_dir, config.disk_budget_bytes)

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    @property
    def num_bytes(self) -> int:
        return sum(size for size, _ in self._index.values())

    @property
    def stats(self) -> DiskCacheStats:
        with self._lock:
            return dataclasses.replace(self._stats, num_files=len(self._index), num_bytes=self.num_bytes)

    def get(self, key: str) -> KVSnapshot | None:
        """The entry's snapshot (CPU tensors), or None on a miss or a bad file."""
        if key not in self._index:
            with self._lock:
                self._stats.misses += 1
            return None
        path = self._path(key)
        try:
            snapshot = read_entry(path)
        except FileNotFoundError:  # evicted by another thread or process meanwhile
            snapshot = None
        except (ValueError, KeyError, TypeError, RuntimeError, OSError) as error:  # any bad file is a miss
            log.warning("Prefix-cache file %s failed verification (%s); moved to %s", path.name, error, QUARANTINE_DIR)
            self._quarantine(path)
            snapshot = None
        if snapshot is not None:
            _touch(path)
        with self._lock:
            if snapshot is None:
                self._index.pop(key, None)
                self._stats.misses += 1
            else:
                if key in self._index:  # unless evicted meanwhile
                    self._index[key] = (self._index[key][0], time.time_ns())
                self._stats.hits += 1
        return snapshot

    def put(self, key: str, snapshot: KVSnapshot) -> bool:
        """Write the entry unless present or bigger than the whole budget; True if it is on disk."""
        if not _KEY.fullmatch(key):
            raise ValueError(f"Expected a 64-hex-digit prefix key, got {key!r}")
        if key in self._index:
            return True
        try:
            head, payload = encode_entry(snapshot)
        except ValueError as error:
            log.warning("Prefix-cache entry %s stays memory-only: %s", key[:16], error)
            return False
        size = len(head) + sum(part.nbytes for part in payload)
        if self.budget_bytes and size > self.budget_bytes:
            return False
        tmp = self.root / f".{key}.{os.getpid()}.{os.urandom(4).hex()}{TMP_SUFFIX}"
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                for part in payload:
                    f.write(memoryview(part))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path(key))
            _fsync_dir(self.root)
        except OSError as error:
            log.warning("Could not write prefix-cache file for %s (%s); the entry stays memory-only", key[:16], error)
            tmp.unlink(missing_ok=True)
            with self._lock:
                self._stats.write_errors += 1
            return False
        with self._lock:
            self._index[key] = (size, time.time_ns())
            self._stats.writes += 1
            self._enforce_budget(keep=key)
        return True

    def _path(self, key: str) -> Path:
        return self.root / f"{key}{ENTRY_SUFFIX}"

    def _scan(self) -> None:
        """Index the entries a previous run left; remove temp files of writers that died."""
        for entry in os.scandir(self.root):
            try:
                name, st = entry.name, entry.stat()
            except FileNotFoundError:  # removed meanwhile by another process
                continue
            if name.endswith(TMP_SUFFIX) and _is_abandoned(name, st.st_mtime):
                Path(entry.path).unlink(missing_ok=True)
            elif name.endswith(ENTRY_SUFFIX) and _KEY.fullmatch(name[: -len(ENTRY_SUFFIX)]):
                self._index[name[: -len(ENTRY_SUFFIX)]] = (st.st_size, st.st_mtime_ns)
        with self._lock:
            self._enforce_budget(keep=None)

    def _enforce_budget(self, keep: str | None) -> None:
        if not self.budget_bytes:
            return
        total = self.num_bytes
        for key, (size, _) in sorted(self._index.items(), key=lambda item: item[1][1]):  # oldest use first
            if total <= self.budget_bytes:
                break
            if key != keep:  # never the entry just written
                self._path(key).unlink(missing_ok=True)
                del self._index[key]
                total -= size
                self._stats.evictions += 1

    def _quarantine(self, path: Path) -> None:
        try:
            os.replace(path, self.quarantine_dir / f"{path.name}.{time.time_ns()}")
        except OSError:
            path.unlink(missing_ok=True)
        with self._lock:
            self._stats.quarantined += 1
        kept = sorted(self.quarantine_dir.iterdir(), key=lambda p: p.name.rsplit(".", 1)[-1].zfill(24))
        for old in kept[:-MAX_QUARANTINED]:
            old.unlink(missing_ok=True)


def encode_entry(snapshot: KVSnapshot) -> tuple[bytes, list]:
    """(prefix + header, payload parts): the file is their concatenation."""
    k, v = (t.detach().to("cpu").contiguous() for t in (snapshot.k, snapshot.v))
    dtype = str(k.dtype).removeprefix("torch.")
    if dtype not in DTYPES or v.dtype != k.dtype:
        raise ValueError(f"Expected k and v of one dtype in {sorted(DTYPES)}, got {k.dtype} and {v.dtype}")
    payload = [t.reshape(-1).view(torch.uint8).numpy() for t in (k, v)]
    digest = hashlib.blake2b(digest_size=32)
    for part in payload:
        digest.update(part)
    header = json.dumps({
        "num_tokens": snapshot.num_tokens, "dtype": dtype, "k_shape": list(k.shape), "v_shape": list(v.shape),
        "byteorder": sys.byteorder, "payload_bytes": sum(p.nbytes for p in payload),
        "payload_digest": digest.hexdigest(),
    }, sort_keys=True).encode()
    header += b" " * (-(PREFIX.size + len(header)) % PAYLOAD_ALIGN)
    return PREFIX.pack(MAGIC, FORMAT_VERSION, len(header), _header_digest(header)) + header, payload


def read_entry(path: Path) -> KVSnapshot:
    """Read and verify one file: magic, version, header digest, sizes, payload digest."""
    with open(path, "rb") as f:
        buf = bytearray(os.fstat(f.fileno()).st_size)  # writable, so torch.frombuffer shares it
        if f.readinto(buf) != len(buf) or len(buf) < PREFIX.size:
            raise CorruptEntryError(f"Expected at least {PREFIX.size} bytes, got {len(buf)}")
    magic, version, header_len, header_digest = PREFIX.unpack_from(buf)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise CorruptEntryError(f"Expected magic {MAGIC!r} version {FORMAT_VERSION}, got {bytes(magic)!r} {version}")
    header_bytes = bytes(buf[PREFIX.size: PREFIX.size + header_len])
    if _header_digest(header_bytes) != header_digest:
        raise CorruptEntryError("Expected the header digest to match, got a mismatch (corrupt or truncated header)")
    header = json.loads(header_bytes)
    start = PREFIX.size + header_len
    if len(buf) - start != header["payload_bytes"]:
        raise CorruptEntryError(f"Expected {header['payload_bytes']} payload bytes, got {len(buf) - start}")
    if header["byteorder"] != sys.byteorder or header["dtype"] not in DTYPES:
        raise CorruptEntryError(f"Expected native {sys.byteorder}-endian data of a known dtype, got {header}")
    if hashlib.blake2b(memoryview(buf)[start:], digest_size=32).hexdigest() != header["payload_digest"]:
        raise CorruptEntryError("Expected the payload digest to match, got a mismatch")
    dtype = DTYPES[header["dtype"]]
    tensors, offset = [], start
    for shape in (header["k_shape"], header["v_shape"]):
        numel = _numel(shape)
        tensors.append(torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset).reshape(shape))
        offset += numel * tensors[-1].element_size()
    if offset != len(buf) or tensors[0].shape[2] != header["num_tokens"]:
        raise CorruptEntryError(f"Expected shapes that fill the payload with num_tokens, got {header}")
    return KVSnapshot(*tensors)


def _header_digest(header: bytes) -> bytes:
    return hashlib.blake2b(header, digest_size=16).digest()


def _numel(shape: list[int]) -> int:
    if len(shape) != 4 or any(not isinstance(d, int) or d < 1 for d in shape):
        raise CorruptEntryError(f"Expected a 4-d shape of positive sizes, got {shape}")
    return shape[0] * shape[1] * shape[2] * shape[3]


def _is_abandoned(name: str, mtime: float) -> bool:
    """A temp file `.{key}.{pid}.{rand}.tmp` whose writer is gone (or that is very old)."""
    parts = name.split(".")
    if time.time() - mtime > STALE_TMP_SECONDS or len(parts) != 5 or not parts[2].isdigit():
        return True
    try:
        os.kill(int(parts[2]), 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists but not ours to signal
        return False
    return False


def _touch(path: Path) -> None:
    """Record a use in the mtime (the budget's order, which survives a restart)."""
    try:
        os.utime(path)
    except OSError:  # gone meanwhile, or a read-only store: the order is only advice
        pass


def _fsync_dir(path: Path) -> None:
    """Make the rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

"""A stage's packed weights kept on disk and memory-mapped on the next start, instead of packed again.

Packing a GGUF's blocks into the kernel's layout (quant.py) costs seconds a gigabyte; a
restart, a standby or a stage re-placed after a lost host would pay it every time, so
recovery would slow with the model's size. Layout, key and placement: docs/architecture.md
("Start-up at the disk's speed"). The key holds everything the bytes depend on, and a matmul
is read only when its index (written after its fsync'ed, renamed bytes) names exactly the
bytes found, so a crash mid-write leaves a matmul that is packed again, never a wrong one.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import mmap
import os
import platform
import shutil
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from . import qkernel
from .fingerprint import model_fingerprint
from .locate import cache_root

log = logging.getLogger(__name__)

FORMAT = 1  # of the files below; the packing itself is keyed by quant.py's source
KEPT = 4  # packed models kept; the least recently used beyond this are deleted
ALIGN = 4096  # every tensor in a matmul's file starts on a page
MADV_POPULATE_READ = 22  # Linux 5.14+: fault the mapping in, as reads
IOPRIO_SET, IOPRIO_WHO_PROCESS, IOPRIO_IDLE = 251, 1, 3 << 13  # x86-64 ioprio_set: the idle class


def packed_root() -> Path:
    return cache_root() / "packed"


def model_key(path: str | Path) -> str:
    """The directory name of `path`'s packed weights for this kernel build."""
    path = Path(path).resolve()
    stat = path.stat()
    identity = f"{stat.st_dev}:{stat.st_ino}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.blake2b(f"{FORMAT}\0{identity}\0{_packing_identity()}".encode(), digest_size=8).hexdigest()
    return f"{model_fingerprint(path)[:16]}-{digest}"


@functools.cache
def _packing_identity() -> str:
    """The kernel build's key (its sources include pack.c) and the Python that packs."""
    source = b"".join(Path(__file__).with_name(name).read_bytes() for name in ("quant.py", "quant_linear.py"))
    return qkernel.build_key(qkernel.FLAGS) + hashlib.blake2b(source, digest_size=8).hexdigest()


class PackedCache:
    """One model's packed matmuls on disk, by name (e.g. "blk.3.attn_q.weight+...-x1").

    `load(name)` maps a stored matmul's tensors; `store(name, meta, tensors)` queues one
    for writing by the background writer; `close()` waits for it."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._queue: list[tuple[str, dict, dict[str, torch.Tensor]]] = []
        self._writer: threading.Thread | None = None
        self._lock = threading.Lock()
        self.loaded_bytes = 0

    @classmethod
    def for_model(cls, path: str | Path) -> "PackedCache | None":
        """The cache of `path`'s packed weights, or None where no cache directory can be made."""
        directory = packed_root() / model_key(path)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            os.utime(directory)  # most recently used
        except OSError as e:
            log.warning("packed weights will not be kept for the next start: %s", e)
            return None
        _evict_beyond(KEPT, keep=directory)
        _remove_stale_writes(directory)
        return cls(directory)

    def load(self, name: str) -> tuple[dict, dict[str, torch.Tensor]] | None:
        """(meta, tensors) of a stored matmul, its bytes mapped and faulted in; None when absent
        or when the files disagree with each other (an interrupted write: pack it again)."""
        index, data = self.directory / f"{name}.json", self.directory / f"{name}.bin"
        try:
            record = json.loads(index.read_text())
            fd = os.open(data, os.O_RDONLY)
        except (OSError, ValueError):
            return None
        try:
            size = os.fstat(fd).st_size
            if record.get("format") != FORMAT or record.get("size") != size:
                return None
            region = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) if size else None
        finally:
            os.close(fd)
        _populate(region)
        with warnings.catch_warnings():  # read-only on purpose: the kernels never write weights
            warnings.simplefilter("ignore", UserWarning)
            whole = torch.frombuffer(region, dtype=torch.uint8) if region is not None else torch.empty(0, dtype=torch.uint8)
        tensors = {}
        for entry in record["tensors"]:
            dtype = getattr(torch, entry["dtype"])
            part = whole[entry["offset"] : entry["offset"] + entry["nbytes"]]
            tensors[entry["name"]] = part.view(dtype).view(entry["shape"])
            self.loaded_bytes += entry["nbytes"]
        return record["meta"], tensors

    def store(self, name: str, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Write a matmul for the next start, later, on the writer thread (start_writing).
        Its bytes are taken here, as numpy arrays over the tensors' memory, so that the writer
        makes no torch call: a process may exit mid-write, and CPython ends a daemon thread
        that wakes inside a torch call then with pthread_exit, whose unwinding through torch's
        C++ aborts the process ("terminate called without an active exception")."""
        entries, arrays, offset = [], [], 0
        for key, tensor in tensors.items():
            entries.append({"name": key, "dtype": str(tensor.dtype).removeprefix("torch."),
                            "shape": list(tensor.shape), "offset": offset, "nbytes": tensor.nbytes})
            arrays.append(tensor.contiguous().view(torch.uint8).numpy())
            offset = -(-(offset + tensor.nbytes) // ALIGN) * ALIGN
        record = {"format": FORMAT, "size": offset, "meta": meta, "tensors": entries}
        with self._lock:
            self._queue.append((name, record, arrays))

    def start_writing(self) -> None:
        """Write what `store` queued on a thread of its own (the stage serves meanwhile)."""
        with self._lock:
            if not self._queue or self._writer is not None:
                return
            queue, self._queue = self._queue, []
        needed = sum(a.nbytes for _, _, arrays in queue for a in arrays)
        free = shutil.disk_usage(self.directory).free
        if needed + (1 << 30) > free:
            log.warning("packed weights not kept for the next start: they need %d MiB and %d MiB of disk are free",
                        needed >> 20, free >> 20)
            return
        self._writer = threading.Thread(target=self._write_all, args=(queue,), name="skippy-packed-writer",
                                        daemon=True)
        self._writer.start()

    def close(self) -> None:
        """Wait for the writer (tests; a process may also exit with it unfinished)."""
        if self._writer is not None:
            self._writer.join()

    def _write_all(self, queue) -> None:
        _lower_priority()  # the stage serves meanwhile: its threads come first
        try:
            for name, record, arrays in queue:
                self._write(name, record, arrays)
        except OSError as e:  # a full disk, a cache directory deleted under us: the next start packs
            log.warning("packed weights not kept for the next start: %s", e)

    def _write(self, name: str, record: dict, arrays: list[np.ndarray]) -> None:
        data = self.directory / f"{name}.bin"
        tmp = data.with_name(f".{data.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as out:
            for entry, array in zip(record["tensors"], arrays):
                out.seek(entry["offset"])
                out.write(array.data)
            out.truncate(record["size"])
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, data)
        _write_atomically(self.directory / f"{name}.json", json.dumps(record).encode())


def _lower_priority() -> None:
    """This thread's CPU and I/O priority to the lowest (Linux: both are per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        if platform.machine() == "x86_64":  # the syscall's number is the architecture's
            libc = ctypes.CDLL(None, use_errno=True)
            libc.syscall(IOPRIO_SET, IOPRIO_WHO_PROCESS, threading.get_native_id(), IOPRIO_IDLE)
    except (OSError, AttributeError):
        pass


def _populate(region: mmap.mmap | None) -> None:
    """Fault the mapping in now (read from the disk at its speed when cold), not in the first step."""
    if region is None:
        return
    try:
        region.madvise(MADV_POPULATE_READ)
    except (OSError, ValueError):  # before Linux 5.14: touch a byte a page
        view = np.frombuffer(region, dtype=np.uint8)
        int(view[:: mmap.PAGESIZE].sum())


def _write_atomically(path: Path, content: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as out:
        out.write(content)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


STALE_WRITE_S = 3600  # a temporary file this old belongs to a writer that died


def _remove_stale_writes(directory: Path) -> None:
    """A process that exits while its writer runs leaves a temporary file: remove old ones."""
    now = time.time()
    for tmp in directory.glob(".*.tmp"):
        try:
            if now - tmp.stat().st_mtime > STALE_WRITE_S:
                tmp.unlink()
        except OSError:
            pass


def _evict_beyond(kept: int, keep: Path) -> None:
    """Delete the least recently used packed models beyond `kept` (never `keep`). A process still
    mapping a deleted one keeps its pages: Linux frees them with the last mapping."""
    try:
        directories = sorted((d for d in packed_root().iterdir() if d.is_dir() and d != keep),
                             key=lambda d: d.stat().st_mtime, reverse=True)
    except OSError:
        return
    for stale in directories[kept - 1 :]:
        shutil.rmtree(stale, ignore_errors=True)

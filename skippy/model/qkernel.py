"""The quantized matmul kernel (kernels/qmatmul.c): built for this CPU, loaded, called.

The C file is compiled once per machine with the system C compiler
(-march=native: its vector code depends on the CPU, as llama.cpp's native
builds do) into ~/.cache/skippy/kernels (or $SKIPPY_CACHE_DIR), keyed by the
source, the flags, the compiler and the CPU, so a copied cache never runs code
built for another machine. Building takes about a second and happens while a
model loads, never on a request.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch  # first: the kernel links libgomp.so.1 and so shares the pool torch loaded

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "qmatmul.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]


class KernelUnavailable(RuntimeError):
    pass


def cache_dir() -> Path:
    root = os.environ.get("SKIPPY_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "skippy"
    return Path(root) / "kernels"


def _cpu_identity() -> str:
    """The CPU's model and feature flags (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo") as info:
            lines = [line for line in info if line.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _compiler() -> str:
    return os.environ.get("CC", "cc")


@functools.cache
def library() -> ctypes.CDLL:
    """The kernel library, built on first use; KernelUnavailable says why it cannot be."""
    compiler = _compiler()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"no C compiler ({compiler}: {e})") from None
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_identity(),
                                    platform.machine()]).encode()).hexdigest()[:16]
    path = cache_dir() / f"qmatmul-{key}.so"
    if not path.exists():
        _build(compiler, path)
    lib = ctypes.CDLL(str(path))
    lib.skippy_qmatmul.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.skippy_qmatmul.restype = ctypes.c_int
    log.debug("quantized matmul kernel %s (AVX512-VNNI path: %s)", path, bool(lib.skippy_qmatmul_vector_path()))
    return lib


def _build(compiler: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # several stage processes may build at once: each writes its own file and renames it into place
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            raise KernelUnavailable(f"{compiler} failed to build {SOURCE.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"{compiler} failed to build {SOURCE.name}: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def available() -> bool:
    """Whether the kernel can run here; says once in the log why not."""
    try:
        library()
        return True
    except KernelUnavailable as e:
        log.warning("quantized weights fall back to bfloat16 (about 2-3x their file size in memory, and slower): %s. "
                    "Fix: install a C compiler (e.g. apt install gcc), or set CC to one", e)
        return False


def qmatmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int,
            out_features: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] float32 contiguous -> [T, out_features] float32; with `out`, adds into it."""
    rows, in_features = x.shape
    accumulate = out is not None
    if out is None:
        out = torch.empty(rows, out_features, dtype=torch.float32)
    status = library().skippy_qmatmul(x.data_ptr(), rows, in_features, codes.data_ptr(), scale.data_ptr(),
                                      offset.data_ptr(), bits, out_features, out.data_ptr(), int(accumulate))
    if status:
        raise RuntimeError(f"qmatmul failed ({status}): x {tuple(x.shape)}, {out_features} x {in_features} weights, "
                           f"{bits} bits")
    return out

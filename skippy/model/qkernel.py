"""Our CPU kernels (kernels/*.c): built for this CPU, loaded, called.

qmatmul.c multiplies by quantized weights; rows.c holds the per-row pieces of a
decode step (RMS norm, RoPE, one row's attention, SwiGLU); layers.c runs them all
for a decode step's layer range in one call (DecodeLayers). The C files are
compiled once per machine with the system C compiler (-march=native: its vector
code depends on the CPU, as llama.cpp's native builds do) into
~/.cache/skippy/kernels (or $SKIPPY_CACHE_DIR), keyed by the source, the flags,
the compiler and the CPU, so a copied cache never runs code built for another
machine. Building takes about a second and happens while a model loads, never on
a request.
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
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch  # first: the kernel links libgomp.so.1 and so shares the pool torch loaded

from .locate import cache_root

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("kernels") / name for name in ("qmatmul.c", "rows.c", "layers.c", "probe.c")]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
# glibc's vector expf (rows.c calls it where glibc and AVX-512 are), then libm
LIBS = (["-lmvec"] if platform.libc_ver()[0] == "glibc" else []) + ["-lm"]


_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
SIGNATURES = {  # the C functions' (argument types, return type), in their argument order
    "skippy_qmatmul": ([_P, _I, _I, _P, _P, _P, _I, _I, _I, _P, _I], _I),
    "skippy_rms_norm": ([_P, _I, _I, _P, _F, _P], None),
    "skippy_attend_rows": ([_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _I, _I, _F, _P], _I),
    "skippy_decode_attention": ([_P, _I, _I, _I, _I, _P, _P, _P, _P, _I, _I, _I, _F, _P], _I),
    "skippy_head_rms_norm": ([_P, _I, _I, _I, _I, _I, _P, _F], None),
    "skippy_rope": ([_P, _I, _I, _I, _I, _P, _P], None),
    "skippy_swiglu": ([_P, _I, _I, _P], None),
    "skippy_geglu": ([_P, _I, _I, _P], None),
    "skippy_qmatmul_vector_path": ([], _I),
    "skippy_decode_layers": ([_P, _I, _I, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _I, _P, _P, _I, _F, _F,
                              _P, _P, _I, _P, _P, _P, _P, _P], _I),
    "skippy_greedy_pick": ([_P, _I, _P, _P, _I], _I),
    "skippy_embed_rows": ([_P, ctypes.c_int64, ctypes.c_int64, _I, _P, _I, _I, _P], _I),
    "skippy_read_probe": ([_P, ctypes.c_size_t], ctypes.c_uint64),
}


class KernelUnavailable(RuntimeError):
    pass


def cache_dir() -> Path:
    return cache_root() / "kernels"


def _writable(directory: Path) -> Path:
    """`directory`, or a per-user one under the temp dir where it cannot be made
    (a read-only home in a container): a build must not fail for want of a cache."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if os.access(directory, os.W_OK):
            return directory
    except OSError:
        pass
    fallback = Path(tempfile.gettempdir()) / f"skippy-kernels-{os.getuid()}"
    fallback.mkdir(parents=True, exist_ok=True)
    return fallback


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
    """The kernel library for this CPU, built on first use; KernelUnavailable says why it cannot be."""
    return build(FLAGS)


def build(flags: list[str]) -> ctypes.CDLL:
    """The kernels compiled with `flags` (cached on disk), loaded. Tests build variants
    (-mno-avx512f: the plain C paths) through this too."""
    compiler = _compiler()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"no C compiler ({compiler}: {e})") from None
    key = hashlib.sha256("\0".join([*(s.read_text() for s in SOURCES), " ".join(flags + LIBS), version,
                                    _cpu_identity(), platform.machine()]).encode()).hexdigest()[:16]
    path = _writable(cache_dir()) / f"skippy-kernels-{key}.so"
    if not path.exists():
        _build(compiler, flags, path)
    lib = ctypes.CDLL(str(path))
    for name, (argtypes, restype) in SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    log.debug("kernels %s (AVX512-VNNI path: %s)", path, bool(lib.skippy_qmatmul_vector_path()))
    return lib


def _build(compiler: str, flags: list[str], path: Path) -> None:
    # several stage processes may build at once: each writes its own file and renames it into place
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, "-o", tmp, *map(str, SOURCES), *LIBS], capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            raise KernelUnavailable(f"{compiler} failed to build our kernels: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"{compiler} failed to build our kernels: {e}") from None
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
        log.warning("our CPU kernels are unavailable, so quantized weights fall back to bfloat16 (2-3x their file "
                    "size in memory) and decode runs slower: %s. "
                    "Fix: install a C compiler (e.g. apt install gcc), or set CC to one", e)
        return False


def qmatmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int,
            out_features: int, out: torch.Tensor | None = None, *, levels: int) -> torch.Tensor:
    """x [T, in] float32 contiguous -> [T, out_features] float32; with `out`, adds into it.
    `levels`: the int8 levels x is rounded to per group (1, or 2 for a 128x finer x)."""
    rows, in_features = x.shape
    accumulate = out is not None
    if out is None:
        out = torch.empty(rows, out_features, dtype=torch.float32)
    status = library().skippy_qmatmul(x.data_ptr(), rows, in_features, codes.data_ptr(), scale.data_ptr(),
                                      offset.data_ptr(), bits, levels, out_features, out.data_ptr(), int(accumulate))
    if status:
        raise RuntimeError(f"qmatmul failed ({status}): x {tuple(x.shape)}, {out_features} x {in_features} weights, "
                           f"{bits} bits, {levels} levels")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, D] float32 contiguous, weight [D] float32 -> [T, D] float32."""
    out = torch.empty_like(x)
    library().skippy_rms_norm(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), eps, out.data_ptr())
    return out


def attend_rows(qkv: torch.Tensor, heads: int, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
                window: int = 0) -> torch.Tensor:
    """One session's consecutive rows at positions start.. : the q heads (the first
    `heads`) of qkv [n, row_heads, head_dim] float32 contiguous, each over the cached
    keys it sees, exactly as a decode step computes that row. k, v [kv_heads, >= start + n,
    head_dim] float16 or float32 with rows contiguous (the session's cache, written
    through start + n); returns [n, heads * head_dim]."""
    n, row_heads, head_dim = qkv.shape
    out = torch.empty(n, heads * head_dim, dtype=torch.float32)
    status = library().skippy_attend_rows(qkv.data_ptr(), n, row_heads, heads, k.shape[0], head_dim, k.data_ptr(),
                                          v.data_ptr(), k.dtype == torch.float16, k.stride(0) // head_dim, start,
                                          window, scale, out.data_ptr())
    if status:
        raise RuntimeError(f"attend_rows failed ({status}): qkv {tuple(qkv.shape)}, cache {tuple(k.shape)}, "
                           f"start {start}")
    return out


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """A forward's sessions that each add one row, as skippy_decode_attention reads them:
    their caches' addresses and capacities and the position each row goes to. Built once
    per forward (the caches were reserved), used by every layer."""

    k: ctypes.Array
    v: ctypes.Array
    capacity: ctypes.Array
    position: ctypes.Array
    f16: bool

    @classmethod
    def of(cls, keys: list[torch.Tensor], values: list[torch.Tensor], positions: list[int]) -> "DecodeRows":
        """keys, values: each session's contiguous [layers, kv_heads, capacity, head_dim] cache."""
        n = len(keys)
        return cls((ctypes.c_void_p * n)(*(k.data_ptr() for k in keys)),
                   (ctypes.c_void_p * n)(*(v.data_ptr() for v in values)),
                   (ctypes.c_int * n)(*(k.shape[2] for k in keys)), (ctypes.c_int * n)(*positions),
                   keys[0].dtype == torch.float16)  # fmt: skip


def decode_attention(qkv: torch.Tensor, rows: DecodeRows, layer: int, heads: int, kv_heads: int,
                     scale: float, window: int = 0) -> torch.Tensor:
    """Store each session's new k, v row of qkv [S, heads + 2 kv_heads, head_dim] float32
    contiguous (RoPE applied) in its cache at `layer`, and attend its query row over its
    cache (its last `window` positions, when > 0): [S, heads * head_dim], each row as
    attend_rows computes it alone."""
    sessions, _, head_dim = qkv.shape
    out = torch.empty(sessions, heads * head_dim, dtype=torch.float32)
    status = library().skippy_decode_attention(qkv.data_ptr(), sessions, heads, kv_heads, head_dim, rows.k, rows.v,
                                               rows.capacity, rows.position, layer, window, rows.f16, scale,
                                               out.data_ptr())
    if status:
        raise RuntimeError(f"decode_attention failed ({status}): qkv {tuple(qkv.shape)}, layer {layer}")
    return out


def rope_(x: torch.Tensor, heads: int, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE in place on the first `heads` heads of x [T, row_heads, head_dim] float32
    contiguous; cos, signed_sin [T, head_dim] contiguous. Returns x."""
    rows, row_heads, head_dim = x.shape
    library().skippy_rope(x.data_ptr(), rows, row_heads, heads, head_dim, cos.data_ptr(), signed_sin.data_ptr())
    return x


def head_rms_norm_(x: torch.Tensor, first: int, count: int, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm in place over heads [first, first + count) of x [T, row_heads, head_dim]
    float32 contiguous, weight [head_dim] float32. Returns x."""
    rows, row_heads, head_dim = x.shape
    library().skippy_head_rms_norm(x.data_ptr(), rows, row_heads, first, count, head_dim, weight.data_ptr(), eps)
    return x


def geglu(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up of gate_up [T, 2F] float32 contiguous (gate first) -> [T, F]."""
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=torch.float32)
    library().skippy_geglu(gate_up.data_ptr(), rows, width // 2, out.data_ptr())
    return out


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [T, 2F] float32 contiguous (gate first) -> [T, F]."""
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=torch.float32)
    library().skippy_swiglu(gate_up.data_ptr(), rows, width // 2, out.data_ptr())
    return out


LAYER_FIELDS = 23  # int64 per layer in skippy_decode_layers' table (kernels/layers.c)


class DecodeLayers:
    """A stage's llama blocks (quantized matmuls without biases, SwiGLU, RMS norms, one
    RoPE table, no per-head or post norms) as skippy_decode_layers runs them: a decode
    step's whole layer range in one call, each row bit for bit what the forward's
    per-layer loop computes (the same kernels, in the same order)."""

    def __init__(self, layers: list[tuple], heads: int, kv_heads: int, head_dim: int, ffn: int, eps: float,
                 scale: float, head: tuple | None = None):
        """layers: per layer (attn_norm, ffn_norm, wqkv, wo, w_gate_up, w_down, window), the
        norms float32 [D], the matmuls QuantLinear (codes, scale, offset, bits, levels).
        head: (output norm float32 [D], QuantLinear) of the final stage, whose logits the
        call then computes too (`__call__`'s `logits`)."""
        table = []
        for attn_norm, ffn_norm, *matmuls, window in layers:
            fields = [attn_norm.data_ptr(), ffn_norm.data_ptr()]
            for m in matmuls:
                fields += _matmul_fields(m)
            table.append([*fields, window])
        self.table = torch.tensor(table, dtype=torch.int64)
        assert self.table.shape[1] == LAYER_FIELDS
        self._weights = [t for layer in layers for t in layer[:2]]  # the table points into these
        self._weights += [m for layer in layers for m in layer[2:6]]
        self.head, self.vocab = None, 0
        if head is not None:
            self._weights += list(head)
            self.head_norm, matmul = head
            self.head, self.vocab = torch.tensor(_matmul_fields(matmul), dtype=torch.int64), matmul.out_features
        self.heads, self.kv_heads, self.head_dim, self.ffn, self.eps, self.scale = (
            heads, kv_heads, head_dim, ffn, eps, scale)

    def __call__(self, x: torch.Tensor, rows: DecodeRows, cos: torch.Tensor, signed_sin: torch.Tensor,
                 logits: torch.Tensor | None = None, picks: GreedyPicks | None = None) -> torch.Tensor:
        """x [S, D] float32 contiguous, one row per session of `rows`, through every layer
        in place; cos, signed_sin: the RoPE tables [positions, head_dim] contiguous, read at
        the rows' positions. With `logits` [S, vocab] float32 contiguous (a call built with a
        head), the rows' logits are written there as well, and with `picks` the greedy token
        of the rows it asks for (GreedyPicks.tokens). Returns x."""
        x = x.contiguous()
        sessions, hidden = x.shape
        output = (None, None, 0, None)  # the head's norm, its matmul, the vocab, logits: none asked for
        if logits is not None:
            if self.head is None:
                raise ValueError("logits need a DecodeLayers built with the output head")
            output = (self.head_norm.data_ptr(), self.head.data_ptr(), self.vocab, logits.data_ptr())
        chosen = (None, None, None, None)
        if picks is not None:
            if logits is None:
                raise ValueError("greedy picks need the logits they are picked from")
            chosen = (picks.start, picks.ids, picks.values, picks.out)
        status = library().skippy_decode_layers(
            x.data_ptr(), sessions, hidden, self.heads, self.kv_heads, self.head_dim, self.ffn, len(self.table),
            self.table.data_ptr(), rows.k, rows.v, rows.capacity, rows.position, rows.f16, cos.data_ptr(),
            signed_sin.data_ptr(), cos.shape[0], self.eps, self.scale, *output, *chosen)  # fmt: skip
        if status:
            raise RuntimeError(f"decode_layers failed ({status}): x {tuple(x.shape)}")
        return x


class GreedyPicks:
    """The rows whose greedy token a decode call picks as it writes their logits: per row
    None (the sampler picks) or the logit_bias (token ids, values) to add first, as
    RequestSampler's greedy pick does. `tokens()` after the call: per row the id, or None."""

    def __init__(self, biases: list[tuple[list[int], list[float]] | None]):
        n = len(biases)
        ids = [i for bias in biases if bias is not None for i in bias[0]]
        values = [v for bias in biases if bias is not None for v in bias[1]]
        starts = [0]
        for bias in biases:
            starts.append(starts[-1] + (0 if bias is None else len(bias[0])))
        self.start = (ctypes.c_int * (n + 1))(*starts)
        self.ids = (ctypes.c_int * max(1, len(ids)))(*ids)
        self.values = (ctypes.c_float * max(1, len(values)))(*values)
        self.out = (ctypes.c_int * n)(*(bias is not None for bias in biases))  # in: wanted; out: the id

    def tokens(self) -> list[int | None]:
        return [None if token < 0 else token for token in self.out]


def embed_rows(raw: np.ndarray, block_bytes: int, ids: torch.Tensor, cols: int) -> torch.Tensor:
    """float32 [n, cols]: rows `ids` of a GGUF tensor in legacy blocks of 32 (`block_bytes` a
    block: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), raw its bytes [rows, row bytes], e.g. the memory map."""
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.shape[0], cols, dtype=torch.float32)
    status = library().skippy_embed_rows(raw.ctypes.data, raw.shape[1], raw.shape[0], block_bytes, ids.data_ptr(),
                                         ids.shape[0], cols, out.data_ptr())
    if status:
        raise ValueError(f"embed_rows failed ({status}): ids {ids.tolist()} of {raw.shape[0]} rows")
    return out


def read_bandwidth(buffer: torch.Tensor, rounds: int = 5) -> float:
    """The best of `rounds` timed passes of the thread team reading `buffer` (contiguous,
    far larger than the last-level cache), in bytes per second (kernels/probe.c)."""
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        library().skippy_read_probe(buffer.data_ptr(), buffer.nbytes)
        best = min(best, time.perf_counter() - started)
    return buffer.nbytes / best


def greedy_pick(row: torch.Tensor, ids: list[int], values: list[float]) -> int:
    """The kernel's greedy pick of one float32 row [V] with `values` added at `ids` (the row
    is patched for the scan and put back), as the decode call picks each row."""
    if row.dtype != torch.float32 or row.dim() != 1 or not row.is_contiguous():
        raise ValueError(f"Expected a contiguous float32 row, got {row.dtype} {tuple(row.shape)}")
    status = library().skippy_greedy_pick(row.data_ptr(), row.shape[0], (ctypes.c_int * max(1, len(ids)))(*ids),
                                          (ctypes.c_float * max(1, len(values)))(*values), len(ids))
    if status < 0:
        raise ValueError(f"greedy_pick failed ({status}): ids {ids} for a row of {row.shape[0]}")
    return status


def _matmul_fields(m) -> list[int]:
    """A QuantLinear as skippy_decode_layers reads a matmul: codes, scale, offset, bits, levels."""
    return [m.codes.data_ptr(), m.scale.data_ptr(), m.offset.data_ptr(), m.bits, m.levels]

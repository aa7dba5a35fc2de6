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
from pathlib import Path

import numpy as np
import torch  # first: the kernel links libgomp.so.1 and so shares the pool torch loaded

from .locate import cache_root

log = logging.getLogger(__name__)

KERNELS = Path(__file__).with_name("kernels")
SOURCES = sorted(KERNELS.glob("*.c"))
HEADERS = sorted(KERNELS.glob("*.h"))  # the build depends on these as well
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-Wall", "-Wextra")
# glibc's vector expf (rows.c calls it where glibc and AVX-512 are), then libm
LIBS = (["-lmvec"] if platform.libc_ver()[0] == "glibc" else []) + ["-lm"]
MAX_PARTS = 3  # SKIPPY_MAX_PARTS


# ctypes mirrors of skippy_kernels.h's structures (tests/test_kernel_build.py holds them to the C layout)
class Part(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("offset", ctypes.c_void_p),
                ("sub", ctypes.c_void_p), ("format", ctypes.c_int32), ("rows", ctypes.c_int32)]


class Matmul(ctypes.Structure):
    _fields_ = [("rows", ctypes.c_int32), ("cols", ctypes.c_int32), ("levels", ctypes.c_int32),
                ("num_parts", ctypes.c_int32), ("part", Part * MAX_PARTS)]


class Layer(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p), ("qkv", Matmul), ("out", Matmul),
                ("gate_up", Matmul), ("down", Matmul), ("window", ctypes.c_int32)]


class DecodeModel(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int32), ("heads", ctypes.c_int32), ("kv_heads", ctypes.c_int32),
                ("head_dim", ctypes.c_int32), ("ffn", ctypes.c_int32), ("num_layers", ctypes.c_int32),
                ("table_rows", ctypes.c_int32), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("layers", ctypes.POINTER(Layer)), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("out_norm", ctypes.c_void_p), ("head", ctypes.POINTER(Matmul))]


class Sessions(ctypes.Structure):
    _fields_ = [("count", ctypes.c_int32), ("f16", ctypes.c_int32), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
                ("capacity", ctypes.c_void_p), ("pos", ctypes.c_void_p)]


class Picks(ctypes.Structure):
    _fields_ = [("from", ctypes.c_void_p), ("ids", ctypes.c_void_p), ("values", ctypes.c_void_p),
                ("picked", ctypes.c_void_p)]


STRUCTURES = {"skippy_part": Part, "skippy_matmul": Matmul, "skippy_layer": Layer, "skippy_decode_model": DecodeModel,
              "skippy_sessions": Sessions, "skippy_picks": Picks}

_P, _I, _F, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_int64
_MATMUL = ctypes.POINTER(Matmul)
SIGNATURES = {  # the C functions' (argument types, return type), in their argument order
    "skippy_qmatmul": ([_P, _I, _MATMUL, _P, _I], _I),
    "skippy_qmatmul_vector_path": ([], _I),
    "skippy_qmatmul_amx": ([], _I),
    "skippy_qmatmul_bf16": ([_P, _I, _MATMUL, _P, _I], _I),
    "skippy_qmatmul_bf16_ready": ([], _I),
    "skippy_pack_q4k": ([_P, _I64, _P, _I, _I, _P, _P, _P], _I),
    "skippy_pack_q6k": ([_P, _I64, _P, _I, _I, _P, _P, _P], _I),
    "skippy_rms_norm": ([_P, _I, _I, _P, _F, _P], None),
    "skippy_attend_rows": ([_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _I, _I, _F, _P], _I),
    "skippy_decode_attention": ([_P, ctypes.POINTER(Sessions), _I, _I, _I, _I, _I, _F, _P], _I),
    "skippy_head_rms_norm": ([_P, _I, _I, _I, _I, _I, _P, _F], None),
    "skippy_rope": ([_P, _I, _I, _I, _I, _P, _P], None),
    "skippy_swiglu": ([_P, _I, _I, _P], None),
    "skippy_geglu": ([_P, _I, _I, _P], None),
    "skippy_decode_layers": ([ctypes.POINTER(DecodeModel), _P, ctypes.POINTER(Sessions), _P,
                              ctypes.POINTER(Picks)], _I),
    "skippy_greedy_pick": ([_P, _I, _P, _P, _I], _I),
    "skippy_embed_rows": ([_P, _I64, _I64, _I, _P, _I, _I, _P], _I),
    "skippy_read_probe": ([_P, ctypes.c_size_t], ctypes.c_uint64),
    "skippy_abi_offset": ([ctypes.c_char_p, ctypes.c_char_p], ctypes.c_size_t),
    "skippy_abi_fields": ([ctypes.c_char_p], _I),
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


def build(flags: tuple[str, ...] | list[str]) -> ctypes.CDLL:
    """The kernels compiled with `flags` (cached on disk), loaded. Tests build variants
    (-mno-avx512f: the plain C paths) through this too."""
    compiler = _compiler()
    path = _writable(cache_dir()) / f"skippy-kernels-{build_key(flags)}.so"
    if not path.exists():
        _build(compiler, flags, path)
    lib = ctypes.CDLL(str(path))
    for name, (argtypes, restype) in SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    log.debug("kernels %s (AVX512-VNNI path: %s)", path, bool(lib.skippy_qmatmul_vector_path()))
    return lib


def build_key(flags: tuple[str, ...] | list[str]) -> str:
    """What a build with `flags` depends on, hashed: the sources, the flags, the compiler's
    version, the CPU's model and feature flags (what -march=native compiles for)."""
    return _build_key(tuple(flags))


@functools.cache
def _build_key(flags: tuple[str, ...]) -> str:
    compiler = _compiler()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"no C compiler ({compiler}: {e})") from None
    return hashlib.sha256("\0".join([*(s.read_text() for s in SOURCES + HEADERS), " ".join([*flags, *LIBS]), version,
                                     _cpu_identity(), platform.machine()]).encode()).hexdigest()[:16]


def _build(compiler: str, flags: list[str], path: Path) -> None:
    # several stage processes may build at once: each writes its own file and renames it into place
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, "-o", tmp, *map(str, SOURCES), *LIBS], capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            raise KernelUnavailable(f"{compiler} failed to build our kernels: {done.stderr.strip()[-2000:]}")
        if done.stderr.strip():  # warnings: the sources build clean with -Wall -Wextra (tests/test_kernel_build.py)
            log.warning("%s warned building our kernels: %s", compiler, done.stderr.strip()[-2000:])
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


def qmatmul(x: torch.Tensor, matmul: Matmul, out: torch.Tensor | None = None, bf16: bool = False) -> torch.Tensor:
    """x [T, in] float32 contiguous through `matmul` (a QuantLinear's) -> [T, out] float32; with
    `out`, adds into it. `bf16`: on AMX-BF16 tiles (bf16_ready()), bfloat16's precision instead of
    the integer paths' bits (--prefill-precision bf16; kernels/qmatmul_avx512.c)."""
    rows, in_features = x.shape
    accumulate = out is not None
    if out is None:
        out = torch.empty(rows, matmul.rows, dtype=torch.float32)
    kernel = library().skippy_qmatmul_bf16 if bf16 else library().skippy_qmatmul
    status = kernel(x.data_ptr(), rows, ctypes.byref(matmul), out.data_ptr(), int(accumulate))
    if status:
        raise RuntimeError(f"qmatmul failed ({status}): x {tuple(x.shape)}, {matmul.rows} x {matmul.cols} weights "
                           f"in {matmul.num_parts} parts, {matmul.levels} levels")
    return out


@functools.cache
def bf16_ready() -> bool:
    """Whether qmatmul's bf16 path runs here: the kernels built for AMX-BF16 and the OS's tile
    data granted (SKIPPY_AMX=0 turns it off with the int8 tiles)."""
    return available() and bool(library().skippy_qmatmul_bf16_ready())


def matmul_struct(parts, rows: int, cols: int, levels: int) -> Matmul:
    """A matmul's skippy_matmul over its packed parts (quant_linear.PackedPart), which must
    outlive it."""
    if len(parts) > MAX_PARTS:
        raise ValueError(f"Expected at most {MAX_PARTS} parts in a matmul, got {len(parts)}")
    matmul = Matmul(rows, cols, levels, len(parts))
    for slot, part in zip(matmul.part, parts):
        pointer = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        slot.codes, slot.scale, slot.offset, slot.sub = (pointer(part.codes), pointer(part.scale),
                                                         pointer(part.offset), pointer(part.sub))
        slot.format, slot.rows = part.format, part.rows
    return matmul


def pack_k(six: bool, raw: np.ndarray, row_order: np.ndarray | None, rows: int, cols: int, codes: torch.Tensor,
           scale: torch.Tensor, sub: torch.Tensor) -> None:
    """A Q4_K (or, with six, Q6_K) tensor's rows [rows, bytes per row] of GGUF super-blocks into
    the kernel's q4k (q6k) tensors (kernels/pack.c), rows taken in `row_order` when given."""
    if not (raw.flags.c_contiguous and codes.is_contiguous() and scale.is_contiguous() and sub.is_contiguous()):
        raise ValueError("pack_k needs contiguous arrays")
    order = None if row_order is None else np.ascontiguousarray(row_order, dtype=np.int64)
    pack = library().skippy_pack_q6k if six else library().skippy_pack_q4k
    status = pack(raw.ctypes.data, raw.shape[1] if raw.ndim == 2 else raw.nbytes // raw.shape[0],
                  None if order is None else order.ctypes.data, rows, cols, codes.data_ptr(), scale.data_ptr(),
                  sub.data_ptr())
    if status:
        raise ValueError(f"pack_k failed ({status}): {rows} x {cols} from {raw.shape}")


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


class DecodeRows:
    """A forward's sessions that each add one row, as skippy_decode_attention reads them
    (skippy_sessions): their caches' addresses and capacities and the position each row goes
    to. Built once per forward (the caches were reserved), used by every layer."""

    __slots__ = ("k", "v", "capacity", "position", "f16", "struct")

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], positions: list[int]):
        """keys, values: each session's contiguous [layers, kv_heads, capacity, head_dim] cache."""
        n = len(keys)
        self.k = (ctypes.c_void_p * n)(*(k.data_ptr() for k in keys))
        self.v = (ctypes.c_void_p * n)(*(v.data_ptr() for v in values))
        self.capacity = (ctypes.c_int32 * n)(*(k.shape[2] for k in keys))
        self.position = (ctypes.c_int32 * n)(*positions)
        self.f16 = keys[0].dtype == torch.float16
        self.struct = Sessions(n, int(self.f16), ctypes.addressof(self.k), ctypes.addressof(self.v),
                               ctypes.addressof(self.capacity), ctypes.addressof(self.position))

    @classmethod
    def of(cls, keys: list[torch.Tensor], values: list[torch.Tensor], positions: list[int]) -> "DecodeRows":
        return cls(keys, values, positions)


def decode_attention(qkv: torch.Tensor, rows: DecodeRows, layer: int, heads: int, kv_heads: int,
                     scale: float, window: int = 0) -> torch.Tensor:
    """Store each session's new k, v row of qkv [S, heads + 2 kv_heads, head_dim] float32
    contiguous (RoPE applied) in its cache at `layer`, and attend its query row over its
    cache (its last `window` positions, when > 0): [S, heads * head_dim], each row as
    attend_rows computes it alone."""
    sessions, _, head_dim = qkv.shape
    out = torch.empty(sessions, heads * head_dim, dtype=torch.float32)
    status = library().skippy_decode_attention(qkv.data_ptr(), ctypes.byref(rows.struct), heads, kv_heads, head_dim,
                                               layer, window, scale, out.data_ptr())
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


class DecodeLayers:
    """A stage's llama blocks (quantized matmuls without biases, SwiGLU, RMS norms, one
    RoPE table, no per-head or post norms) as skippy_decode_layers runs them: a decode
    step's whole layer range in one call, each row bit for bit what the forward's
    per-layer loop computes (the same kernels, in the same order)."""

    def __init__(self, layers: list[tuple], heads: int, kv_heads: int, head_dim: int, ffn: int, eps: float,
                 scale: float, head: tuple | None = None):
        """layers: per layer (attn_norm, ffn_norm, wqkv, wo, w_gate_up, w_down, window), the
        norms float32 [D], the matmuls QuantLinear. head: (output norm float32 [D], QuantLinear)
        of the final stage, whose logits the call then computes too (`__call__`'s `logits`)."""
        self.layers = (Layer * max(1, len(layers)))()
        for slot, (attn_norm, ffn_norm, wqkv, wo, w_gate_up, w_down, window) in zip(self.layers, layers):
            slot.attn_norm, slot.ffn_norm, slot.window = attn_norm.data_ptr(), ffn_norm.data_ptr(), window
            slot.qkv, slot.out, slot.gate_up, slot.down = wqkv.matmul, wo.matmul, w_gate_up.matmul, w_down.matmul
        # the structures point into these: they live as long as this object
        self._weights = [t for layer in layers for t in layer[:6]] + list(head or ())
        self.vocab = 0 if head is None else head[1].out_features
        self.head = None if head is None else head[1].matmul
        self.model = DecodeModel(
            hidden=layers[0][0].shape[0], heads=heads, kv_heads=kv_heads, head_dim=head_dim, ffn=ffn,
            num_layers=len(layers), eps=eps, scale=scale, layers=self.layers,
            out_norm=None if head is None else head[0].data_ptr(),
            head=None if head is None else ctypes.pointer(self.head))

    def __call__(self, x: torch.Tensor, rows: DecodeRows, cos: torch.Tensor, signed_sin: torch.Tensor,
                 logits: torch.Tensor | None = None, picks: GreedyPicks | None = None) -> torch.Tensor:
        """x [S, D] float32 contiguous, one row per session of `rows`, through every layer
        in place; cos, signed_sin: the RoPE tables [positions, head_dim] contiguous, read at
        the rows' positions. With `logits` [S, vocab] float32 contiguous (a call built with a
        head), the rows' logits are written there as well, and with `picks` the greedy token
        of the rows it asks for (GreedyPicks.tokens). Returns x."""
        x = x.contiguous()
        model = self.model
        model.cos, model.sin, model.table_rows = cos.data_ptr(), signed_sin.data_ptr(), cos.shape[0]
        if logits is not None and self.head is None:
            raise ValueError("logits need a DecodeLayers built with the output head")
        if picks is not None and logits is None:
            raise ValueError("greedy picks need the logits they are picked from")
        # the kernel reads and writes S entries of each: a shorter array would be overrun
        sizes = (rows.struct.count, *(() if logits is None else (logits.shape[0],)),
                 *(() if picks is None else (len(picks.out),)))
        if any(size != x.shape[0] for size in sizes):
            raise ValueError(f"expected a session row, logits row and pick entry for each of x's {x.shape[0]} "
                             f"rows, got {sizes} (sessions, logits, picks)")
        status = library().skippy_decode_layers(ctypes.byref(model), x.data_ptr(), ctypes.byref(rows.struct),
                                                None if logits is None else logits.data_ptr(),
                                                None if picks is None else ctypes.byref(picks.struct))
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
        self.start = (ctypes.c_int32 * (n + 1))(*starts)
        self.ids = (ctypes.c_int32 * max(1, len(ids)))(*ids)
        self.values = (ctypes.c_float * max(1, len(values)))(*values)
        self.out = (ctypes.c_int32 * n)(*(bias is not None for bias in biases))  # in: wanted; out: the id
        self.struct = Picks(ctypes.addressof(self.start), ctypes.addressof(self.ids), ctypes.addressof(self.values),
                            ctypes.addressof(self.out))

    def tokens(self) -> list[int | None]:
        return [None if token < 0 else token for token in self.out]


def embed_rows(raw: np.ndarray, block_bytes: int, ids: torch.Tensor, cols: int) -> torch.Tensor:
    """float32 [n, cols]: rows `ids` of a GGUF tensor in legacy blocks of 32 (`block_bytes` a
    block: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) or K-quant super-blocks of 256 (Q4_K, Q5_K, Q6_K), raw
    its bytes [rows, row bytes], e.g. the memory map."""
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.shape[0], cols, dtype=torch.float32)
    status = library().skippy_embed_rows(raw.ctypes.data, raw.shape[1], raw.shape[0], block_bytes, ids.data_ptr(),
                                         ids.shape[0], cols, out.data_ptr())
    if status:
        raise ValueError(f"embed_rows failed ({status}): ids {ids.tolist()} of {raw.shape[0]} rows")
    return out


def read_bandwidths(buffer: torch.Tensor, rounds: int = 5) -> list[float]:
    """`rounds` timed passes of the thread team reading `buffer` (contiguous, far larger
    than the last-level cache), each in bytes per second (kernels/probe.c)."""
    rates = []
    for _ in range(rounds):
        started = time.perf_counter()
        library().skippy_read_probe(buffer.data_ptr(), buffer.nbytes)
        rates.append(buffer.nbytes / (time.perf_counter() - started))
    return rates


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

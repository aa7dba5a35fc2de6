"""A matmul through a GGUF's integer codes (kernels/qmatmul.c), and the packing into the kernel's layouts.

A QuantLinear's rows are one to three parts (a fused q/k/v may hold Q4_K and Q6_K rows), each
in one of the kernel's formats (kernels/skippy_kernels.h, skippy_format):
    q4    4-bit codes, float16 scale and offset per group of 32     Q4_0, Q4_1, --quantize int4
    q8    8-bit codes, float16 scale and offset per group of 32     Q5_0, Q5_1, Q5_K, Q8_0, int8
    q4k   Q4_K's own: 4-bit codes, its 6-bit scales and mins under float16 ones per 256
          (0.578 bytes a weight, the file's 0.5625)
    q6k   Q6_K's own: 6-bit codes, int8 scales per 16 under a float16 one per 256 (0.82 bytes
          a weight, the file's size)
The K formats hold exactly the file's numbers; q4 and q8 hold the legacy types' exactly and
Q5_K's with each group's scale rounded to float16 once. The kernel quantizes each input row
to int8 per group of 32, in one level or two (`levels`), and multiplies codes by codes.

Packing reads a tensor's blocks from the memory-mapped file straight into the final tensors
(the K formats in C, kernels/pack.c, so that a first start packs about as fast as the disk
reads) and drops the file's pages, so loading never holds a float copy of the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from . import qkernel
from .layers import Linear
from .quant import GROUP, FloatWeight, GroupAffine, QuantizedTensor
from .weight_arena import WeightArena

LANES = 16  # rows per block in the kernel's layout (one vector lane each)
SUPER = 256  # weights per super-block of the K formats
Q4, Q8, Q4K, Q6K = 0, 1, 2, 3  # skippy_format
FORMAT_NAMES = {Q4: "q4", Q8: "q8", Q4K: "q4k", Q6K: "q6k"}
CODE_BITS = {Q4: 4, Q8: 8, Q4K: 4, Q6K: 6}
_CHUNK_ROWS = 4096  # rows converted at a time in numpy: bounds the unpacked codes held while loading


def kernel_format(part: QuantizedTensor | FloatWeight) -> int:
    """The layout the kernel keeps a GGUF tensor (or a float weight to quantize) in."""
    if isinstance(part, QuantizedTensor) and part.qtype == Q.Q4_K:
        return Q4K
    if isinstance(part, QuantizedTensor) and part.qtype == Q.Q6_K:
        return Q6K
    return Q4 if part.bits <= 4 else Q8


def interleave(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes uint8 [N, K] (N % 16 == 0) -> the kernel's q4, q8 or q6k bytes (see kernels/qmatmul.c):
    per 16 rows and group of 32, chunks of 4 codes per row side by side; 4-bit codes
    k and k + 16 of a group share a byte (low and high nibble); 6-bit codes are the 4-bit
    layout of their low bits, then two chunks of their top 2 bits (kernels/pack.c packs
    GGUF's Q4_K and Q6_K blocks this way in C)."""
    n, k = codes.shape
    if bits == 6:
        low = interleave(codes & 15, 4).reshape(n // LANES, k // GROUP, 256)
        top = (codes >> 4).reshape(n // LANES, LANES, k // GROUP, 2, 4, 4)  # [blocks, lane, G, half, c, t]
        top = sum(top[..., c, :] << (2 * c) for c in range(4)).astype(np.uint8)  # [blocks, lane, G, half, t]
        top = top.transpose(0, 2, 3, 1, 4).reshape(n // LANES, k // GROUP, 128)
        return np.ascontiguousarray(np.concatenate([low, top], axis=-1)).reshape(-1)
    groups = codes.reshape(n // LANES, LANES, k // GROUP, GROUP).transpose(0, 2, 1, 3)  # [blocks, G, lane, 32]
    if bits == 4:
        groups = groups[..., :16] | (groups[..., 16:] << 4)
    chunks = groups.reshape(*groups.shape[:3], -1, 4).transpose(0, 1, 3, 2, 4)  # [blocks, G, chunk, lane, 4]
    return np.ascontiguousarray(chunks).reshape(-1)


def deinterleave(raw: np.ndarray, bits: int, shape: tuple[int, int]) -> np.ndarray:
    """The inverse of interleave (bits 4 or 8), and of q6k's codes (bits 6): uint8 codes [N, K]."""
    n, k = shape
    if bits == 6:
        groups = raw.reshape(n // LANES, k // GROUP, 384)
        low = deinterleave(np.ascontiguousarray(groups[..., :256]), 4, shape)
        top = groups[..., 256:].reshape(n // LANES, k // GROUP, 2, LANES, 4)  # [blocks, G, half, lane, t]
        top = np.stack([(top >> (2 * c)) & 3 for c in range(4)], axis=3)  # [blocks, G, half, c, lane, t]
        top = top.transpose(0, 4, 1, 2, 3, 5).reshape(n, k)  # k = 32 g + 16 half + 4 c + t
        return low | (top << 4)
    chunks = raw.reshape(n // LANES, k // GROUP, -1, LANES, 4).transpose(0, 1, 3, 2, 4)  # [blocks, G, lane, chunk, 4]
    groups = chunks.reshape(n // LANES, k // GROUP, LANES, -1)
    if bits == 4:
        groups = np.concatenate([groups & 15, groups >> 4], axis=-1)
    return np.ascontiguousarray(groups.transpose(0, 2, 1, 3)).reshape(n, k)


def _by_block(values: np.ndarray) -> np.ndarray:
    """[N, G] per-row-and-group values -> float16 [N/16, G, 16], the kernel's order."""
    n, g = values.shape
    return np.ascontiguousarray(values.astype(np.float16).reshape(n // LANES, LANES, g).transpose(0, 2, 1))


def _unblock(t: torch.Tensor, n: int) -> np.ndarray:
    """The inverse of _by_block (any trailing field count): [N, fields] float32."""
    return t.numpy().reshape(n // LANES, -1, LANES).transpose(0, 2, 1).reshape(n, -1).astype(np.float32)


@dataclass(slots=True)
class PackedPart:
    """Rows of a matmul in one kernel format (skippy_part): the tensors qmatmul.c reads."""

    format: int
    rows: int
    codes: torch.Tensor  # uint8
    scale: torch.Tensor  # float16
    offset: torch.Tensor | None = None  # float16 (q4, q8)
    sub: torch.Tensor | None = None  # uint8 (q4k), int8 (q6k)

    @classmethod
    def empty(cls, fmt: int, rows: int, cols: int, empty=torch.empty) -> "PackedPart":
        blocks, groups, supers = rows // LANES, cols // GROUP, cols // SUPER
        codes = empty((rows * cols * CODE_BITS[fmt] // 8,), dtype=torch.uint8)
        if fmt in (Q4, Q8):
            return cls(fmt, rows, codes, empty((blocks, groups, LANES), dtype=torch.float16),
                       empty((blocks, groups, LANES), dtype=torch.float16))
        fields = 2 if fmt == Q4K else 1
        return cls(fmt, rows, codes, empty((blocks, supers, fields, LANES), dtype=torch.float16),
                   sub=empty((blocks, groups, 2, LANES), dtype=torch.uint8 if fmt == Q4K else torch.int8))

    def fill(self, first: int, part: QuantizedTensor | FloatWeight) -> None:
        """Pack `part` into rows [first, first + its rows)."""
        rows, cols = part.shape
        row_bytes = cols * CODE_BITS[self.format] // 8
        codes = self.codes[first * row_bytes : (first + rows) * row_bytes]
        blocks = slice(first // LANES, (first + rows) // LANES)
        if self.format in (Q4K, Q6K):
            qkernel.pack_k(self.format == Q6K, part.raw, part.row_order, rows, cols, codes, self.scale[blocks],
                           self.sub[blocks])
            return
        for start in range(0, rows, _CHUNK_ROWS):
            chunk = part.affine(slice(start, start + _CHUNK_ROWS))
            n = chunk.shape[0]
            codes[start * row_bytes : (start + n) * row_bytes] = torch.from_numpy(interleave(chunk.codes,
                                                                                         CODE_BITS[self.format]))
            at = slice((first + start) // LANES, (first + start + n) // LANES)
            self.scale[at] = torch.from_numpy(_by_block(chunk.scale))
            self.offset[at] = torch.from_numpy(_by_block(chunk.offset))

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        named = {"codes": self.codes, "scale": self.scale, "offset": self.offset, "sub": self.sub}
        return {name: t for name, t in named.items() if t is not None}

    def affine(self, cols: int) -> GroupAffine:
        """The codes, scales and offsets the kernel multiplies by (q6k: code - 32, per 16)."""
        n, bits = self.rows, CODE_BITS[self.format]
        codes = deinterleave(self.codes.numpy(), bits, (n, cols))
        if self.format in (Q4, Q8):
            return GroupAffine(codes, _unblock(self.scale, n), _unblock(self.offset, n), bits)
        sub = _unblock(self.sub, n).reshape(n, cols // GROUP, 2)  # [N, G, (scale, min) or (half 0, half 1)]
        per_super = _unblock(self.scale, n).reshape(n, cols // SUPER, -1)  # [N, S, (d, -dmin) or (d,)]
        d = np.repeat(per_super, SUPER // GROUP, axis=1)  # [N, G, fields]
        if self.format == Q4K:
            return GroupAffine(codes, d[..., 0] * sub[..., 0], d[..., 1] * sub[..., 1], bits)
        scale = (d[..., :1] * sub).reshape(n, -1)  # per 16
        return GroupAffine((codes.astype(np.int16) - 32).astype(np.int8), scale, np.zeros_like(scale), bits, 16)


class QuantLinear:
    """x [T, in] float32 -> [T, out] float32 through the file's integer codes (kernels/qmatmul.c)."""

    __slots__ = ("parts", "out_features", "in_features", "bias", "_levels", "_matmul")
    batched = None  # batches of rows run through the same codes: no second copy
    can_repack = False

    def __init__(self, parts: list[PackedPart], out_features: int, in_features: int,
                 bias: torch.Tensor | None = None, levels: int = 1):
        self.parts, self.out_features, self.in_features = parts, out_features, in_features
        self.bias = bias  # float32 [out] (Qwen2's q, k, v), added after the kernel
        self._matmul: qkernel.Matmul | None = None
        self._levels = levels

    @property
    def levels(self) -> int:
        """int8 levels each input row is rounded to (see build_linear)."""
        return self._levels

    @levels.setter
    def levels(self, levels: int) -> None:
        self._levels = levels
        if self._matmul is not None:
            self._matmul.levels = levels

    @classmethod
    def of(cls, weight: GroupAffine, levels: int = 1) -> "QuantLinear":
        """A q4 or q8 matmul of a weight's codes (groups of 32)."""
        n, k = weight.shape
        fmt = Q4 if weight.bits <= 4 else Q8
        part = PackedPart(fmt, n, torch.from_numpy(interleave(weight.codes, CODE_BITS[fmt])),
                          torch.from_numpy(_by_block(weight.scale)), torch.from_numpy(_by_block(weight.offset)))
        return cls([part], n, k, levels=levels)

    @classmethod
    def of_blocks(cls, parts: list[QuantizedTensor | FloatWeight], levels: int = 1,
                  arena: WeightArena | None = None) -> "QuantLinear":
        """One matmul over `parts` stacked along out, packed straight into the final tensors (in
        `arena`, when given); neighbours in the same format share one packed part."""
        k = parts[0].shape[1]
        runs: list[tuple[int, list]] = []
        for part in parts:
            fmt = kernel_format(part)
            if runs and runs[-1][0] == fmt:
                runs[-1][1].append(part)
            else:
                runs.append((fmt, [part]))
        packed = []
        for fmt, members in runs:
            out = PackedPart.empty(fmt, sum(p.shape[0] for p in members), k,
                                   torch.empty if arena is None else arena.empty)
            first = 0
            for part in members:
                out.fill(first, part)
                first += part.shape[0]
                part.release()
            packed.append(out)
        return cls(packed, sum(p.rows for p in packed), k, levels=levels)

    @staticmethod
    def can_pack(parts: list) -> bool:
        def fits(p) -> bool:
            if not isinstance(p, (QuantizedTensor, FloatWeight)) or p.shape[0] % LANES or p.shape[1] % GROUP:
                return False
            return kernel_format(p) not in (Q4K, Q6K) or p.shape[1] % SUPER == 0

        return all(fits(p) for p in parts) and len(parts) <= qkernel.MAX_PARTS and qkernel.available()

    @property
    def bits(self) -> int:
        """The widest code width among the parts."""
        return max(CODE_BITS[p.format] for p in self.parts)

    @property
    def format(self) -> str:
        """e.g. "q4k", "q4k+q6k", "q8x2" (x2: inputs rounded in two levels)."""
        kinds = "+".join(sorted({FORMAT_NAMES[p.format] for p in self.parts}))
        return kinds if self.levels == 1 else f"{kinds}x{self.levels}"

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in p.tensors.values()] + ([] if self.bias is None else [self.bias])

    @property
    def matmul(self) -> qkernel.Matmul:
        """The kernel's view of this matmul (skippy_matmul), pointing into the tensors above."""
        if self._matmul is None:
            self._matmul = qkernel.matmul_struct(self.parts, self.out_features, self.in_features, self.levels)
        return self._matmul

    def state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """What from_state needs to make this matmul again (packed_cache.py keeps it on disk)."""
        meta = {"levels": self.levels, "out": self.out_features, "in": self.in_features,
                "parts": [[p.format, p.rows] for p in self.parts]}
        return meta, {f"{i}.{name}": t for i, p in enumerate(self.parts) for name, t in p.tensors.items()}

    @classmethod
    def from_state(cls, meta: dict, tensors: dict[str, torch.Tensor]) -> "QuantLinear":
        parts = [PackedPart(fmt, rows, **{name.split(".", 1)[1]: t for name, t in tensors.items()
                                         if name.startswith(f"{i}.")})
                 for i, (fmt, rows) in enumerate(meta["parts"])]
        return cls(parts, meta["out"], meta["in"], levels=meta["levels"])

    def repack(self) -> int:
        return 0

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, bf16: bool = False) -> torch.Tensor:
        """x · W^T, plus `residual` when given: summed into `residual` itself (no new tensor).
        `bf16`: on AMX-BF16 tiles, to bfloat16's precision rather than the integer paths' bits
        (a prompt's rows under --prefill-precision bf16; the caller checked qkernel.bf16_ready)."""
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        if residual is not None and not (residual.dtype == torch.float32 and residual.is_contiguous()):
            return residual + self(x, bf16=bf16)
        out = qkernel.qmatmul(x, self.matmul, residual, bf16)
        return out if self.bias is None else out.add_(self.bias)

    def affine(self) -> GroupAffine:
        """The codes, scales and offsets the kernel multiplies by (a matmul of one part)."""
        if len(self.parts) != 1:
            raise ValueError(f"Expected a matmul of one part, got {self.format}'s {len(self.parts)}")
        return self.parts[0].affine(self.in_features)

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: the weights the kernel multiplies by."""
        return torch.from_numpy(np.concatenate([p.affine(self.in_features).dequantize() for p in self.parts]))


def packed_name(parts: list, levels: int) -> str | None:
    """A matmul's name in the packed cache: its GGUF tensors' and its input's levels (None for
    weights that are not a GGUF's)."""
    names = [getattr(p, "name", None) for p in parts]
    return None if None in names else "+".join(names) + f"-x{levels}"


def build_linear(parts: list[torch.Tensor | QuantizedTensor | FloatWeight], device: torch.device,
                 biases: list[torch.Tensor] | None = None, *, activation_levels: int = 1,
                 arena: WeightArena | None = None) -> Linear | QuantLinear:
    """One matmul over `parts` stacked along out (q, k, v; gate, up), plus `biases`
    (float32, one per part) when given.

    `activation_levels`: how finely a QuantLinear rounds its input rows, as llama.cpp
    does (1: int8 per group of 32) or 128x finer (2), which doubles the kernel's integer
    work. One level costs little accuracy where activations are even; llama.py asks for
    two where they are heavy-tailed.

    All parts quantized, on CPU, with the kernel built: QuantLinear. Otherwise (CUDA
    has no kernel here yet, a part's type is one quant.py does not read, or rows come
    in other than blocks of 16) a quantized part is dequantized to bfloat16. A QuantLinear's
    tensors go in `arena` when given (weight_arena.py: huge pages), or come from its packed
    cache when the matmul was packed before (packed_cache.py), which keeps the ones packed here.
    """
    bias = None if biases is None else torch.cat(biases).float()
    if device.type == "cpu" and QuantLinear.can_pack(parts):
        cache = arena.packed if arena is not None else None
        name = packed_name(parts, activation_levels) if cache is not None else None
        stored = cache.load(name) if name is not None else None
        if stored is not None:
            linear = QuantLinear.from_state(*stored)
        else:
            linear = QuantLinear.of_blocks(parts, activation_levels, arena)
            if name is not None:
                cache.store(name, *linear.state())
        linear.bias = bias
        return linear
    tensors = [p if isinstance(p, torch.Tensor) else
               torch.from_numpy(p.affine().dequantize()).to(device, torch.bfloat16) for p in parts]
    if len({t.dtype for t in tensors}) > 1:
        tensors = [t.to(torch.bfloat16) for t in tensors]
    return Linear.of(torch.cat(tensors) if len(tensors) > 1 else tensors[0], bias)


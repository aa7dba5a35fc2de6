"""GGUF quantized blocks kept quantized: the file's integer codes, multiplied by kernels/qmatmul.c.

Every GGUF type handled here stores, per group of 32 weights along a row, an
affine map from small integer codes: w = scale * code + offset. QuantLinear
keeps those codes, 4 bits (Q4_0, Q4_1, Q4_K: 0.625 bytes a weight, Q4_1's own
size) or 8 (Q5_0, Q5_1, Q5_K, Q8_0: 1.125 bytes a weight, 1.06x Q8_0's), with
scale and offset in float16 (the file's own for the legacy types; for K-quants
the product of the super-block's float16 scale and a 6-bit sub-scale, rounded
once). Q6_K (the 6-bit tensors of Q4_K_M files) scales every 16 weights, which one
affine map per 32 cannot hold exactly: its values are requantized to 8-bit codes
over each group's range (error at most half a step of range/255, ~1/8 of Q6_K's
own step; 1.125 bytes a weight against the file's 0.82). The kernel quantizes each
input row to int8 per group of 32, in one level or two (kernels/qmatmul.c; a
QuantLinear's `levels`), and multiplies integer codes with integer codes.

Conversion reads one tensor's blocks from the memory-mapped file, rearranges
them for the kernel a few thousand rows at a time and drops the file's pages,
so loading never holds a float copy of the model.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from . import qkernel
from .gguf_types import BITS, K_QUANT_BLOCK_BYTES, LEGACY_BLOCK_BYTES, REQUANTIZED, SUPPORTED
from .layers import Linear
from .resident import drop_pages
from .weight_arena import WeightArena

GROUP = 32  # weights per scale and offset
_SUPER = 256  # weights per K-quant super-block


@dataclass(slots=True)
class GroupAffine:
    """A weight [out, in] as integer codes with a scale and offset per group of 32:
    w[n, k] = scale[n, k // 32] * codes[n, k] + offset[n, k // 32]."""

    codes: np.ndarray  # uint8 [out, in], below 2**bits
    scale: np.ndarray  # float32 [out, in // 32]
    offset: np.ndarray  # float32 [out, in // 32]
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    def dequantize(self) -> np.ndarray:
        """float32 [out, in]: what the file's numbers are, computed as the file's own decoder does."""
        n, k = self.codes.shape
        codes = self.codes.reshape(n, k // GROUP, GROUP).astype(np.float32)
        return (self.scale[..., None] * codes + self.offset[..., None]).reshape(n, k)



# --- GGUF block layouts: raw bytes [rows, bytes per row] -> GroupAffine ----------


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 fields [..., 2 bytes] -> float32 [...]."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(raw: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: low nibbles are elements 0-15, high ones 16-31."""
    return np.concatenate([raw & 15, raw >> 4], axis=-1)


def _high_bits(raw: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 8 * n] single bits, least significant first."""
    return np.unpackbits(raw, axis=-1, bitorder="little")


def _legacy(blocks: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: blocks [rows, nb, bytes] of 32 weights each."""
    d = _f16(blocks[..., 0:2])
    if qtype == Q.Q8_0:
        codes = (blocks[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return codes, d, -128 * d, 8
    has_min = qtype in (Q.Q4_1, Q.Q5_1)
    m = _f16(blocks[..., 2:4]) if has_min else None
    at = 4 if has_min else 2
    if qtype in (Q.Q4_0, Q.Q4_1):
        codes, bits = _nibbles(blocks[..., at : at + 16]), 4
    else:
        high = _high_bits(blocks[..., at : at + 4])
        codes, bits = _nibbles(blocks[..., at + 4 : at + 20]) | (high << 4), 5
    offset = m if has_min else -(2 ** (bits - 1)) * d
    return codes, d, offset, bits


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit sub-block scales and mins -> two [..., 8] arrays.
    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes
    4-7 the same for mins; bytes 8-11 the low 4 bits of scale (low nibble) and min
    (high nibble) 4-7."""
    first, second, last = raw[..., 0:4], raw[..., 4:8], raw[..., 8:12]
    scales = np.concatenate([first & 63, (last & 15) | ((first >> 6) << 4)], axis=-1)
    mins = np.concatenate([second & 63, (last >> 4) | ((second >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _k_quant(blocks: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Q4_K, Q5_K: super-blocks [rows, nb, bytes] of 8 sub-blocks of 32."""
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    scales, mins = _k_scales(blocks[..., 4:16])
    if qtype == Q.Q4_K:
        packed, bits = blocks[..., 16:144], 4
        high = None
    else:
        high, packed, bits = blocks[..., 16:48], blocks[..., 48:176], 5
    # each 32 bytes hold two sub-blocks: low nibbles the first, high nibbles the second
    pairs = packed.reshape(*packed.shape[:-1], 4, 32)
    codes = np.stack([pairs & 15, pairs >> 4], axis=-2).reshape(*packed.shape[:-1], 8, 32)
    if high is not None:  # bit j of byte i is the fifth bit of sub-block j's element i
        bits_of = np.unpackbits(high[..., None, :], axis=-2, count=8, bitorder="little")  # [..., 8, 32]
        codes = codes | (bits_of << 4)
    scale = d[..., None] * scales
    offset = -(dmin[..., None] * mins)
    return codes, scale, offset, bits


def requantize(values: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """float32 values [..., 32] -> `bits`-bit codes over each group's [min, max], with
    the scale and offset rounded to float16 first (as the kernel keeps them), so the
    codes land nearest to the values through the stored scale."""
    top = 2**bits - 1
    low, high = values.min(-1), values.max(-1)
    scale = ((high - low) / top).astype(np.float16).astype(np.float32)
    offset = low.astype(np.float16).astype(np.float32)
    step = np.where(scale > 0, scale, 1.0)[..., None]
    codes = np.clip(np.rint((values - offset[..., None]) / step), 0, top).astype(np.uint8)
    return codes, scale, offset, bits


def from_gguf_blocks(raw: np.ndarray, qtype: Q, shape: tuple[int, int]) -> GroupAffine:
    """raw: the tensor's bytes, [out, bytes per row] (the gguf reader's memory map);
    shape: [out, in] in weights."""
    out_features, in_features = shape
    raw = np.asarray(raw).reshape(out_features, -1)
    if qtype in LEGACY_BLOCK_BYTES:
        blocks = raw.reshape(out_features, in_features // GROUP, LEGACY_BLOCK_BYTES[qtype])
        codes, scale, offset, bits = _legacy(blocks, qtype)
    elif qtype in K_QUANT_BLOCK_BYTES:
        blocks = raw.reshape(out_features, in_features // _SUPER, K_QUANT_BLOCK_BYTES[qtype])
        codes, scale, offset, bits = _k_quant(blocks, qtype)
    elif qtype in REQUANTIZED:
        values = gguf_dequantize(raw, qtype).reshape(out_features, in_features // GROUP, GROUP)
        codes, scale, offset, bits = requantize(values, 8)
    else:
        raise ValueError(f"Expected one of {[t.name for t in SUPPORTED]}, got {qtype.name}")
    return GroupAffine(
        np.ascontiguousarray(codes.reshape(out_features, in_features), dtype=np.uint8),
        scale.reshape(out_features, -1).astype(np.float32),
        offset.reshape(out_features, -1).astype(np.float32),
        bits,
    )


@dataclass(frozen=True, slots=True)
class QuantizedTensor:
    """A GGUF tensor still in its file's blocks: a view of the memory map, read when
    the model is built (one tensor at a time) or, for an embedding, a few rows a step."""

    raw: np.ndarray  # uint8 [out, bytes per row], memory-mapped
    qtype: Q
    shape: tuple[int, int]  # [out, in] in weights
    row_order: np.ndarray | None = None  # rows taken in this order (attn_q/attn_k unpermuted)

    def affine(self, rows: slice = slice(None)) -> GroupAffine:
        """The codes of rows `rows` (all by default)."""
        index = np.arange(self.shape[0])[rows] if self.row_order is None else self.row_order[rows]
        raw = self.raw[index.min() : index.max() + 1] if self.row_order is None else self.raw[index]
        return from_gguf_blocks(raw, self.qtype, (len(index), self.shape[1]))

    @property
    def bits(self) -> int:
        return BITS[self.qtype]

    def release(self) -> None:
        """Packed: the file's pages under this tensor can leave the resident set."""
        drop_resident_pages(self.raw)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows [n, in] of the tokens `ids`: only their blocks are read."""
        if (self.qtype in LEGACY_BLOCK_BYTES and self.raw.flags.c_contiguous and ids.device.type == "cpu"
                and qkernel.available()):
            return qkernel.embed_rows(self.raw, LEGACY_BLOCK_BYTES[self.qtype], ids, self.shape[1])
        index = ids.cpu().numpy()
        if self.qtype in REQUANTIZED:  # the file's own values, not the kernel's 8-bit copy
            values = gguf_dequantize(self.raw[index], self.qtype).reshape(len(index), self.shape[1])
            return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(ids.device)
        rows = from_gguf_blocks(self.raw[index], self.qtype, (len(index), self.shape[1]))
        return torch.from_numpy(rows.dequantize()).to(ids.device)


@dataclass(frozen=True, slots=True)
class FloatWeight:
    """A float matmul weight [out, in] (a Hugging Face checkpoint's, `--quantize`) to
    keep as `bits`-bit codes over each group of 32's range, as Q4_1 and our Q6_K
    conversion do; converted when the model is built, a chunk of rows at a time."""

    weight: torch.Tensor
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def affine(self, rows: slice = slice(None)) -> GroupAffine:
        values = self.weight[rows].float().numpy()
        n, k = values.shape
        codes, scale, offset, bits = requantize(values.reshape(n, k // GROUP, GROUP), self.bits)
        return GroupAffine(codes.reshape(n, k), scale, offset, bits)

    def release(self) -> None:
        pass


def drop_resident_pages(view: np.ndarray) -> None:
    """Take the pages under `view`, a slice of a read-only file mapping, out of this
    process's resident set: they fault back in from the page cache if read again.
    Loading calls this after packing each tensor, so the file's pages never add up.
    Anything but a read-only file mapping is left alone: there the pages would come
    back as zeros."""
    if not _read_only_file_mapping(view):
        return
    page = mmap.PAGESIZE
    start = -(-view.ctypes.data // page) * page  # whole pages inside the view only
    end = (view.ctypes.data + view.nbytes) // page * page
    if end > start:
        drop_pages(start, end - start)


def _read_only_file_mapping(view: np.ndarray) -> bool:
    while view is not None:
        if isinstance(view, np.memmap):
            return view.mode == "r"
        view = view.base
    return False


# --- the kernel's weight and its matmul ---------------------------------------------

LANES = 16  # rows per block in the kernel's layout (one vector lane each)
_CHUNK_ROWS = 4096  # rows converted at a time: bounds the unpacked codes held while loading


def kernel_bits(bits: int) -> int:
    """The code width the kernel stores a `bits`-bit type in."""
    return 4 if bits <= 4 else 8


def interleave(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes uint8 [N, K] (N % 16 == 0) -> the kernel's bytes (see kernels/qmatmul.c):
    per 16 rows and group of 32, chunks of 4 codes per row side by side; 4-bit codes
    k and k + 16 of a group share a byte (low and high nibble)."""
    n, k = codes.shape
    groups = codes.reshape(n // LANES, LANES, k // GROUP, GROUP).transpose(0, 2, 1, 3)  # [blocks, G, lane, 32]
    if bits == 4:
        groups = groups[..., :16] | (groups[..., 16:] << 4)
    chunks = groups.reshape(*groups.shape[:3], -1, 4).transpose(0, 1, 3, 2, 4)  # [blocks, G, chunk, lane, 4]
    return np.ascontiguousarray(chunks).reshape(-1)


def deinterleave(raw: np.ndarray, bits: int, shape: tuple[int, int]) -> np.ndarray:
    """The inverse of interleave: uint8 codes [N, K]."""
    n, k = shape
    chunks = raw.reshape(n // LANES, k // GROUP, -1, LANES, 4).transpose(0, 1, 3, 2, 4)  # [blocks, G, lane, chunk, 4]
    groups = chunks.reshape(n // LANES, k // GROUP, LANES, -1)
    if bits == 4:
        groups = np.concatenate([groups & 15, groups >> 4], axis=-1)
    return np.ascontiguousarray(groups.transpose(0, 2, 1, 3)).reshape(n, k)


def _by_block(values: np.ndarray) -> np.ndarray:
    """[N, G] per-row-and-group values -> float16 [N/16, G, 16], the kernel's order."""
    n, g = values.shape
    return np.ascontiguousarray(values.astype(np.float16).reshape(n // LANES, LANES, g).transpose(0, 2, 1))


class QuantLinear:
    """x [T, in] float32 -> [T, out] float32 through the file's integer codes
    (kernels/qmatmul.c)."""

    __slots__ = ("codes", "scale", "offset", "bits", "out_features", "in_features", "bias", "levels")
    batched = None  # batches of rows run through the same codes: no second copy
    can_repack = False

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int,
                 out_features: int, in_features: int, bias: torch.Tensor | None = None, levels: int = 1):
        self.codes, self.scale, self.offset, self.bits = codes, scale, offset, bits
        self.out_features, self.in_features = out_features, in_features
        self.bias = bias  # float32 [out] (Qwen2's q, k, v), added after the kernel
        self.levels = levels  # int8 levels each input row is rounded to (see build_linear)

    @classmethod
    def of(cls, weight: GroupAffine, levels: int = 1) -> "QuantLinear":
        n, k = weight.shape
        bits = kernel_bits(weight.bits)
        return cls(torch.from_numpy(interleave(weight.codes, bits)), torch.from_numpy(_by_block(weight.scale)),
                   torch.from_numpy(_by_block(weight.offset)), bits, n, k, levels=levels)

    @classmethod
    def of_blocks(cls, parts: "list[QuantizedTensor | FloatWeight]", levels: int = 1,
                  arena: WeightArena | None = None) -> "QuantLinear":
        """One matmul over `parts` stacked along out, converted _CHUNK_ROWS rows at a
        time straight into the final tensors (in `arena`, when given)."""
        bits = max(kernel_bits(p.bits) for p in parts)
        n, k = sum(p.shape[0] for p in parts), parts[0].shape[1]
        row_bytes = k * bits // 8
        empty = torch.empty if arena is None else arena.empty
        codes = empty((n * row_bytes,), dtype=torch.uint8)
        scale = empty((n // LANES, k // GROUP, LANES), dtype=torch.float16)
        offset = empty((n // LANES, k // GROUP, LANES), dtype=torch.float16)
        row = 0
        for part in parts:
            for start in range(0, part.shape[0], _CHUNK_ROWS):
                chunk = part.affine(slice(start, start + _CHUNK_ROWS))
                rows = chunk.shape[0]
                codes[row * row_bytes : (row + rows) * row_bytes] = torch.from_numpy(interleave(chunk.codes, bits))
                scale[row // LANES : (row + rows) // LANES] = torch.from_numpy(_by_block(chunk.scale))
                offset[row // LANES : (row + rows) // LANES] = torch.from_numpy(_by_block(chunk.offset))
                row += rows
            part.release()
        return cls(codes, scale, offset, bits, n, k, levels=levels)

    @staticmethod
    def can_pack(parts: list) -> bool:
        return all(isinstance(p, (QuantizedTensor, FloatWeight)) and p.shape[0] % LANES == 0 and p.shape[1] % GROUP == 0
                   for p in parts) and qkernel.available()

    @property
    def format(self) -> str:
        return f"q{self.bits}" if self.levels == 1 else f"q{self.bits}x{self.levels}"

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scale, self.offset] + ([] if self.bias is None else [self.bias])

    def repack(self) -> int:
        return 0

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x · W^T, plus `residual` when given: summed into `residual` itself (no new tensor)."""
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        if residual is not None and not (residual.dtype == torch.float32 and residual.is_contiguous()):
            return residual + self(x)
        out = qkernel.qmatmul(x, self.codes, self.scale, self.offset, self.bits, self.out_features, residual,
                              levels=self.levels)
        return out if self.bias is None else out.add_(self.bias)

    def affine(self) -> GroupAffine:
        """The codes, scales and offsets the kernel multiplies by."""
        n, k = self.out_features, self.in_features
        unblock = lambda t: t.numpy().transpose(0, 2, 1).reshape(n, k // GROUP).astype(np.float32)  # noqa: E731
        return GroupAffine(deinterleave(self.codes.numpy(), self.bits, (n, k)), unblock(self.scale),
                           unblock(self.offset), self.bits)

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: the weights the kernel multiplies by."""
        return torch.from_numpy(self.affine().dequantize())


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
    tensors go in `arena` when given (weight_arena.py: huge pages).
    """
    bias = None if biases is None else torch.cat(biases).float()
    if device.type == "cpu" and QuantLinear.can_pack(parts):
        linear = QuantLinear.of_blocks(parts, activation_levels, arena)
        linear.bias = bias
        return linear
    tensors = [p if isinstance(p, torch.Tensor) else
               torch.from_numpy(p.affine().dequantize()).to(device, torch.bfloat16) for p in parts]
    if len({t.dtype for t in tensors}) > 1:
        tensors = [t.to(torch.bfloat16) for t in tensors]
    return Linear.of(torch.cat(tensors) if len(tensors) > 1 else tensors[0], bias)

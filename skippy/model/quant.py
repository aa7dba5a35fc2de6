"""GGUF quantized blocks kept quantized: 4-bit groupwise weights for torch's int4 kernels.

Every GGUF type handled here stores, per group of 32 weights along a row, an
affine map from small integer codes: w = scale * code + offset. torch's CPU
kernel `_weight_int4pack_mm_for_cpu` computes w = (q - 8) * scale + zero per
group of 32 along K, so a 4-bit type is one such "plane" (zero = offset + 8 *
scale), and a 5- to 8-bit type is two: code = 16 * hi + lo, so
w = 16 * scale * hi + (scale * lo + offset), each part a 4-bit plane. That keeps
Q4_0/Q4_1/Q4_K at their file size (0.625 bytes a weight for Q4_1, the same as the
file) and Q5_0/Q5_1/Q5_K/Q8_0 at 1.25 bytes a weight (1.18x Q8_0's 1.06), and
decodes the same numbers as the file up to one rounding: the kernel takes its
scales and zeros in bfloat16 (relative error 2^-9 each).

The kernel reaches its AVX-512/AVX2 code only with bfloat16 activations (float16
and float32 inputs run a scalar loop ~100x slower), so Int4Linear rounds its
input rows to bfloat16 and returns bfloat16 (one plane) or float32 (two).

Conversion reads one tensor's blocks from the memory-mapped file, packs them and
drops the codes, so loading never holds a float copy of the model.
"""

from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from .layers import Linear

GROUP = 32  # weights per scale in every plane
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

    def planes(self, count: int | None = None) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(4-bit codes, scale, zero) per plane, such that the planes' (q - 8) * scale
        + zero sum to this weight. `count` 2 splits even a 4-bit weight (its high
        plane all zeros), so rows of both kinds can stack into one matmul."""
        count = count or planes_for(self.bits)
        if count == 1:
            return [(self.codes, self.scale, self.offset + 8 * self.scale)]
        high, low = self.codes >> 4, self.codes & 15
        return [
            (high, 16 * self.scale, 128 * self.scale),  # 16 * scale * high
            (low, self.scale, self.offset + 8 * self.scale),  # scale * low + offset
        ]


def planes_for(bits: int) -> int:
    return 1 if bits <= 4 else 2


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


_LEGACY = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q5_0: 22, Q.Q5_1: 24, Q.Q8_0: 34}
_K_QUANTS = {Q.Q4_K: 144, Q.Q5_K: 176}
SUPPORTED = tuple(_LEGACY) + tuple(_K_QUANTS)
BITS = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q4_K: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q5_K: 5, Q.Q8_0: 8}


def from_gguf_blocks(raw: np.ndarray, qtype: Q, shape: tuple[int, int]) -> GroupAffine:
    """raw: the tensor's bytes, [out, bytes per row] (the gguf reader's memory map);
    shape: [out, in] in weights."""
    out_features, in_features = shape
    raw = np.asarray(raw).reshape(out_features, -1)
    if qtype in _LEGACY:
        blocks = raw.reshape(out_features, in_features // GROUP, _LEGACY[qtype])
        codes, scale, offset, bits = _legacy(blocks, qtype)
    elif qtype in _K_QUANTS:
        blocks = raw.reshape(out_features, in_features // _SUPER, _K_QUANTS[qtype])
        codes, scale, offset, bits = _k_quant(blocks, qtype)
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

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows [n, in] of the tokens `ids`: only their blocks are read."""
        index = ids.cpu().numpy()
        rows = from_gguf_blocks(self.raw[index], self.qtype, (len(index), self.shape[1]))
        return torch.from_numpy(rows.dequantize()).to(ids.device)


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
        _madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_DONTNEED)


def _read_only_file_mapping(view: np.ndarray) -> bool:
    while view is not None:
        if isinstance(view, np.memmap):
            return view.mode == "r"
        view = view.base
    return False


def _madvise(address, length, advice) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).madvise(address, length, advice)
    except (OSError, AttributeError):  # no madvise here: the pages stay resident
        pass


# --- the packed weight and its matmul -------------------------------------------

_INNER_K_TILES = 8  # the CPU packing's inner tile; the kernel takes what it was packed with
_PACK_ROWS = 16  # the CPU packing takes rows in blocks of 16, each block independent of the others
_CHUNK_ROWS = 4096  # rows converted at a time: bounds the unpacked codes held while loading


@dataclass(slots=True)
class Int4Plane:
    packed: torch.Tensor
    scales_zeros: torch.Tensor  # bfloat16 [in // 32, out, 2]


class Int4Linear:
    """x [T, in] float32 or bfloat16 -> [T, out] through 4-bit planes (see the module doc):
    bfloat16 from one plane (the consumer adds it to float32 rows or feeds the next
    matmul, so no cast of its own), float32 from two."""

    __slots__ = ("planes", "out_features", "in_features")
    batched = None  # batches of rows run through the same planes: no second copy
    can_repack = False

    def __init__(self, planes: list[Int4Plane], out_features: int, in_features: int):
        self.planes, self.out_features, self.in_features = planes, out_features, in_features

    @classmethod
    def of(cls, weight: GroupAffine) -> "Int4Linear":
        return cls([_pack(*plane) for plane in weight.planes()], *weight.shape)

    @classmethod
    def of_blocks(cls, parts: list[QuantizedTensor]) -> "Int4Linear":
        """One matmul over `parts` stacked along out, converted _CHUNK_ROWS rows at a time."""
        count = max(planes_for(BITS[p.qtype]) for p in parts)
        pieces: list[list[Int4Plane]] = [[] for _ in range(count)]
        for part in parts:
            for start in range(0, part.shape[0], _CHUNK_ROWS):
                chunk = part.affine(slice(start, start + _CHUNK_ROWS))
                for plane, pieces_of_plane in zip(chunk.planes(count), pieces):
                    pieces_of_plane.append(_pack(*plane))
            drop_resident_pages(part.raw)
        planes = [Int4Plane(torch.cat([p.packed for p in ps]), torch.cat([p.scales_zeros for p in ps], dim=1))
                  for ps in pieces]
        return cls(planes, sum(p.shape[0] for p in parts), parts[0].shape[1])

    @staticmethod
    def can_pack(parts: list) -> bool:
        return all(isinstance(p, QuantizedTensor) and p.shape[0] % _PACK_ROWS == 0 and p.shape[1] % GROUP == 0
                   for p in parts)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for p in self.planes for t in (p.packed, p.scales_zeros)]

    def repack(self) -> int:
        return 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:  # even a no-op .to() costs a dispatch on a one-row step
            x = x.to(torch.bfloat16)
        first, *rest = (torch.ops.aten._weight_int4pack_mm_for_cpu(x, p.packed, GROUP, p.scales_zeros)
                        for p in self.planes)
        if not rest:
            return first
        out = first.float()
        for y in rest:
            out.add_(y)
        return out

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in] as the kernel sees it (identity rows through the matmul)."""
        eye = torch.eye(self.in_features, dtype=torch.float32)
        return self(eye).float().t().contiguous()


def build_linear(parts: list[torch.Tensor | QuantizedTensor], device: torch.device) -> Linear | Int4Linear:
    """One matmul over `parts` stacked along out (q, k, v; gate, up).

    All parts quantized, on CPU: 4-bit planes. Otherwise (CUDA has no packing
    here yet, a block mixes in a type quant.py does not pack, or rows come in
    other than blocks of 16) a quantized part is dequantized to bfloat16.
    """
    if device.type == "cpu" and Int4Linear.can_pack(parts):
        return Int4Linear.of_blocks(parts)
    tensors = [p if isinstance(p, torch.Tensor) else
               torch.from_numpy(p.affine().dequantize()).to(device, torch.bfloat16) for p in parts]
    if len({t.dtype for t in tensors}) > 1:
        tensors = [t.to(torch.bfloat16) for t in tensors]
    return Linear.of(torch.cat(tensors) if len(tensors) > 1 else tensors[0])


def _pack(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> Int4Plane:
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(codes.astype(np.int32)),
                                                                _INNER_K_TILES)
    scales_zeros = torch.from_numpy(np.stack([scale, zero], axis=-1)).transpose(0, 1).contiguous()
    return Int4Plane(packed, scales_zeros.to(torch.bfloat16))

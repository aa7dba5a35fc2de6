"""GGUF quantized blocks read as what they are: integer codes with an affine map per group.

Every GGUF type handled here stores, per group of weights along a row (32; Q6_K: 16), an
affine map from small integer codes: w = scale * code + offset (GroupAffine), computed here
as the file's own decoder computes it. quant_linear.py keeps those codes in the kernel's
layouts; the tensors stay views of the memory-mapped file until then (QuantizedTensor), and
an embedding stays there for good, a step reading only its tokens' rows.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from . import qkernel
from .gguf_types import BITS, K_QUANT_BLOCK_BYTES, LEGACY_BLOCK_BYTES, SUPPORTED
from .resident import drop_pages

GROUP = 32  # weights per scale and offset
_SUPER = 256  # weights per K-quant super-block


@dataclass(slots=True)
class GroupAffine:
    """A weight [out, in] as integer codes with a scale and offset per group of `group`:
    w[n, k] = scale[n, k // group] * codes[n, k] + offset[n, k // group]."""

    codes: np.ndarray  # uint8 [out, in], below 2**bits (Q6_K: int8, code - 32, with offset 0)
    scale: np.ndarray  # float32 [out, in // group]
    offset: np.ndarray  # float32 [out, in // group]
    bits: int
    group: int = GROUP

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    def dequantize(self) -> np.ndarray:
        """float32 [out, in]: what the file's numbers are, computed as the file's own decoder does."""
        n, k = self.codes.shape
        codes = self.codes.reshape(n, k // self.group, self.group).astype(np.float32)
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


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Q6_K: super-blocks [rows, nb, 210] of 16 sub-blocks of 16: w = d scale (code - 32), as
    llama.cpp's dequantize_row_q6_K (and the gguf package) compute it; codes are code - 32."""
    low, high = blocks[..., 0:128], blocks[..., 128:192]
    scales = blocks[..., 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks[..., 208:210])
    codes = np.empty((*blocks.shape[:-1], 256), dtype=np.int16)
    for half in range(2):  # each 128 weights: 64 bytes of nibbles, 32 of top bits
        ql, qh = low[..., 64 * half : 64 * half + 64], high[..., 32 * half : 32 * half + 32]
        out = codes[..., 128 * half : 128 * half + 128]
        out[..., 0:32] = (ql[..., :32] & 15) | ((qh >> 0) & 3) << 4
        out[..., 32:64] = (ql[..., 32:] & 15) | ((qh >> 2) & 3) << 4
        out[..., 64:96] = (ql[..., :32] >> 4) | ((qh >> 4) & 3) << 4
        out[..., 96:128] = (ql[..., 32:] >> 4) | ((qh >> 6) & 3) << 4
    scale = d[..., None] * scales  # [rows, nb, 16]
    return (codes - 32).astype(np.int8), scale, np.zeros_like(scale), 6


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
    group = GROUP
    if qtype in LEGACY_BLOCK_BYTES:
        blocks = raw.reshape(out_features, in_features // GROUP, LEGACY_BLOCK_BYTES[qtype])
        codes, scale, offset, bits = _legacy(blocks, qtype)
    elif qtype == Q.Q6_K:
        codes, scale, offset, bits = _q6_k(raw.reshape(out_features, in_features // _SUPER, K_QUANT_BLOCK_BYTES[qtype]))
        group = 16
    elif qtype in K_QUANT_BLOCK_BYTES:
        blocks = raw.reshape(out_features, in_features // _SUPER, K_QUANT_BLOCK_BYTES[qtype])
        codes, scale, offset, bits = _k_quant(blocks, qtype)
    else:
        raise ValueError(f"Expected one of {[t.name for t in SUPPORTED]}, got {qtype.name}")
    return GroupAffine(
        np.ascontiguousarray(codes.reshape(out_features, in_features), dtype=np.int8 if qtype == Q.Q6_K else np.uint8),
        scale.reshape(out_features, -1).astype(np.float32),
        offset.reshape(out_features, -1).astype(np.float32),
        bits,
        group,
    )


@dataclass(frozen=True, slots=True)
class QuantizedTensor:
    """A GGUF tensor still in its file's blocks: a view of the memory map, read when
    the model is built (one tensor at a time) or, for an embedding, a few rows a step."""

    raw: np.ndarray  # uint8 [out, bytes per row], memory-mapped
    qtype: Q
    shape: tuple[int, int]  # [out, in] in weights
    row_order: np.ndarray | None = None  # rows taken in this order (attn_q/attn_k unpermuted)
    name: str | None = None  # the GGUF's, which names the packed matmul kept for the next start

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
        block_bytes = LEGACY_BLOCK_BYTES.get(self.qtype) or K_QUANT_BLOCK_BYTES.get(self.qtype)
        if block_bytes and self.raw.flags.c_contiguous and ids.device.type == "cpu" and qkernel.available():
            return qkernel.embed_rows(self.raw, block_bytes, ids, self.shape[1])
        index = ids.cpu().numpy()
        rows = from_gguf_blocks(self.raw[index], self.qtype, (len(index), self.shape[1]))
        return torch.from_numpy(rows.dequantize()).to(ids.device)


@dataclass(frozen=True, slots=True)
class FloatWeight:
    """A float matmul weight [out, in] (a Hugging Face checkpoint's, `--quantize`) to
    keep as `bits`-bit codes over each group of 32's range, as Q4_1 does; converted when
    the model is built, a chunk of rows at a time."""

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

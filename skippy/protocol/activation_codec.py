"""The 8-bit activation codec (`ActivationDtype.q8`): llama.cpp's Q8_0 block on the wire.

A row of W values (W a multiple of 32) is W / 32 blocks of 34 bytes: an f16 scale d, then
32 int8 codes q. Each block is quantized alone, as ggml's `quantize_row_q8_0_ref` does:

    d = max|x| / 127            (f32; stored as f16)
    q = roundf(x / d)           (half away from zero; all zeros when d is 0)
    x' = f16(d) * q             (decoding)

so a value's error is at most half a step of its own block (plus the scale's f16
rounding), and one outlier costs only its 31 neighbours their precision. The bytes equal
gguf-py's Q8_0 quantizer's (tests/test_activation_codec.py).

Why 8 bits per block and not f16 or a per-row scale: a decode row of SmolLM2 (576 values)
is 612 bytes instead of 1,152 (f16) or 2,304 (f32), and hidden states carry a few
channels far larger than the rest, which a per-row scale would spend the codes on.
"""

from __future__ import annotations

import numpy as np

from .constants import Q8_BLOCK, Q8_BLOCK_VALUES, ActivationDtype
from .errors import FrameError

_F16_MAX = float(np.finfo(np.float16).max)


def q8_encode(rows: np.ndarray) -> np.ndarray:
    """float rows (n, W) -> (n, W / 32) Q8_BLOCK records. ValueError for a width that is not
    a multiple of 32, or a value q8 cannot carry (not finite, or a block whose scale
    overflows f16: |x| > 65504 * 127)."""
    rows = np.asarray(rows, dtype=np.float32)
    if rows.ndim != 2 or rows.shape[1] % Q8_BLOCK_VALUES:
        raise ValueError(f"q8: expected rows (n, W) with W a multiple of {Q8_BLOCK_VALUES}, got {rows.shape}")
    n, width = rows.shape
    x = rows.reshape(n, width // Q8_BLOCK_VALUES, Q8_BLOCK_VALUES)
    amax = _block_absmax(x)
    if not np.isfinite(amax).all() or amax.max(initial=0.0) / 127 > _F16_MAX:
        raise ValueError("q8: activations must be finite and below 65504 * 127 in magnitude")
    d = amax / np.float32(127)
    inverse = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    scaled = x * inverse[..., None]
    out = np.empty((n, width // Q8_BLOCK_VALUES), dtype=Q8_BLOCK)
    out["d"] = d  # f32 -> f16, round to nearest (ggml's GGML_FP32_TO_FP16)
    # roundf: half away from zero, written as gguf-py's reference does, so the bytes match
    out["qs"] = np.copysign(np.floor(np.abs(scaled) + np.float32(0.5)), scaled)
    return out


def _block_absmax(x: np.ndarray) -> np.ndarray:
    """max |x| over the last axis (32): halves folded onto each other, since numpy's reduction
    over a short inner axis is slow (256 rows of 576: ~2.5x faster than .max(axis=2))."""
    folded = np.abs(x[..., :16])
    np.maximum(folded, np.abs(x[..., 16:]), out=folded)
    for half in (8, 4, 2, 1):
        np.maximum(folded[..., :half], folded[..., half:2 * half], out=folded[..., :half])
    return folded[..., 0]


def q8_decode(blocks: np.ndarray) -> np.ndarray:
    """(n, W / 32) Q8_BLOCK records -> float32 rows (n, W), a new writable array."""
    n, count = blocks.shape
    values = blocks["qs"].astype(np.float32)
    values *= blocks["d"].astype(np.float32)[..., None]
    return values.reshape(n, count * Q8_BLOCK_VALUES)


def check_q8_scales(blocks: np.ndarray) -> None:
    """FrameError unless every block's scale is finite and >= 0 (what an encoder writes): a
    NaN or infinite scale would poison the next stage's hidden state without an error."""
    scales = blocks["d"]
    if not (np.isfinite(scales) & (scales >= 0)).all():
        bad = scales[~(np.isfinite(scales) & (scales >= 0))].ravel()[:4].tolist()
        raise FrameError(f"activation (q8): expected finite scales >= 0, got {bad}")


# `--activation-dtype auto`: each frame goes in the widest dtype whose bytes the link moves in at
# most this share of the time its rows took to compute: f32, else f16, else q8. f32 where it
# costs nothing (loopback, a LAN) keeps a chain's greedy output bit for bit one process's.
AUTO_SHARE = 0.05
AUTO_ORDER = (ActivationDtype.f32, ActivationDtype.f16, ActivationDtype.q8)


def auto_dtype(rows: int, width: int, bytes_per_s: float, compute_s: float) -> ActivationDtype:
    """The wire dtype of a frame of `rows` rows of `width` values, on a link that moves
    `bytes_per_s`, whose rows took `compute_s` to compute. On 100 Mbit/s a decode row (~2 ms
    of compute, 576 values) goes f16: 92 us, where f32 would take 184; a 64-row prompt chunk
    (~25 ms) goes q8: 3.1 ms against f16's 5.9. On 1 Gbit/s both stay f32. q8 needs whole
    blocks of 32 values: other widths stop at f16."""
    budget = AUTO_SHARE * compute_s * bytes_per_s
    for dtype in AUTO_ORDER:
        if dtype.nbytes(rows, width) <= budget:
            return dtype
    return ActivationDtype.q8 if width % Q8_BLOCK_VALUES == 0 else ActivationDtype.f16

"""The pieces of a block, as plain functions over tensors.

Activations are float32 rows [T, D]; weights may be float16/bfloat16, in which
case the matmul runs in the weight dtype and its result comes back as float32.

A decode step runs every function here on one row, where each torch call costs
more than its arithmetic, so these use as few calls as they can.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import qkernel

# From this many rows on, a float16/bfloat16 matmul on CPU upcasts the weight and
# runs float32 GEMM instead: torch's CPU half-precision GEMM costs a full pass over
# the weight per row (the fastest choice for a decode step, ~4x slower than the
# upcast at a 200-row prefill; the two break even at 4 to 8 rows).
MIN_ROWS_TO_UPCAST = 8


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, in] float32, weight [out, in] -> [T, out] float32.

    A half-precision weight with few rows runs torch's half-precision GEMV, which
    accumulates in float32 but takes and returns half-precision rows.
    """
    if weight.dtype == x.dtype:
        return F.linear(x, weight)
    if x.shape[0] >= MIN_ROWS_TO_UPCAST and weight.device.type == "cpu":
        return F.linear(x, weight.float())
    return F.linear(x.to(weight.dtype), weight).float()


def decode_layout(weight: torch.Tensor) -> torch.Tensor:
    """The same [out, in] weight, in the memory order that one-row matmuls stream fastest.

    On CPU with one input row, MKL's float32 kernels run faster on a column-major
    weight when out > in (qkv, gate_up, the head), and slower when out < in (down).
    torch's own float16/bfloat16 kernel reads rows, and runs far slower on a
    column-major weight, so those stay row-major (docs/decisions.md).
    """
    out_features, in_features = weight.shape
    if weight.device.type == "cpu" and weight.dtype == torch.float32 and out_features > in_features:
        return weight.t().contiguous().t()
    return weight


# The batch size oneDNN picks its weight layout for (the layouts for 2 to 64 ran alike).
REPACK_BATCH_HINT = 4


@dataclass(slots=True)
class Linear:
    """One weight [out, in] and the matmul through it: x [T, in] float32 -> [T, out] float32.

    `weight` is in decode_layout, for one-row steps. `batched` (after `repack`) is a
    second copy, prepacked by oneDNN, for calls with several rows: on CPU, MKL's
    float32 GEMM runs small batches far below the memory bound. One row stays on
    MKL, where oneDNN is slower. `python bench/matmul.py` compares the two;
    docs/decisions.md has its figures.
    """

    weight: torch.Tensor
    batched: torch.Tensor | None = None
    bias: torch.Tensor | None = None  # float32 [out] (Qwen2's q, k, v)

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Linear":
        return cls(decode_layout(weight), bias=bias)

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The weight as loaded (not the repacked copy), and the bias."""
        return [self.weight] if self.bias is None else [self.weight, self.bias]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, bf16: bool = False) -> torch.Tensor:
        """x · W^T (+ bias), plus `residual` when given. `bf16` (a QuantLinear's bfloat16 prompt
        path) changes nothing here: float weights run torch's matmul in their own dtype."""
        if self.batched is not None and x.shape[0] > 1:
            out = self.through_repacked(x)
        else:
            out = linear(x, self.weight)
        if self.bias is not None:
            out = out + self.bias
        return out if residual is None else residual + out

    def through_repacked(self, x: torch.Tensor) -> torch.Tensor:
        """x through the oneDNN copy, whatever its row count (after `repack`)."""
        return torch.ops.mkldnn._linear_pointwise(x, self.batched, None, "none", [], "")

    @property
    def can_repack(self) -> bool:
        """Only CPU float32 weights: half-precision ones take another path (see linear)."""
        w = self.weight
        return w.device.type == "cpu" and w.dtype == torch.float32 and torch.backends.mkldnn.is_available()

    def repack(self) -> int:
        """Add the multi-row copy; returns the bytes it takes (0 where it does not apply)."""
        if not self.can_repack or self.batched is not None:
            return 0
        self.batched = torch.ops.mkldnn._reorder_linear_weight(self.weight.contiguous(), REPACK_BATCH_HINT)
        return self.batched.nbytes


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _on_our_kernels(x) and weight.dtype == torch.float32:
        return qkernel.rms_norm(x.contiguous(), weight, eps)  # 28 us a row through F.rms_norm, ~2 here
    return F.rms_norm(x, weight.shape, weight, eps)


def _on_our_kernels(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and qkernel.available()


def rope_tables(theta: float, head_dim: int, context_length: int, freq_factors: tuple[float, ...] | None,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, signed sin: [context_length, head_dim] for half-rotation RoPE of base `theta`,
    each frequency divided by its factor (linear or Llama 3 scaling; None: unscaled).

    The sin table's first half is negated, so that rotate_half(x) * sin becomes
    swap_halves(x) * signed_sin (see apply_rope).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float64)
    positions = torch.arange(context_length, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
    signed_sin = torch.cat([-angles.sin(), angles.sin()], dim=-1)
    return cos.float().to(device), signed_sin.float().to(device)


def head_norms_(qkv: torch.Tensor, heads: int, kv_heads: int, q_norm: torch.Tensor, k_norm: torch.Tensor,
                eps: float) -> torch.Tensor:
    """RMS-norm each q head and each k head of qkv [T, H + 2 KVH, head_dim] in place
    (Qwen3, Gemma 3: before RoPE), q heads with q_norm, k heads with k_norm. Returns qkv."""
    if _on_our_kernels(qkv) and qkv.is_contiguous():
        qkernel.head_rms_norm_(qkv, 0, heads, q_norm, eps)
        return qkernel.head_rms_norm_(qkv, heads, kv_heads, k_norm, eps)
    head_dim = qkv.shape[-1]
    qkv[:, :heads] = F.rms_norm(qkv[:, :heads], (head_dim,), q_norm, eps)
    qkv[:, heads : heads + kv_heads] = F.rms_norm(qkv[:, heads : heads + kv_heads], (head_dim,), k_norm, eps)
    return qkv


def apply_rope(x: torch.Tensor, heads: int, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `heads` heads of x [T, row_heads, head_dim] in place (the q and k
    heads of a fused qkv row); cos, signed_sin: [T, head_dim] for these rows' positions.
    Returns x.

    x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1) (the Hugging
    Face layout). Not addcmul: whether its kernel fuses the multiply-add depends on
    the tensor's shape, so a session's rows would round differently alone and in a
    batch.
    """
    if _on_our_kernels(x) and x.is_contiguous():
        return qkernel.rope_(x, heads, cos, signed_sin)
    rotated = x[:, :heads]
    swapped = rotated.roll(x.shape[-1] // 2, dims=-1)  # cat(x2, x1)
    x[:, :heads] = rotated * cos[:, None] + swapped * signed_sin[:, None]
    return x


# Through torch (off our kernels: CUDA, no compiler), up to this many rows of one session
# (speculative verify windows) attend one row at a time; longer runs (prefill chunks)
# take the masked kernel in one call. On our kernels every row attends alone (attend_rows).
ROWS_ONE_BY_ONE = 32


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
              window: int = 0) -> torch.Tensor:
    """Causal grouped-query attention of one session's new rows over its cache.

    q: [heads, n, head_dim] at positions [start, start+n); k, v: [kv_heads, start+n, head_dim],
    float32 or the cache's 16-bit dtype. `window` > 0: a sliding window, query p sees keys
    (p - window, p] only; the cache keeps every position and the window is a mask on it.
    Returns [n, heads * head_dim].
    """
    heads, n, head_dim = q.shape
    if 1 < n <= ROWS_ONE_BY_ONE:
        # A verify window: each row alone over exactly the keys it sees, so a window's
        # rows round as one-row decode steps do (the masked kernel tiles differently,
        # and a last-bit difference can grow until speculation changes a greedy token).
        rows = []
        for i in range(n):
            first, end = (max(0, start + i + 1 - window) if window else 0), start + i + 1
            rows.append(attention(q[:, i : i + 1], k[:, first:end], v[:, first:end], end - first - 1, scale))
        return torch.cat(rows)
    if k.dtype != q.dtype:  # a 16-bit cache: CPU SDPA runs far slower in 16 bits than float32
        k, v = k.to(q.dtype), v.to(q.dtype)
    first = max(0, start + 1 - window) if window else 0  # keys before this no query of ours sees
    k, v = k[:, first:], v[:, first:]
    if n == 1 and not window:
        mask = None  # one new row sees every cached position
    else:
        # query i sits at position start+i and may see keys (start+i-window, start+i]
        key_pos = torch.arange(first, first + k.shape[1], device=q.device)
        query_pos = torch.arange(start, start + n, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        if window:
            mask &= key_pos[None, :] > query_pos[:, None] - window
    # a leading batch dim of 1: torch's CPU kernels take a much slower path on 3-D inputs
    out = F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=heads != k.shape[0]
    )
    return out[0].transpose(0, 1).reshape(n, heads * head_dim)


def decode_rows(segments, x: torch.Tensor) -> "qkernel.DecodeRows | None":
    """The forward's sessions for attend_sessions' one-call path: when every session adds
    one row and our kernels run (a decode step, batched or not), else None. Call after
    the caches are reserved."""
    caches = [s.cache for s in segments]
    if not (_on_our_kernels(x) and all(s.num_tokens == 1 for s in segments)
            and all(c.k.dtype in (torch.float16, torch.float32) for c in caches)):
        return None
    if len(segments) == 1:  # one session decoding: its arrays are built once (~50 us a step, cold)
        cache, start = caches[0], segments[0].start
        seen = (cache.k.data_ptr(), cache.v.data_ptr(), cache.k.shape[2])
        view = cache.kernel_view
        if view is None or view[0] != seen:
            view = cache.kernel_view = (seen, qkernel.DecodeRows.of([cache.k], [cache.v], [start]))
        view[1].position[0] = start
        return view[1]
    return qkernel.DecodeRows.of([c.k for c in caches], [c.v for c in caches], [s.start for s in segments])


WINDOW_ROWS_MAX = 16  # rows a forward may have to run as windows in one call (a verify window: up to 9)


def window_rows(segments, x: torch.Tensor) -> "qkernel.DecodeRows | None":
    """decode_rows for skippy_decode_layers' one call, which also takes verify windows: a
    session's few rows, each a row of its own at its position in the session's cache (the
    kernel stores a window's keys and values before any of its rows attends). Up to
    WINDOW_ROWS_MAX rows in all: the layer loop's calls cost ~4 ms a forward of the bundled
    model, a window's whole compute; a prompt's many rows keep the loop, whose matmuls take
    them in AMX tiles."""
    if all(s.num_tokens == 1 for s in segments):
        return decode_rows(segments, x)
    caches = [s.cache for s in segments]
    if not (x.shape[0] <= WINDOW_ROWS_MAX and _on_our_kernels(x)
            and all(c.k.dtype in (torch.float16, torch.float32) for c in caches)):
        return None
    rows = [(s.cache, s.start + i) for s in segments for i in range(s.num_tokens)]
    return qkernel.DecodeRows.of([c.k for c, _ in rows], [c.v for c, _ in rows], [p for _, p in rows])


def attend_sessions(qkv: torch.Tensor, layer: int, segments, rows: "qkernel.DecodeRows | None", scale: float,
                    window: int = 0) -> torch.Tensor:
    """Store every session's new keys and values of qkv [T, H + 2 KVH, head_dim] (q, k, v
    heads; RoPE applied) in its cache at `layer`, and attend each session's queries over
    its own cache (the last `window` positions of it, when > 0): [T, H * head_dim].
    `segments` give each session's rows, in order.

    A decode step's rows go through one kernel call (`rows`, from decode_rows): through
    torch, each session's cache write and attention cost ~50 us of calls a layer, which
    at 8 sessions was more than all the step's matmuls."""
    T, width, head_dim = qkv.shape
    kv_heads = segments[0].cache.k.shape[1]
    heads = width - 2 * kv_heads
    if rows is not None:
        return qkernel.decode_attention(qkv, rows, layer, heads, kv_heads, scale, window)
    # [heads, T, head_dim] each
    q, k, v = (qkv[:, :heads].transpose(0, 1), qkv[:, heads : heads + kv_heads].transpose(0, 1),
               qkv[:, heads + kv_heads :].transpose(0, 1))
    # On our kernels every row attends as a decode step's row does, bit for bit: a prompt
    # replayed after a lost stage, or restored from the prefix cache, then continues as the
    # uninterrupted decode did (through torch's masked kernel a last-bit difference, rounded
    # to int8 by the next matmul, could change a greedy token).
    exact = _on_our_kernels(qkv) and qkv.is_contiguous()
    outputs, row = [], 0
    for s in segments:
        mine = slice(row, row + s.num_tokens)
        keys, values = s.cache.write(layer, s.start, k[:, mine], v[:, mine])
        if exact and keys.dtype in (torch.float16, torch.float32):
            outputs.append(qkernel.attend_rows(qkv[mine], heads, keys, values, s.start, scale, window))
        else:
            outputs.append(attention(q[:, mine], keys, values, s.start, scale, window))
        row += s.num_tokens
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0]


def gated_mlp(x: torch.Tensor, gate_up: Linear, down: Linear, activation: str, residual: torch.Tensor,
              post_norm: torch.Tensor | None = None, eps: float = 0.0, bf16: bool = False) -> torch.Tensor:
    """residual + down(act(gate(x)) * up(x)), act silu (SwiGLU) or gelu_tanh (GeGLU);
    with `post_norm` (Gemma) the product is RMS-normed before the residual add. `bf16`: the
    matmuls on the bfloat16 prompt path (QuantLinear)."""
    both = gate_up(x, bf16=bf16)
    if _on_our_kernels(both):
        hidden = qkernel.swiglu(both) if activation == "silu" else qkernel.geglu(both)
    else:
        gate, up = both.chunk(2, dim=-1)
        hidden = (F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")) * up
    return add_residual(down, hidden, residual, post_norm, eps, bf16)


def add_residual(linear: Linear, x: torch.Tensor, residual: torch.Tensor, post_norm: torch.Tensor | None,
                 eps: float, bf16: bool = False) -> torch.Tensor:
    """residual + linear(x), summed inside the matmul where it can be; with `post_norm`,
    residual + rms_norm(linear(x)) (Gemma's norms after attention and the MLP). `bf16`: as gated_mlp's."""
    if post_norm is None:
        return linear(x, residual=residual, bf16=bf16)
    return residual + rms_norm(linear(x, bf16=bf16), post_norm, eps)

"""A llama-family model cut to one stage's layer range.

    first stage:  token ids --embed--> hidden
    every stage:  hidden --blocks[start:end]--> hidden
    last stage:   hidden --norm, head--> logits   (compute_logits)

Several sessions run in one call: their rows are concatenated for the matmuls
and attend separately, each over its own KV cache (a `Segment`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .args import LayerRange, ModelArgs
from .kv_cache import KVCache
from .layers import Linear, apply_rope, attend_sessions, decode_rows, rms_norm, rope_tables, swiglu
from .quant import QuantLinear, QuantizedTensor, build_linear

Weight = torch.Tensor | QuantizedTensor


@dataclass(frozen=True, slots=True)
class Segment:
    """One session's rows in a batched forward: positions [start, start + num_tokens)."""

    cache: KVCache
    start: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Block:
    attn_norm: torch.Tensor
    wqkv: Linear | QuantLinear  # q, k, v projections stacked: one matmul instead of three
    wo: Linear | QuantLinear
    ffn_norm: torch.Tensor
    w_gate_up: Linear | QuantLinear  # gate and up stacked
    w_down: Linear | QuantLinear


class StageModel:
    def __init__(
        self,
        args: ModelArgs,
        layers: LayerRange,
        weights: dict[str, Weight],
        device: torch.device,
        kv_dtype: torch.dtype = torch.float32,
        on_built: Callable[[], None] = lambda: None,
    ):
        """`weights`: float tensors, or QuantizedTensors packed here one matmul at a
        time (so building never holds more than one block's unpacked codes).
        `on_built` is called after each block and the head (a progress bar)."""
        self.args, self.layers, self.device, self.kv_dtype = args, layers, device, kv_dtype
        self.blocks = []
        for i in range(layers.start, layers.end):
            self.blocks.append(self._block(weights, i))
            on_built()
        # a quantized embedding stays in the file's blocks: a step reads only its tokens' rows
        self.embedding = weights.get("token_embd.weight") if layers.is_first else None
        if layers.is_last:
            self.output_norm = weights["output_norm.weight"]
            head = weights.get("output.weight")
            self.head = build_linear([weights["token_embd.weight"] if head is None else head], device)
            if self.embedding is not None and head is None and isinstance(self.head, Linear):
                self.embedding = self.head.weight  # tied: look tokens up in the head's copy, not a second one
            on_built()
        self.cos, self.signed_sin = rope_tables(args, device)

    def _block(self, w: dict[str, Weight], i: int) -> Block:
        p = f"blk.{i}."
        return Block(
            attn_norm=w[p + "attn_norm.weight"],
            wqkv=build_linear([w[p + "attn_q.weight"], w[p + "attn_k.weight"], w[p + "attn_v.weight"]], self.device),
            wo=build_linear([w[p + "attn_output.weight"]], self.device),
            ffn_norm=w[p + "ffn_norm.weight"],
            w_gate_up=build_linear([w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"]], self.device),
            w_down=build_linear([w[p + "ffn_down.weight"]], self.device),
        )

    def new_cache(self, max_tokens: int | None = None) -> KVCache:
        args = self.args
        return KVCache(
            self.layers.num_local_layers, args.num_kv_heads, args.head_dim,
            max_tokens or args.context_length, self.kv_dtype, self.device,
        )  # fmt: skip

    @property
    def linears(self) -> list[Linear | QuantLinear]:
        heads = [self.head] if self.layers.is_last else []
        return [getattr(b, name) for b in self.blocks for name in ("wqkv", "wo", "w_gate_up", "w_down")] + heads

    @property
    def parameter_bytes(self) -> int:
        """Bytes of the model's own tensors in memory (not the repacked copies, nor a
        quantized embedding, which stays in the memory-mapped file)."""
        tensors = [t for b in self.blocks for t in (b.attn_norm, b.ffn_norm)]
        tensors += [t for t in (self.embedding, getattr(self, "output_norm", None)) if isinstance(t, torch.Tensor)]
        tensors += [t for linear in self.linears for t in linear.tensors]
        unique = {t.data_ptr(): t.nbytes for t in tensors}
        return sum(unique.values())

    @property
    def weight_format(self) -> str:
        """What the matmul weights are ("q4", "q4+q8", "float32", ...): caches of KV rows
        computed with other weights must not be shared."""
        kinds = {lin.format if isinstance(lin, QuantLinear) else str(lin.weight.dtype).removeprefix("torch.")
                 for lin in self.linears}
        return "+".join(sorted(kinds))

    @property
    def repack_bytes(self) -> int:
        """What `repack_for_batches` adds (or added)."""
        return sum(linear.weight.nbytes for linear in self.linears if linear.can_repack)

    def repack_for_batches(self) -> int:
        """Keep a multi-row copy of every matmul weight (see Linear): batched decode,
        prefill and verify windows run faster for twice the weights' memory. Returns the
        bytes added; 0 off CPU float32."""
        return sum(linear.repack() for linear in self.linears)

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """x: token ids [T] (first stage) or hidden rows [T, D]; returns hidden [T, D].

        Rows are the segments' tokens, concatenated in order. Each segment writes
        its keys/values at [start, start+n), overwriting anything from there on.
        """
        args = self.args
        if self.layers.is_first and not torch.is_floating_point(x):
            x = self._embed(x.to(self.device)).to(torch.float32)
        else:  # a copy: the residual sums below write into x
            x = x.to(self.device, torch.float32, copy=True)
        T = x.shape[0]
        assert T == sum(s.num_tokens for s in segments), "rows must match the segments"
        for s in segments:
            s.cache.reserve(s.start, s.num_tokens)
        cos, sin = self._rope_rows(segments)  # [T, head_dim]
        rows = decode_rows(segments, x)  # a decode step: each layer's attention in one call
        H, KVH = args.num_heads, args.num_kv_heads

        for layer, block in enumerate(self.blocks):
            # attention: x + Wo · attn(rope(Wq·h), rope(Wk·h), Wv·h), each session over its own cache
            h = rms_norm(x, block.attn_norm, args.rms_norm_eps)
            qkv = block.wqkv(h).view(T, H + 2 * KVH, args.head_dim)
            qkv = apply_rope(qkv, H + KVH, cos, sin)  # q and k heads rotate in one go
            x = block.wo(attend_sessions(qkv, layer, segments, rows), residual=x)
            # feed-forward: x + W_down · (silu(W_gate·h) * W_up·h)
            x = swiglu(rms_norm(x, block.ffn_norm, args.rms_norm_eps), block.w_gate_up, block.w_down, residual=x)

        for s in segments:
            s.cache.commit(s.start + s.num_tokens)
        return x

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embedding, QuantizedTensor):
            return self.embedding.embed(ids)
        return self.embedding[ids].float()

    def _rope_rows(self, segments: list[Segment]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin rows [T, head_dim] at the segments' positions: slices of
        the tables, so a one-segment call builds no index tensor."""
        if len(segments) == 1:
            rows = slice(segments[0].start, segments[0].start + segments[0].num_tokens)
            return self.cos[rows], self.signed_sin[rows]
        cos = torch.cat([self.cos[s.start : s.start + s.num_tokens] for s in segments])
        sin = torch.cat([self.signed_sin[s.start : s.start + s.num_tokens] for s in segments])
        return cos, sin

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, D] -> float32 logits [T, vocab] (last stage only)."""
        if not self.layers.is_last:
            raise RuntimeError(f"Stage {self.layers} has no output head; only the last stage computes logits")
        return self.head(rms_norm(hidden, self.output_norm, self.args.rms_norm_eps)).float()  # no copy if float32


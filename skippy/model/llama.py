"""A decoder-only model cut to one stage's layer range: the llama block, with the
differences of the other architectures (architecture.py) as optional parts of it.

    first stage:  token ids --embed--> hidden
    every stage:  hidden --blocks[start:end]--> hidden
    last stage:   hidden --norm, head--> logits   (compute_logits)

Several sessions run in one call: their rows are concatenated for the matmuls
and attend separately, each over its own KV cache (a `Segment`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import qkernel
from .args import LayerRange, ModelArgs
from .inference import inference_mode
from .kv_cache import KVCache
from .layers import (WINDOW_ROWS_MAX, Linear, add_residual, apply_rope, attend_sessions, decode_rows, gated_mlp,
                     head_norms_, rms_norm, rope_tables, window_rows)
from .quant import QuantizedTensor
from .quant_linear import QuantLinear, build_linear
from .weight_arena import WeightArena

Weight = torch.Tensor | QuantizedTensor
log = logging.getLogger(__name__)

PREFILL_PRECISIONS = ("exact", "bf16")
# Fewest rows a forward's matmuls take on the bfloat16 prompt path (--prefill-precision bf16):
# at 16 rows the integer kernels are as fast (0.9-1.65x), from 32 on the bf16 tiles are never
# slower (1.0-2.5x; docs/decisions.md, "Prompts on AMX-BF16 tiles, opt-in")
BF16_PREFILL_MIN_ROWS = 32


@dataclass(frozen=True, slots=True)
class Segment:
    """One session's rows in a batched forward: positions [start, start + num_tokens)."""

    cache: KVCache
    start: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Block:
    attn_norm: torch.Tensor
    wqkv: Linear | QuantLinear  # q, k, v projections stacked: one matmul instead of three (+ Qwen2's biases)
    wo: Linear | QuantLinear
    ffn_norm: torch.Tensor
    w_gate_up: Linear | QuantLinear  # gate and up stacked
    w_down: Linear | QuantLinear
    rope: int  # which of the model's RoPE tables (Gemma 3's sliding layers have their own)
    window: int = 0  # sliding-window attention over this many keys; 0: all
    q_norm: torch.Tensor | None = None  # per-head norms of q and k (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # norms of the attention and MLP outputs (Gemma 3)
    post_ffn_norm: torch.Tensor | None = None


class StageModel:
    def __init__(
        self,
        args: ModelArgs,
        layers: LayerRange,
        weights: dict[str, Weight],
        device: torch.device,
        kv_dtype: torch.dtype = torch.float32,
        on_built: Callable[[], None] = lambda: None,
        arena: WeightArena | None = None,
        prefill_precision: str = "exact",
    ):
        """`weights`: float tensors, or QuantizedTensors packed here one matmul at a
        time (so building never holds more than one block's unpacked codes).
        `on_built` is called after each block and the head (a progress bar). `arena`: where
        packed weights go (default: a huge-page arena of their own on CPU).
        `prefill_precision`: "exact" (a prompt's rows are the integer kernels' bits, those of
        the decode steps that would replay it: the prefix cache, replay after a lost stage and
        speculation rely on it) or "bf16" (forwards of prompt rows only, BF16_PREFILL_MIN_ROWS
        or more, on AMX-BF16 tiles: ~2x faster, bfloat16's precision); "bf16" where the CPU or
        OS has no AMX-BF16 stays exact, said once in the log."""
        if prefill_precision not in PREFILL_PRECISIONS:
            raise ValueError(f"Expected a prefill precision in {PREFILL_PRECISIONS}, got {prefill_precision!r}")
        self.args, self.layers, self.device, self.kv_dtype = args, layers, device, kv_dtype
        arch = args.arch
        self.activation = arch.activation
        self.embed_scale = math.sqrt(args.hidden_size) if arch.scales_embedding else None
        self.scale = (args.query_pre_attn_scalar or args.head_dim) ** -0.5  # of the attention scores
        # RoPE tables: [0] the global layers', [1] the sliding layers' own (Gemma 3)
        tables = [(args.rope_theta, args.rope_freq_factors)]
        if args.sliding_rope_theta is not None:
            tables.append((args.sliding_rope_theta, None))
        self.rope_tables = [rope_tables(theta, args.head_dim, args.context_length, factors, device)
                            for theta, factors in tables]
        # packed weights on huge pages (CPU; weight_arena.py), released with the last of them
        if arena is None and device.type == "cpu":
            arena = WeightArena()
        self.blocks = []
        for i in range(layers.start, layers.end):
            self.blocks.append(self._block(weights, i, arena))
            on_built()
        # a quantized embedding stays in the file's blocks: a step reads only its tokens' rows
        self.embedding = weights.get("token_embd.weight") if layers.is_first else None
        if layers.is_last:
            self.output_norm = weights["output_norm.weight"]
            head = weights.get("output.weight")
            self.head = build_linear([weights["token_embd.weight"] if head is None else head], device, arena=arena)
            if self.embedding is not None and head is None and isinstance(self.head, Linear):
                self.embedding = self.head.weight  # tied: look tokens up in the head's copy, not a second one
            on_built()
        self.decode_layers = self._decode_layers()
        self.prefill_bf16 = prefill_precision == "bf16" and self._bf16_prefill_runs()
        self._step_logits: tuple[torch.Tensor, torch.Tensor] | None = None  # (hidden, its logits) of the last step
        self._step_picks: tuple[torch.Tensor, list[int | None]] | None = None  # (hidden, its greedy picks)

    def _decode_layers(self) -> qkernel.DecodeLayers | None:
        """The blocks as one kernel call for decode steps, where every block is one it runs
        (the llama family on our kernels; the loop in forward is the reference)."""
        args, blocks = self.args, self.blocks
        if not (blocks and qkernel.available() and self.activation == "silu" and self.device.type == "cpu"
                and len(self.rope_tables) == 1):
            return None
        for b in blocks:
            matmuls = (b.wqkv, b.wo, b.w_gate_up, b.w_down)
            if not (all(isinstance(m, QuantLinear) and m.bias is None for m in matmuls)
                    and b.q_norm is None and b.post_attn_norm is None and b.post_ffn_norm is None
                    and b.attn_norm.dtype == b.ffn_norm.dtype == torch.float32):
                return None
        layers = [(b.attn_norm, b.ffn_norm, b.wqkv, b.wo, b.w_gate_up, b.w_down, b.window) for b in blocks]
        head = None
        if (self.layers.is_last and isinstance(self.head, QuantLinear) and self.head.bias is None
                and self.output_norm.dtype == torch.float32 and not args.final_logit_softcapping):
            head = (self.output_norm, self.head)  # the step's logits in the same call (compute_logits)
        return qkernel.DecodeLayers(layers, args.num_heads, args.num_kv_heads, args.head_dim,
                                    blocks[0].w_down.in_features, args.rms_norm_eps, self.scale, head)

    def _bf16_prefill_runs(self) -> bool:
        """Whether --prefill-precision bf16 can take effect here; says why not when it cannot."""
        if not any(isinstance(linear, QuantLinear) for linear in self.linears):
            log.warning("--prefill-precision bf16: no matmul here runs on our integer kernels; prompts run as before")
            return False
        if self.device.type != "cpu" or not qkernel.bf16_ready():
            log.warning("--prefill-precision bf16: no AMX-BF16 tiles here (the CPU, its OS, or SKIPPY_AMX=0); "
                        "prompts stay exact")
            return False
        return True

    def _block(self, w: dict[str, Weight], i: int, arena: WeightArena | None) -> Block:
        p, args, arch = f"blk.{i}.", self.args, self.args.arch
        qkv = [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]
        biases = [w[name.replace(".weight", ".bias")] for name in qkv] if arch.qkv_bias else None
        window = args.window_of(i)
        return Block(
            attn_norm=w[p + "attn_norm.weight"],
            wqkv=build_linear([w[name] for name in qkv], self.device, biases, arena=arena),
            wo=build_linear([w[p + "attn_output.weight"]], self.device, arena=arena),
            ffn_norm=w[p + "ffn_norm.weight"],
            w_gate_up=build_linear([w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"]], self.device, arena=arena),
            # the down projection's input, act(gate) * up, is heavy-tailed: one outlier sets a group's
            # int8 step for 31 small values. Two levels there, one elsewhere: most of two levels'
            # accuracy for little of their cost (bench/accuracy.py; docs/decisions.md)
            w_down=build_linear([w[p + "ffn_down.weight"]], self.device, activation_levels=2, arena=arena),
            rope=1 if window and len(self.rope_tables) > 1 else 0,
            window=window,
            q_norm=w[p + "attn_q_norm.weight"] if arch.qk_norm else None,
            k_norm=w[p + "attn_k_norm.weight"] if arch.qk_norm else None,
            post_attn_norm=w[p + "post_attention_norm.weight"] if arch.post_norms else None,
            post_ffn_norm=w[p + "post_ffw_norm.weight"] if arch.post_norms else None,
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
        norms = ("attn_norm", "ffn_norm", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm")
        tensors = [t for b in self.blocks for t in (getattr(b, n) for n in norms) if t is not None]
        tensors += [t for t in (self.embedding, getattr(self, "output_norm", None)) if isinstance(t, torch.Tensor)]
        tensors += [t for linear in self.linears for t in linear.tensors]
        unique = {t.data_ptr(): t.nbytes for t in tensors}
        return sum(unique.values())

    @property
    def weight_format(self) -> str:
        """What the matmul weights are ("q4+q4x2+q8", "float32", ...; x2: inputs rounded in two
        levels): caches of KV rows computed with other weights must not be shared."""
        kinds = {lin.format if isinstance(lin, QuantLinear) else str(lin.weight.dtype).removeprefix("torch.")
                 for lin in self.linears}
        # a bfloat16 prompt fills other KV rows than an exact one: its prefix-cache entries are its own
        return "+".join(sorted(kinds)) + (";prefill-bf16" if self.prefill_bf16 else "")

    @property
    def repack_bytes(self) -> int:
        """What `repack_for_batches` adds (or added)."""
        return sum(linear.weight.nbytes for linear in self.linears if linear.can_repack)

    def repack_for_batches(self) -> int:
        """Keep a multi-row copy of every matmul weight (see Linear): batched decode,
        prefill and verify windows run faster for twice the weights' memory. Returns the
        bytes added; 0 off CPU float32."""
        return sum(linear.repack() for linear in self.linears)

    @inference_mode
    def forward(self, x: torch.Tensor, segments: list[Segment],
                greedy: list[tuple[list[int], list[float]] | None] | None = None) -> torch.Tensor:
        """x: token ids [T] (first stage) or hidden rows [T, D]; returns hidden [T, D].

        Rows are the segments' tokens, concatenated in order. Each segment writes
        its keys/values at [start, start+n), overwriting anything from there on.
        `greedy` (final stage, per segment): None, or the logit_bias of a greedy pick
        (RequestSampler.greedy_bias) that a decode step's kernels may make as they write
        its logits: `step_picks` hands those out.
        """
        args = self.args
        if self.layers.is_first and not torch.is_floating_point(x):
            x = self._embed(x.to(self.device)).to(torch.float32)
            if self.embed_scale is not None:  # Gemma: embeddings times sqrt(hidden_size)
                x = x * self.embed_scale
        else:  # a copy: the residual sums below write into x
            x = x.to(self.device, torch.float32, copy=True)
        T = x.shape[0]
        assert T == sum(s.num_tokens for s in segments), "rows must match the segments"
        for s in segments:
            s.cache.reserve(s.start, s.num_tokens)
        # a decode step (or verify windows, on our kernels' one call): each layer's attention in one call
        rows = (window_rows if self.decode_layers is not None else decode_rows)(segments, x)
        H, KVH, eps = args.num_heads, args.num_kv_heads, args.rms_norm_eps

        self._step_logits = self._step_picks = None
        if rows is not None and self.decode_layers is not None:
            # a decode step on our kernels: the loop below in one call, reading RoPE at each row's position;
            # on the final stage the call goes on to the rows' logits, which compute_logits hands out
            logits = torch.empty(T, self.decode_layers.vocab) if self.decode_layers.head is not None else None
            picks = None
            # the bias ids were checked against the vocab (greedy_bias), which must be the head's
            if (logits is not None and greedy is not None and logits.shape[1] == self.args.vocab_size
                    and any(bias is not None for bias in greedy)):
                # one entry a row: a verify window's rows are the sampler's to pick (None)
                picks = qkernel.GreedyPicks([bias if s.num_tokens == 1 else None
                                             for s, bias in zip(segments, greedy) for _ in range(s.num_tokens)])
            x = self.decode_layers(x, rows, *self.rope_tables[0], logits, picks)
            self._step_logits = None if logits is None else (x, logits)
            self._step_picks = None if picks is None else (x, picks.tokens())
        else:
            ropes = [self._rope_rows(segments, table) for table in self.rope_tables]  # cos, sin [T, head_dim] each
            # prompt rows only, never a decode step's or a verify window's (which must equal their
            # replay: the exact kernels): every session here adds more rows than a window may hold
            bf16 = (self.prefill_bf16 and rows is None and T >= BF16_PREFILL_MIN_ROWS
                    and all(s.num_tokens > WINDOW_ROWS_MAX for s in segments))
            for layer, block in enumerate(self.blocks):
                # attention: x + Wo · attn(rope(Wq·h), rope(Wk·h), Wv·h), each session over its own cache
                h = rms_norm(x, block.attn_norm, eps)
                qkv = block.wqkv(h, bf16=bf16).view(T, H + 2 * KVH, args.head_dim)
                if block.q_norm is not None:  # Qwen3, Gemma 3: each q and k head normed first
                    qkv = head_norms_(qkv, H, KVH, block.q_norm, block.k_norm, eps)
                qkv = apply_rope(qkv, H + KVH, *ropes[block.rope])  # q and k heads rotate in one go
                attn = attend_sessions(qkv, layer, segments, rows, self.scale, block.window)
                x = add_residual(block.wo, attn, x, block.post_attn_norm, eps, bf16)  # Gemma 3 norms Wo·attn first
                # feed-forward: x + W_down · (act(W_gate·h) * W_up·h), act silu (SwiGLU) or gelu_tanh (Gemma 3)
                h = rms_norm(x, block.ffn_norm, eps)
                x = gated_mlp(h, block.w_gate_up, block.w_down, self.activation, x, block.post_ffn_norm, eps, bf16)

        for s in segments:
            s.cache.commit(s.start + s.num_tokens)
        return x

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embedding, QuantizedTensor):
            return self.embedding.embed(ids)
        return self.embedding[ids].float()

    @staticmethod
    def _rope_rows(segments: list[Segment], table: tuple[torch.Tensor, torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin rows [T, head_dim] at the segments' positions: slices of
        the table, so a one-segment call builds no index tensor."""
        cos_table, sin_table = table
        if len(segments) == 1:
            rows = slice(segments[0].start, segments[0].start + segments[0].num_tokens)
            return cos_table[rows], sin_table[rows]
        cos = torch.cat([cos_table[s.start : s.start + s.num_tokens] for s in segments])
        sin = torch.cat([sin_table[s.start : s.start + s.num_tokens] for s in segments])
        return cos, sin

    def step_picks(self, hidden: torch.Tensor) -> list[int | None] | None:
        """The greedy tokens the decode step that returned `hidden` picked (forward's
        `greedy`), one per row (None: not picked), or None when it picked none."""
        picks = self._step_picks
        return picks[1] if picks is not None and picks[0] is hidden else None

    @inference_mode
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, D] -> float32 logits [T, vocab] (last stage only)."""
        if not self.layers.is_last:
            raise RuntimeError(f"Stage {self.layers} has no output head; only the last stage computes logits")
        step = self._step_logits
        if step is not None and step[0] is hidden:  # the decode step's call computed them (forward)
            self._step_logits = None
            return step[1]
        logits = self.head(rms_norm(hidden, self.output_norm, self.args.rms_norm_eps)).float()  # no copy if float32
        cap = self.args.final_logit_softcapping
        if cap:  # Gemma: logits squashed into (-cap, cap)
            logits = torch.tanh(logits / cap) * cap
        return logits

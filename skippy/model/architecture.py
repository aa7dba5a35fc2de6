"""What each supported architecture changes in the one forward pass of llama.py.

An `Architecture` is data, not code: which extra tensors a block has and how the
forward treats them. StageModel reads these traits once, when it builds its blocks,
so a step pays no per-call check for a trait its model lacks. Hyperparameters (sizes,
RoPE bases, the sliding window and which layers use it) live in ModelArgs, read from
GGUF metadata (gguf_loader.py) or a config.json (hf_loader.py).

                 q/k/v bias  q/k norm  post-norms  MLP gate  embedding   GGUF q/k rows
    llama           -           -          -         SiLU       x 1       permuted
    mistral         -           -          -         SiLU       x 1       (a llama GGUF)
    qwen2         yes           -          -         SiLU       x 1       as HF's
    qwen3           -         yes          -         SiLU       x 1       as HF's
    gemma3          -         yes        yes         GELU-tanh  x sqrt(D) as HF's

Sliding-window attention (Mistral where its config sets a window; Gemma 3's local
layers) is a per-layer hyperparameter, not a trait: every architecture may carry one.
"""

from __future__ import annotations

from dataclasses import dataclass

# The tensors every block has, by their GGUF names (blk.N.<name>.weight).
BASE_BLOCK_TENSORS = (
    "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
    "ffn_norm", "ffn_gate", "ffn_up", "ffn_down",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Architecture:
    name: str  # GGUF general.architecture (mistral: the Hugging Face model_type; its GGUFs say llama)
    qkv_bias: bool = False  # q, k, v projections add a bias (Qwen2)
    qk_norm: bool = False  # each q and k head is RMS-normed before RoPE (Qwen3, Gemma 3)
    post_norms: bool = False  # attention and MLP outputs are RMS-normed before the residual add (Gemma 3)
    activation: str = "silu"  # the MLP gate's: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    scales_embedding: bool = False  # token embeddings times sqrt(hidden_size) (Gemma)
    # Hugging Face stores Gemma's norm weights as w and multiplies by (1 + w);
    # llama.cpp's converter writes 1 + w into the GGUF, so the forward always multiplies by the weight.
    hf_norm_offset: float = 0.0
    # llama.cpp's converter interleaves the rows of attn_q/attn_k for its rotate-pairs RoPE
    # (llama only: the others run its NeoX RoPE, which rotates halves as Hugging Face does).
    gguf_permutes_qk: bool = False
    # llama.cpp's sliding-window layer pattern for this architecture, with a window set:
    # 0 every layer slides; n: layer i slides unless i % n == n - 1 (llama_hparams::set_swa_pattern).
    gguf_swa_pattern: int = 0
    # The RoPE base of sliding-window layers when the GGUF does not say (rope.freq_base_swa);
    # None: they share the global layers' RoPE.
    gguf_swa_rope_base: float | None = None
    ties_embeddings_by_default: bool = False  # a config.json without tie_word_embeddings (Gemma: tied)

    @property
    def block_tensors(self) -> tuple[str, ...]:
        """Every tensor a block holds, as GGUF names after blk.N.: `attn_q.weight`, `attn_q.bias`..."""
        names = [f"{t}.weight" for t in BASE_BLOCK_TENSORS]
        if self.qkv_bias:
            names += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
        if self.qk_norm:
            names += ["attn_q_norm.weight", "attn_k_norm.weight"]
        if self.post_norms:
            names += ["post_attention_norm.weight", "post_ffw_norm.weight"]
        return tuple(names)


LLAMA = Architecture("llama", gguf_permutes_qk=True)
MISTRAL = Architecture("mistral", gguf_permutes_qk=True)
QWEN2 = Architecture("qwen2", qkv_bias=True)
QWEN3 = Architecture("qwen3", qk_norm=True)
GEMMA3 = Architecture("gemma3", qk_norm=True, post_norms=True, activation="gelu_tanh", scales_embedding=True,
                      hf_norm_offset=1.0, gguf_swa_pattern=6, gguf_swa_rope_base=10_000.0,
                      ties_embeddings_by_default=True)  # fmt: skip

ARCHITECTURES = {a.name: a for a in (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA3)}
GGUF_ARCHITECTURES = {"llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3, "gemma3": GEMMA3}  # general.architecture
HF_MODEL_TYPES = {"llama": LLAMA, "mistral": MISTRAL, "qwen2": QWEN2, "qwen3": QWEN3, "gemma3_text": GEMMA3}


def unsupported(what: str, got: object, supported: dict[str, Architecture]) -> str:
    """The error text for a model of another architecture: what it is, and what we run."""
    return (f"Unsupported architecture: {what}={got!r}. skippy supports: {', '.join(supported)}. "
            f"Fix: pass a model of one of these architectures.")

"""Model hyperparameters and the slice of layers one stage owns."""

from __future__ import annotations

from dataclasses import dataclass

from .architecture import ARCHITECTURES, Architecture


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """Hyperparameters, read from GGUF metadata or a config.json; `architecture` names the
    traits (architecture.py) that say what the forward does with them."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rms_norm_eps: float
    rope_theta: float
    # What each RoPE frequency is divided by ([head_dim / 2]): linear scaling's factor
    # everywhere, or Llama 3's per-frequency factors (llama.cpp's rope_freqs tensor); None: 1.
    rope_freq_factors: tuple[float, ...] | None = None
    tie_word_embeddings: bool = False
    architecture: str = "llama"
    sliding_window: int | None = None  # keys a sliding-window layer's query sees, itself included
    sliding_layers: tuple[int, ...] = ()  # the layers that use it (Gemma 3: 5 of every 6)
    sliding_rope_theta: float | None = None  # their RoPE base, unscaled (Gemma 3); None: the global RoPE
    query_pre_attn_scalar: float | None = None  # scores scale by its -1/2 power; None: head_dim's
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap) (Gemma)

    @property
    def arch(self) -> Architecture:
        return ARCHITECTURES[self.architecture]

    def window_of(self, layer: int) -> int:
        """Keys a query of `layer` sees (0: all before it)."""
        return self.sliding_window if self.sliding_window and layer in self.sliding_layers else 0

    @property
    def head_cost_in_layers(self) -> float:
        """The output head's weights over one block's matmul weights: what the last
        stage reads per token on top of its layers (8.0 for SmolLM2-135M)."""
        attention = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        feed_forward = 3 * self.hidden_size * self.intermediate_size
        return self.vocab_size * self.hidden_size / (attention + feed_forward)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"Expected an architecture in {sorted(ARCHITECTURES)}, got {self.architecture!r}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(f"Expected {self.head_dim // 2} RoPE frequency factors, got {len(self.rope_freq_factors)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"Expected num_heads divisible by num_kv_heads, got {self.num_heads} and {self.num_kv_heads}"
            )


@dataclass(frozen=True, slots=True)
class LayerRange:
    """The half-open range [start, end) of transformer blocks a stage computes."""

    start: int
    end: int
    num_layers: int  # of the whole model

    def __post_init__(self) -> None:
        if not (0 <= self.start < self.end <= self.num_layers):
            raise ValueError(
                f"Expected a layer range inside [0, {self.num_layers}) with start < end, "
                f"got [{self.start}, {self.end}). Fix: pick start/end within the model's {self.num_layers} layers."
            )

    @classmethod
    def full(cls, num_layers: int) -> "LayerRange":
        return cls(0, num_layers, num_layers)

    @property
    def is_first(self) -> bool:
        """The first stage owns the token embedding."""
        return self.start == 0

    @property
    def is_last(self) -> bool:
        """The last stage owns the output norm and head."""
        return self.end == self.num_layers

    @property
    def num_local_layers(self) -> int:
        return self.end - self.start

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"

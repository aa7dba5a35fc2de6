"""Model hyperparameters and the slice of layers one stage owns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """Llama-family hyperparameters, read from GGUF metadata or a config.json."""

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
    rope_scaling: dict | None = None  # Hugging Face style: {"rope_type": "llama3", "factor": ...}
    tie_word_embeddings: bool = False

    @property
    def head_cost_in_layers(self) -> float:
        """The output head's weights over one block's matmul weights: what the last
        stage reads per token on top of its layers (8.0 for SmolLM2-135M)."""
        attention = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        feed_forward = 3 * self.hidden_size * self.intermediate_size
        return self.vocab_size * self.hidden_size / (attention + feed_forward)

    def __post_init__(self) -> None:
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

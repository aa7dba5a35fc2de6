"""Per-request sampling settings: they travel with ConfigureGeneration (spec §2.3)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .constants import MAX_GRAMMAR_BYTES, GrammarKind
from .logprobs import MAX_TOP_LOGPROBS


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What the output must match (constrained decoding): the final stage masks every
    token the grammar does not allow, and compiles `text` itself (model/grammar.py).

    `text` is the JSON Schema for JSON_SCHEMA, exactly as the client sent it (it keys
    each stage's compile cache), the lark grammar for LARK, and empty for JSON_OBJECT.
    """

    kind: GrammarKind
    text: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", GrammarKind(self.kind))
        if (self.kind != GrammarKind.JSON_OBJECT) != bool(self.text):
            raise ValueError(f"Expected grammar text exactly for {GrammarKind.JSON_SCHEMA.name} and "
                             f"{GrammarKind.LARK.name}, got "
                             f"{len(self.text)} characters for {self.kind.name}")
        if len(self.text.encode("utf-8")) > MAX_GRAMMAR_BYTES:
            raise ValueError(f"Expected a grammar of at most {MAX_GRAMMAR_BYTES} bytes, got "
                             f"{len(self.text.encode('utf-8'))}")


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    """How the final stage turns logits into a token.

    temperature == 0 (or top_k == 1) means greedy. Penalties follow llama.cpp and
    the OpenAI API: repetition_penalty divides positive logits (multiplies negative
    ones) of tokens seen in the last `penalty_last_n` tokens of the history; presence
    and frequency penalties subtract `presence + frequency * count`.
    """

    temperature: float = 0.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64  # -1 = whole history
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    grammar: GrammarSpec | None = None  # None: any token may follow
    # None: no logprobs (nobody pays for them); n: every sampled token's logprob and the
    # row's n most likely (token, logprob) pairs
    logprobs: int | None = None
    prompt_logprobs: bool = False  # also every prompt token's (echo): the head runs on every prompt row

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise ValueError(f"Expected temperature >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"Expected top_k >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"Expected 0 < top_p <= 1, got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"Expected 0 <= min_p <= 1, got {self.min_p}")
        if not (self.repetition_penalty > 0.0):
            raise ValueError(f"Expected repetition_penalty > 0, got {self.repetition_penalty}")
        if self.penalty_last_n < -1:
            raise ValueError(f"Expected penalty_last_n >= -1, got {self.penalty_last_n}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"Expected logprobs None or in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs and self.logprobs is None:
            raise ValueError("Expected a logprobs count with prompt_logprobs, got None")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

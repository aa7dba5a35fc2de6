"""One sampled (or prompt) token's log-probability and the row's most likely alternatives.

The final stage computes them from the model's raw logits (docs/architecture.md,
"Logprobs") and returns them with the token; they travel in a reply's logprob block
(docs/protocol.md §3.6). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_TOP_LOGPROBS = 20  # OpenAI's ceiling for chat `top_logprobs` (completions allow 5)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """`token`'s log-probability at its row, and the row's `top` (token id, logprob) pairs,
    most likely first (as many as the request's top count asked for)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

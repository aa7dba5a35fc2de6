"""Logits -> token ids on the final stage: bias, penalties, filters, a seeded draw.

The order matches llama.cpp's default sampler chain (common/common.h):
logit_bias -> penalties -> top_k -> top_p -> min_p -> temperature -> draw.
Temperature comes *after* the filters there, so the set of allowed tokens never
depends on the temperature; only their relative odds do.
"""

from __future__ import annotations

import math
import secrets
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from skippy.protocol.logprobs import TokenLogprob
from skippy.protocol.sampling_config import SamplingConfig

from .errors import RequestError

if TYPE_CHECKING:
    from .grammar import GrammarState


def greedy(logits: Tensor) -> int | list[int]:
    """Argmax over the vocab: an int for [V], one int per row for [N, V] (the first of
    equal maxima, and a NaN counts as the maximum, in torch and numpy alike)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        # torch's CPU argmax over a 49,152-token row took 45-100 us (a parallel reduction
        # for 2 threads), numpy's 4: 1-2% of a decode step
        values = logits.numpy()
        return int(values.argmax()) if values.ndim == 1 else values.argmax(axis=-1).tolist()
    if logits.dim() == 1:
        return int(logits.argmax())
    return logits.argmax(dim=-1).tolist()


def token_logprobs(logits: Tensor, tokens: Sequence[int], num_top: int) -> list[TokenLogprob]:
    """Each row's log-softmax at its token, and its `num_top` most likely (token, logprob).

    From the raw logits of [N, V] (one row per token): the model's distribution, before
    bias, penalties, a grammar's mask and temperature (docs/architecture.md, "Logprobs").
    """
    if logits.dim() != 2 or logits.shape[0] != len(tokens):
        raise ValueError(f"Expected [{len(tokens)}, V] logits, got {tuple(logits.shape)}")
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(tokens), dtype=torch.long, device=logits.device)
    chosen = log_probs.gather(1, ids[:, None])[:, 0].tolist()
    if num_top:
        values, top_ids = log_probs.topk(num_top, dim=-1)  # sorted, most likely first
        tops = [tuple(zip(row_ids, row_values))
                for row_ids, row_values in zip(top_ids.tolist(), values.tolist())]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(int(token), value, top) for token, value, top in zip(tokens, chosen, tops)]


def penalty_window(history: Sequence[int], last_n: int) -> list[int]:
    """The tokens penalties look at: the last `last_n` of history (-1 = all, 0 = none)."""
    if last_n == 0:
        return []
    if last_n == -1:
        return list(history)
    return list(history[-last_n:])


def apply_penalties(
    logits: Tensor,
    window: Sequence[int],
    *,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
) -> Tensor:
    """Penalise the [V] logits of tokens in `window`; returns a new tensor.

    Matches llama.cpp's penalties sampler: a seen token's logit is divided by
    `repetition_penalty` when positive and multiplied when not, then
    `frequency_penalty * count + presence_penalty` is subtracted (OpenAI semantics).
    """
    if not window:
        return logits
    num_vocab = logits.shape[-1]
    counts = Counter(window)
    # Counting in Python keeps the device free of a sync (torch.unique would add one).
    bad = [t for t in counts if not 0 <= t < num_vocab]
    if bad:
        raise ValueError(f"Expected history token ids in [0, {num_vocab}), got {bad[0]}")
    ids = torch.tensor(list(counts), device=logits.device)
    num_seen = torch.tensor(list(counts.values()), device=logits.device, dtype=logits.dtype)
    seen = logits[ids]
    seen = torch.where(seen > 0, seen / repetition_penalty, seen * repetition_penalty)
    seen = seen - frequency_penalty * num_seen - presence_penalty
    return logits.index_put((ids,), seen)


def filter_logits(logits: Tensor, *, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> Tensor:
    """Set [V] logits outside top_k, then top_p, then min_p to -inf; returns a new tensor.

    top_p keeps the smallest most-likely prefix whose probability reaches top_p
    (renormalised over what top_k left); min_p keeps tokens whose probability is
    at least min_p times the most likely one's.
    """
    num_vocab = logits.shape[-1]
    if 0 < top_k < num_vocab:
        values, ids = logits.topk(top_k)
        log_total = values.logsumexp(dim=-1)
    elif top_p < 1.0:
        log_total = logits.logsumexp(dim=-1)
        values, ids = _nucleus_head(logits, log_total, top_p)
    else:
        return _min_p(logits, min_p)
    # values, ids: [K], most likely first
    if top_p < 1.0:
        probs = (values - log_total).exp()
        # Keep token i while the mass *before* it is short of top_p, so the token
        # that crosses top_p stays in, as in llama.cpp.
        is_kept = (probs.cumsum(dim=-1) - probs) < top_p
        values = values.masked_fill(~is_kept, -math.inf)
    values = _min_p(values, min_p)
    return torch.full_like(logits, -math.inf).scatter(0, ids, values)


def _nucleus_head(
    logits: Tensor, log_total: Tensor, top_p: float, head_k: int = 256
) -> tuple[Tensor, Tensor]:
    """The best logits, most likely first: enough of them to hold the top_p nucleus.

    Sorting the whole vocab costs ~30x a topk of 256 on CPU, and a model's next-token
    distribution almost always puts top_p of its mass in fewer tokens than that.
    """
    if head_k < logits.shape[-1]:
        values, ids = logits.topk(head_k)
        # Every token past the head has at least the head's mass before it, so
        # once that reaches top_p the head holds the whole nucleus.
        if float((values - log_total).exp().sum()) >= top_p:
            return values, ids
    return logits.sort(descending=True)


def draw_token(probs: Tensor, u: float) -> int:
    """One token from [V] probabilities (need not sum to 1), by inverse CDF at the uniform
    `u` in [0, 1) (one per draw, like llama.cpp's dist sampler; torch.multinomial costs ~5x
    more on CPU). float64 keeps the running sum exact enough over 49k tokens."""
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[-1:]
    if not float(total) > 0.0:  # also catches NaN
        raise RequestError(f"Expected some token with probability > 0, got total {float(total)}; "
                           "did logit_bias (and the grammar) ban every token?")
    token = torch.searchsorted(cdf, total * u, right=True)
    # u * total can round up to total; never step past the last token with p > 0.
    last_possible = torch.searchsorted(cdf, total)
    return int(torch.minimum(token, last_possible))


class Draws:
    """A request's uniforms, one per sampled row, derivable from (seed, index) without
    making the ones before: draw i is the i-th 64-bit output of PCG64(seed), its top 53 bits
    as a double in [0, 1) (numpy's `random()`). A replayed request skips the draws its
    earlier session made (ConfigureGeneration's decode_step, a peer's i32, up to 2^31 - 1)
    with PCG64's jump-ahead, in O(log n) time and no memory, where making them would hold the
    runtime's worker and ask for 8 bytes a draw (torch's Mersenne Twister has no jump;
    docs/decisions.md)."""

    __slots__ = ("_bits",)

    def __init__(self, seed: int) -> None:
        self._bits = np.random.PCG64(seed & (2**64 - 1))  # an i64 seed, as its u64 pattern

    def skip(self, num_draws: int) -> None:
        if num_draws > 0:
            self._bits.advance(num_draws)

    def next(self) -> float:
        return (self._bits.random_raw() >> 11) * 2.0**-53


def _min_p(logits: Tensor, min_p: float) -> Tensor:
    if min_p <= 0.0:
        return logits
    # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); no softmax needed.
    return logits.masked_fill(logits < logits.max() + math.log(min_p), -math.inf)


class RequestSampler:
    """One request's sampler, with its own stream of draws (Draws).

    The private stream means concurrent requests never consume each other's
    random numbers: a seeded request gives the same tokens however it is batched
    or interleaved with others.
    """

    def __init__(self, config: SamplingConfig, device: torch.device | str = "cpu",
                 grammar: GrammarState | None = None, vocab_size: int | None = None) -> None:
        """`grammar`: the request's grammar state (GrammarCompiler.state), exactly when
        `config.grammar` is set: every row is then masked to the tokens it allows.
        `vocab_size`: the head's width, when known here: a logit_bias id past it is refused
        now, when the request is configured, not in the middle of a batched step."""
        if (config.grammar is None) != (grammar is None):
            raise ValueError(f"Expected a grammar state exactly when the config has a grammar, got "
                             f"{config.grammar!r} and {grammar!r}")
        self.config = config
        self.grammar = grammar
        self.device = _resolve(torch.device(device))
        bad = [t for t in config.logit_bias if t < 0]
        if bad:
            raise RequestError(f"Expected logit_bias token ids >= 0, got {bad[0]}")
        self._max_bias_id = max(config.logit_bias, default=-1)
        if vocab_size is not None and self._max_bias_id >= vocab_size:
            raise RequestError(f"Expected logit_bias token ids < {vocab_size} (the vocabulary), "
                               f"got {self._max_bias_id}")
        # A random seed is still recorded, so a run can be replayed from the logs.
        self.seed = config.seed if config.seed is not None else secrets.randbits(63)
        self._draws = Draws(self.seed)
        self._bias_ids = torch.tensor(list(config.logit_bias), dtype=torch.long, device=self.device)
        self._bias_values = torch.tensor(
            list(config.logit_bias.values()), dtype=torch.float32, device=self.device
        )

    @property
    def uses_history(self) -> bool:
        """Whether `sample` reads its `history` (penalties, a grammar): building it walks the
        whole context, which a plain request need not pay on every token."""
        return self.grammar is not None or self.config.has_penalties

    def greedy_bias(self, vocab: int) -> tuple[list[int], list[float]] | None:
        """When a pick is the first argmax of logits + logit_bias (greedy: no penalties, no
        grammar), the bias as (token ids, values), for a kernel that picks as it writes the
        logits (qkernel.GreedyPicks); else None, and `sample` picks."""
        cfg = self.config
        if not cfg.is_greedy or cfg.has_penalties or self.grammar is not None or self._max_bias_id >= vocab:
            return None
        return list(cfg.logit_bias), list(cfg.logit_bias.values())

    def skip_draws(self, num_draws: int) -> None:
        """Skip `num_draws` draws (one uniform each, see draw_token) in constant time and
        memory (Draws): a request replayed onto a fresh chain continues its seeded stream
        where it was cut."""
        self._draws.skip(num_draws)

    def sample(
        self,
        logits: Tensor,
        history: Sequence[int],
        row_tokens: Sequence[int] | None = None,
    ) -> int | list[int]:
        """Pick the next token for [V] logits (-> int) or each row of [N, V] (-> list).

        `history` is every token the request has seen so far (prompt and output),
        ending with the token whose logits these are (row 0's input); it is not read
        unless `uses_history`.

        For [N, V] (a VerifyWindow with input tokens [c, d1, ..., d(N-1)]),
        `row_tokens` must be the drafts d1..d(N-1): the input tokens of rows 1..N-1.
        Row i is sampled as if history were `history + row_tokens[:i]`, so penalties
        (and a grammar) see the drafts the model saw, and rows draw from the stream
        in order, which gives the same tokens as N one-row calls.
        """
        if not _same_device(logits.device, self.device):
            raise ValueError(f"Expected logits on {self.device}, got {logits.device}")
        if logits.dim() not in (1, 2):
            raise ValueError(f"Expected logits of shape [V] or [N, V], got {tuple(logits.shape)}")
        num_rows = 1 if logits.dim() == 1 else logits.shape[0]
        row_tokens = [] if row_tokens is None else list(row_tokens)
        if len(row_tokens) != num_rows - 1:
            raise ValueError(f"Expected {num_rows - 1} row_tokens for {num_rows} rows, got {len(row_tokens)}")
        if self._max_bias_id >= logits.shape[-1]:
            raise RequestError(f"Expected logit_bias token ids < {logits.shape[-1]}, got {self._max_bias_id}")

        cfg = self.config
        if self.grammar is not None:  # before the filters: top_k, top_p and min_p keep allowed tokens only
            allowed = self.grammar.allowed(list(history), row_tokens, logits.shape[-1], logits.device)
            logits = torch.where(allowed[0] if logits.dim() == 1 else allowed, logits, -math.inf)
        if cfg.is_greedy and not cfg.has_penalties and not cfg.logit_bias:
            return greedy(logits)  # the common fast path: one argmax, one sync
        last_n = cfg.penalty_last_n
        window = penalty_window(history, last_n) if cfg.has_penalties else []
        if logits.dim() == 1:
            return self._sample_row(logits, window)
        return [self._sample_row(logits[i], penalty_window([*window, *row_tokens[:i]], last_n))
                for i in range(num_rows)]

    def _sample_row(self, logits: Tensor, window: list[int]) -> int:
        cfg = self.config
        logits = logits.float()
        if cfg.logit_bias:
            logits = logits.index_add(0, self._bias_ids, self._bias_values)
        if cfg.has_penalties:
            logits = apply_penalties(
                logits,
                window,
                repetition_penalty=cfg.repetition_penalty,
                presence_penalty=cfg.presence_penalty,
                frequency_penalty=cfg.frequency_penalty,
            )
        if cfg.is_greedy:
            token = greedy(logits)
            if logits[token] == -math.inf:
                raise RequestError("Expected some token the sampling settings allow, got none: logit_bias "
                                   "and the grammar ban every token")
            return token
        u = self._draws.next()  # one per sampled row, whatever happens next (the stream's count)
        probs = torch.softmax(filter_logits(logits, top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p)
                              / cfg.temperature, dim=-1)
        try:
            return draw_token(probs, u)
        except RequestError:
            forced = _forced(logits)
            if forced is None:
                raise
        return draw_token(forced, u)


def _forced(logits: Tensor) -> Tensor | None:
    """[V] probabilities uniform over the +inf logits (a +inf logit_bias forces its token,
    docs/protocol.md §3.4: among several, each is as likely), or None when there are none
    or a logit is NaN (the row's activations overflowed: RequestError, that request fails).
    Only after the softmax found no finite total, so an ordinary row never pays for it."""
    if bool(logits.isnan().any()):
        raise RequestError("Expected finite logits, got NaN (the row's activations overflowed, or a "
                           "+inf logit_bias fell on a token its grammar excludes)")
    forced = logits == math.inf
    return forced.double() if bool(forced.any()) else None


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _resolve(device: torch.device) -> torch.device:
    # "cuda" and "cuda:0" must compare equal to the logits' device later.
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device

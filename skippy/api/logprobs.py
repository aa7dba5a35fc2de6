"""Logprob entries from the backend -> OpenAI's two response shapes.

    chat          choices[i].logprobs.content[]: {token, logprob, bytes, top_logprobs: [...]}
    completions   choices[i].logprobs: {tokens, token_logprobs, top_logprobs, text_offset}

Here the final stage's values only get their token strings: a token's decoded text alone,
so one holding part of a UTF-8 character reads as U+FFFD (its `bytes` too).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..model.tokenizer import Tokenizer
from ..protocol.logprobs import TokenLogprob
from .schemas import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

MIN_LOGPROB = -9999.0  # as OpenAI: JSON has no -inf, and nothing below this means anything


def _value(logprob: float) -> float:
    return max(float(logprob), MIN_LOGPROB)


class LogprobFormatter:
    """One request's formatter: token strings are cached, since top lists repeat tokens."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.text(token_id)
        return TopLogprob(token=text, logprob=_value(logprob), bytes=list(text.encode("utf-8")))

    def chat(self, entries: Sequence[TokenLogprob]) -> ChatLogprobs:
        content = []
        for entry in entries:
            top = [self._top(token, logprob) for token, logprob in entry.top]
            chosen = self._top(entry.token, entry.logprob)
            content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=top))
        return ChatLogprobs(content=content)

    def completion(self, entries: Sequence[TokenLogprob | None], token_ids: Sequence[int],
                   text_offset: int = 0) -> CompletionLogprobs:
        """`entries[i]` is token_ids[i]'s (None: the prompt's first token, which has no logprob);
        offsets count characters from `text_offset`, where the first token starts."""
        tokens, values, tops, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries, strict=True):
            text = self.text(token_id)
            tokens.append(text)
            offsets.append(text_offset)
            text_offset += len(text)
            if entry is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(_value(entry.logprob))
            # OpenAI's legacy shape: the most likely tokens, and the chosen one with them
            top = {self.text(token): _value(logprob) for token, logprob in entry.top}
            top.setdefault(text, _value(entry.logprob))
            tops.append(top)
        return CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)

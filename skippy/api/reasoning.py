"""Reasoning split: a thinking model's `<think>...</think>` block goes to `reasoning_content`,
the rest to `content`, whole or streamed.

    Reasoning.for_request(template, kwargs, effort)   None for a template that never thinks
    reasoning.template_variables()                    what the template reads (enable_thinking)
    reasoning.opens_in_thought(prompt)                the prompt ends inside <think> (R1 distills)
    ReasoningStream(starts_inside)                    text in -> (reasoning, content) out

A template thinks when it writes `<think>`; thinking is on unless the request turns it off
(`chat_template_kwargs: {"enable_thinking": false}`, vLLM's and Qwen3's switch, or
`reasoning_effort: "none"`), and the template decides what "off" renders.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<think>", "</think>"
RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


@dataclass(frozen=True, slots=True)
class Reasoning:
    enabled: bool
    variables: dict[str, Any]  # chat_template_kwargs, passed to the template

    @classmethod
    def for_request(cls, template: str | None, template_kwargs: Mapping[str, Any] | None,
                    effort: str | None) -> Reasoning | None:
        variables = dict(template_kwargs or {})
        if OPEN not in (template or ""):
            return cls(False, variables) if variables else None
        enabled = bool(variables.get("enable_thinking", True)) and effort != "none"
        variables["enable_thinking"] = enabled
        return cls(enabled, variables)

    @property
    def splits(self) -> bool:
        """Whether output is split at all (a template that thinks, even with thinking off:
        a model may think anyway, and its thought never belongs in content)."""
        return "enable_thinking" in self.variables

    @staticmethod
    def opens_in_thought(prompt: str) -> bool:
        """The generation prompt opened the think block, so the output starts in thought."""
        tail = prompt.rstrip()
        return tail.endswith(OPEN)

    def grammar_prefix(self, prompt: str) -> str:
        """A lark expression for the thought before an enforced tool call ("" for none): the
        block, optional when thinking is on and the prompt has not opened it."""
        thought = r'/([^<]|<[^\/])*/ "</think>" /[ \n]*/'
        if self.opens_in_thought(prompt):
            return thought
        if not self.enabled:
            return ""
        return f'("<think>" {thought})?'


class ReasoningStream:
    """Text pieces in; (reasoning, content) pieces out. A tag split across pieces is held
    back until it settles; the whitespace after `</think>` is dropped."""

    def __init__(self, starts_inside: bool):
        self._is_inside = starts_inside
        self._may_open = not starts_inside  # a block may open only at the reply's start
        self._after_close = False
        self._held = ""
        self.reasoning: list[str] = []

    def push(self, text: str, is_final: bool = False) -> tuple[str, str]:
        self._held += text
        reasoning, content = [], []
        while self._held:
            if self._may_open:
                stripped = self._held.lstrip()
                if stripped.startswith(OPEN):
                    self._held, self._is_inside, self._may_open = stripped[len(OPEN):], True, False
                    continue
                if OPEN.startswith(stripped) and not is_final:
                    break  # maybe the tag, still arriving
                self._may_open = False
            if self._is_inside:
                end = self._held.find(CLOSE)
                if end >= 0:
                    reasoning.append(self._held[:end])
                    self._held, self._is_inside, self._after_close = self._held[end + len(CLOSE):], False, True
                    continue
                hold = 0 if is_final else _partial(self._held, CLOSE)
                reasoning.append(self._held[:len(self._held) - hold])
                self._held = self._held[len(self._held) - hold:]
                break
            if self._after_close:
                self._held = self._held.lstrip()
                if not self._held:
                    break
                self._after_close = False
            content.append(self._held)
            self._held = ""
        self.reasoning.extend(reasoning)
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        return self.push("", is_final=True)


def _partial(text: str, tag: str) -> int:
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0

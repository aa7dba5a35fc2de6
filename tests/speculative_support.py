"""Speculative decoding on in-process chains: prompts, chains kept across a module, an oracle."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from chain_support import start_chain
from prefix_chain_support import LoopThread
from skippy.model.args import LayerRange
from skippy.model.llama import StageModel
from skippy.runtime.proposers import Proposer

NUM_TOKENS = 40
CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return round(subtotal + tax, 2)"""
TEXT = ("The history of the printing press begins in the fifteenth century, when movable type made "
        "books cheap enough for merchants, students and craftsmen to own.")
PROMPTS = {
    "copy": "Repeat the following code exactly, changing only the function name to order_total:\n\n"
            f"```python\n{CODE}\n```",
    "free": "Write a haiku about the sea.",
    "list": "List the days of the week, one per line, then the same list in reverse order.",
    "text": f"Repeat the following text exactly:\n\n{TEXT}",
    "fact": "What is the capital of France? Answer in one sentence.",
}


def encode_prompts(tokenizer) -> dict[str, list[int]]:
    return {name: tokenizer.encode_chat([{"role": "user", "content": text}])
            for name, text in PROMPTS.items()}


def small_draft(full_weights) -> StageModel:
    """A real draft that disagrees sometimes: the served model's first 4 layers and its head."""
    args, weights = full_weights
    return StageModel(dataclasses.replace(args, num_layers=4), LayerRange.full(4), weights,
                      torch.device("cpu"))


class Chains:
    """1-, 2- and 3-stage in-process chains on one background loop, started on first use."""

    def __init__(self, make_stage, **client_options):
        self.make_stage, self.client_options = make_stage, client_options
        self.loop = LoopThread()
        self.chains: dict[int, object] = {}

    def client(self, num_stages: int):
        if num_stages not in self.chains:
            self.chains[num_stages] = self.loop.run(start_chain(self.make_stage, num_stages,
                                                                ctx_size=2048, **self.client_options))
        return self.chains[num_stages].client

    def generate(self, num_stages: int, prompt: list[int], **options):
        return self.loop.run(self.client(num_stages).generate(prompt, **options))

    def close(self) -> None:
        for chain in self.chains.values():
            self.loop.run(chain.close())
        self.loop.close()


class Oracle(Proposer, name="test-oracle"):
    """Proposes a known continuation (corrupting every `wrong_every`-th draft), so windows are as
    long and as right as a test wants. Set `Oracle.prompt_len` and `Oracle.future` first."""

    prompt_len: int = 0
    future: list[int] = []
    wrong_every: int = 0

    def propose(self, max_tokens: int) -> list[int]:
        done = len(self.history) - self.prompt_len
        drafts = self.future[done:done + max_tokens]
        if self.wrong_every:
            drafts = [t + 1 if (done + i) % self.wrong_every == self.wrong_every - 1 else t
                      for i, t in enumerate(drafts)]
        return drafts


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Two shared cores: one torch thread per forward keeps multi-row windows fast.
    Autouse in the modules that import it."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)

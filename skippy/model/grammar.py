"""Constrained decoding: a request's grammar (JSON mode, a JSON Schema, a lark grammar) as a token mask.

The engine is llguidance (docs/decisions.md says why, with xgrammar measured beside it). A
`GrammarCompiler` belongs to one tokenizer and keeps an LRU of compiled grammars keyed
by their text; a `GrammarState` is one request's grammar on the stage that samples it.
The state follows the request's committed output (the session's token ledger, which
auto-align keeps authoritative), so it needs no message of its own: a rejected verify
row, a stale window or a replay onto a fresh session all come out right by re-reading
the ledger.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
import llguidance
import numpy as np
import torch

from ..protocol.constants import GrammarKind
from ..protocol.sampling_config import GrammarSpec
from .tokenizer import Tokenizer

log = logging.getLogger("skippy.model")

# One space after "," and ":" and no other whitespace. With free whitespace a small model
# can emit newlines until max_tokens (output that never closes); these separators are
# json.dumps's defaults, so the text stays close to the JSON a model has seen most.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # OpenAI's json_object mode: any JSON object
MAX_CACHED_GRAMMARS = 64


class GrammarError(ValueError):
    """A grammar the engine cannot compile (the API answers it with a 400)."""


class GrammarCompiler:
    """Grammars for one tokenizer: compiled once per text (an LRU), then a fresh state per request.

        grammars = GrammarCompiler.for_model(path)   # the tokenizer loads on first use
        grammars.check(spec)                         # GrammarError when it cannot compile
        state = grammars.state(spec, num_prompt_tokens)

    Thread-safe: stage 0's API compiles on a worker thread of its own while the runtime's
    worker builds states for ConfigureGeneration.
    """

    def __init__(self, tokenizer: Tokenizer | Callable[[], Tokenizer], *,
                 max_cached: int = MAX_CACHED_GRAMMARS):
        self._tokenizer = tokenizer
        self._max_cached = max_cached
        self._lock = threading.Lock()
        self._engine: llguidance.LLTokenizer | None = None
        self._stop_ids: frozenset[int] = frozenset()
        self._compiled: OrderedDict[tuple[GrammarKind, str], llguidance.LLMatcher] = OrderedDict()

    @classmethod
    def for_model(cls, path: str | Path) -> GrammarCompiler:
        """For the model at `path`; its tokenizer (and the engine's ~0.4 s vocabulary index)
        load on the first grammar, so a server that never sees one pays nothing."""
        return cls(lambda: Tokenizer.from_model(path))

    def check(self, spec: GrammarSpec) -> None:
        """Compile `spec` (or find it compiled); GrammarError says why it cannot be."""
        self._compile(spec)

    def state(self, spec: GrammarSpec, completion_start: int) -> GrammarState:
        """A fresh grammar state for one request whose output starts at history position
        `completion_start` (its prompt length)."""
        return GrammarState(self._compile(spec).deep_copy(), self._tokenizer_engine().vocab_size,
                            self._stop_ids, completion_start)

    def _tokenizer_engine(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._engine is None:
                tokenizer = self._tokenizer if isinstance(self._tokenizer, Tokenizer) else self._tokenizer()
                self._stop_ids = tokenizer.eog_ids
                # The end-of-generation ids are the engine's EOS: once the grammar is complete
                # they are the only tokens its mask allows.
                self._engine = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=tokenizer.vocab_size,
                                                      eos_token=sorted(self._stop_ids))
            return self._engine

    def _compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        key = (spec.kind, spec.text)
        with self._lock:
            matcher = self._compiled.get(key)
            if matcher is not None:
                self._compiled.move_to_end(key)
                return matcher
        engine = self._tokenizer_engine()
        if spec.kind == GrammarKind.LARK:
            try:
                grammar = llguidance.LLMatcher.grammar_from_lark(spec.text)
            except ValueError as error:
                raise GrammarError(f"Expected a valid lark grammar: {error}") from None
        else:
            grammar = _json_grammar(JSON_OBJECT_SCHEMA if spec.kind == GrammarKind.JSON_OBJECT else spec.text)
        # The constructor compiles (the lexer over the whole vocabulary) with the GIL released.
        matcher = llguidance.LLMatcher(engine, grammar, log_level=0)
        if matcher.is_error():
            what = "lark grammar" if spec.kind == GrammarKind.LARK else "JSON Schema"
            raise GrammarError(f"The {what} cannot be used for constrained decoding: {matcher.get_error()}")
        with self._lock:
            self._compiled[key] = matcher
            while len(self._compiled) > self._max_cached:
                self._compiled.popitem(last=False)
        return matcher


def _json_grammar(schema: str) -> str:
    try:
        if not isinstance(json.loads(schema), dict):
            raise GrammarError("Expected a JSON Schema object, got a JSON value of another type")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as error:  # json.JSONDecodeError included
        raise GrammarError(f"Expected a valid JSON Schema: {error}") from None


class GrammarState:
    """One request's grammar: the tokens each sampled row may take.

    The matcher holds the state after `tokens`, a prefix of the request's output. Before
    every sampling step it is brought to the step's committed output (the history up to
    row 0's input) by rolling back what the ledger no longer holds and consuming what is
    new. A verify window's row i is masked as if drafts d1..di were accepted; a draft the
    grammar rejects leaves the rows from it on unconstrained (their targets cannot be
    accepted: the row before already sampled a token the grammar allows, which differs
    from that draft, so acceptance ends there). The drafts are rolled back after the
    window, so they never advance the committed state.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, stop_ids: frozenset[int],
                 completion_start: int):
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._stop_ids = sorted(stop_ids)
        self.completion_start = completion_start
        self.tokens: list[int] = []  # the output tokens the matcher has consumed

    def allowed(self, history: list[int], drafts: list[int], width: int,
                device: torch.device | str = "cpu") -> torch.Tensor:
        """Bool [1 + len(drafts), width]: the tokens row i may take, after the committed
        `history` (prompt and output, ending with row 0's input) and drafts d1..di."""
        num_rows = 1 + len(drafts)
        words = (self._vocab_size + 31) // 32
        bits = np.zeros((num_rows, words), dtype=np.int32)  # llguidance's layout: bit j of word w = token 32w + j
        first_free = num_rows  # the rows from here on take any token (stage 0 accepts none of them)
        if not self._follow(history[self.completion_start:]):
            first_free = 0  # the history itself left the grammar: a stale run-ahead window
        num_drafts = 0
        for row in range(first_free):
            if row > 0:
                if self._matcher.try_consume_tokens([drafts[row - 1]]) != 1:
                    first_free = row  # the grammar rejects this row's draft: acceptance ends before it
                    break
                num_drafts += 1
            if not self._fill(bits[row]):
                first_free = row  # an empty mask: no token continues the grammar here
                break
        if num_drafts:
            self._matcher.rollback(num_drafts)
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little").view(np.bool_)
        allowed[first_free:] = True
        return torch.from_numpy(_fit(allowed, width)).to(device)

    def _follow(self, committed: list[int]) -> bool:
        """Bring the matcher to `committed`; False when it holds tokens the grammar rejects."""
        tokens = self.tokens
        num_kept = len(tokens)
        if committed[:num_kept] != tokens:  # the ledger was cut back: find where they part
            num_kept = 0
            while num_kept < min(len(tokens), len(committed)) and tokens[num_kept] == committed[num_kept]:
                num_kept += 1
            self._matcher.rollback(len(tokens) - num_kept)
            del tokens[num_kept:]
        new = committed[num_kept:]
        if not new:
            return True
        num_consumed = self._matcher.try_consume_tokens(new)  # a refused token leaves no error state
        tokens.extend(new[:num_consumed])
        return num_consumed == len(new)

    def _fill(self, row_bits: np.ndarray) -> bool:
        """The matcher's mask into `row_bits`; False when it allows nothing usable."""
        self._matcher.unsafe_compute_mask_ptr(row_bits.ctypes.data, row_bits.nbytes)
        if self._matcher.is_error():  # an engine limit hit mid-output: end it rather than run free
            log.warning("grammar engine error; allowing only end-of-generation: %s", self._matcher.get_error())
            words = row_bits.view(np.uint32)
            words[:] = 0
            for token in self._stop_ids:
                words[token // 32] |= np.uint32(1 << (token % 32))
        return bool(row_bits.any())


def _fit(allowed: np.ndarray, width: int) -> np.ndarray:
    """The mask cut or padded (with False: ids the tokenizer does not have) to `width` tokens."""
    if allowed.shape[1] >= width:
        return np.ascontiguousarray(allowed[:, :width])
    return np.pad(allowed, ((0, 0), (0, width - allowed.shape[1])), constant_values=False)

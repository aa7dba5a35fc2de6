"""The grammar state on the sampling stage (model/grammar.py): masks that follow the committed
output, verify windows (row i assumes drafts d1..di; a draft the grammar rejects ends the
window's acceptance and advances nothing), replay onto a fresh state, the end-of-generation
mask, and the compile cache. llguidance over SmolLM2's real vocabulary; no model."""

from __future__ import annotations

import json

import pytest
import torch

from skippy.model.grammar import GrammarCompiler, GrammarError
from skippy.model.sampling import RequestSampler
from skippy.protocol.constants import GrammarKind
from skippy.protocol.sampling_config import GrammarSpec, SamplingConfig
from skippy.runtime.speculation import accept_window

PROMPT = [1, 2, 3]  # the output starts after these history positions
ENUM = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({
    "type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
    "additionalProperties": False}))


@pytest.fixture(scope="module")
def grammars(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer)


@pytest.fixture(scope="module")
def doc(tokenizer):
    """The tokens of the two outputs ENUM allows, and of one it does not."""
    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    x, y, z = ids('{"a": "x"}'), ids('{"a": "y"}'), ids('{"a": "z"}')
    assert x[:4] == y[:4] == z[:4] and len(x) == len(z) == 6  # {" a ": ' "' then x|y|z '"}'
    return x, y, z


def allowed_ids(mask: torch.Tensor) -> set[int]:
    return set(mask.nonzero().flatten().tolist())


def test_each_row_allows_the_grammar_s_next_tokens(grammars, tokenizer, doc):
    x, y, _ = doc
    state = grammars.state(ENUM, len(PROMPT))
    width = tokenizer.vocab_size
    masks = state.allowed(PROMPT + x[:3], x[3:5], width)  # committed: '{"a":'; drafts ' "', 'x'
    assert masks.shape == (3, width)
    assert x[3] in allowed_ids(masks[0]) and x[4] not in allowed_ids(masks[0])
    assert {x[4], y[4]} <= allowed_ids(masks[1]) and doc[2][4] not in allowed_ids(masks[1])
    assert x[5] in allowed_ids(masks[2])
    assert state.tokens == x[:3]  # the drafts were rolled back: the committed state is untouched
    assert torch.equal(state.allowed(PROMPT + x[:3], [], width)[0], masks[0])


def test_a_draft_the_grammar_rejects_ends_acceptance_and_advances_nothing(grammars, tokenizer, doc):
    x, _, z = doc
    state = grammars.state(ENUM, len(PROMPT))
    drafts = z[4:6]  # 'z' (rejected), then '"}'
    masks = state.allowed(PROMPT + x[:4], drafts, tokenizer.vocab_size)
    assert z[4] not in allowed_ids(masks[0])
    assert bool(masks[1].all()) and bool(masks[2].all())  # rows after the rejection: unconstrained
    assert state.tokens == x[:4]
    # The target model wants the rejected draft most at row 0; the grammar makes row 0 pick the
    # best allowed token instead, so the window accepts no draft and row 0's token is the correction.
    logits = torch.zeros(3, tokenizer.vocab_size)
    logits[0, z[4]], logits[0, x[4]] = 10.0, 5.0
    logits[1, z[5]] = logits[2, 0] = 10.0
    sampler = RequestSampler(SamplingConfig(grammar=ENUM), grammar=state)
    targets = sampler.sample(logits, PROMPT + x[:4], row_tokens=drafts)
    assert targets[0] == x[4]
    assert accept_window(drafts, targets) == (0, [x[4]])
    assert state.tokens == x[:4]
    assert torch.equal(state.allowed(PROMPT + x[:4], [], tokenizer.vocab_size)[0], masks[0])


def test_a_sampled_window_commits_like_one_row_steps(grammars, tokenizer, doc):
    """The masks a window's rows get equal those of one-row steps over the same tokens, so
    greedy output with speculation on is the same as with it off."""
    x, _, _ = doc
    width = tokenizer.vocab_size
    windowed = grammars.state(ENUM, len(PROMPT)).allowed(PROMPT + x[:1], x[1:5], width)
    stepper = grammars.state(ENUM, len(PROMPT))
    stepped = torch.stack([stepper.allowed(PROMPT + x[:i + 1], [], width)[0] for i in range(5)])
    assert torch.equal(windowed, stepped)


def test_the_state_follows_a_ledger_cut_back_and_a_replay(grammars, tokenizer, doc):
    x, y, _ = doc
    width = tokenizer.vocab_size
    state = grammars.state(ENUM, len(PROMPT))
    state.allowed(PROMPT + x[:5], [], width)
    assert state.tokens == x[:5]
    # auto-align cut the session back to '{"a": "' and it went on with 'y'
    after_cut = state.allowed(PROMPT + y[:5], [], width)
    assert state.tokens == y[:5]
    # a request replayed onto a fresh session: a new state over the same committed tokens
    replayed = grammars.state(ENUM, len(PROMPT)).allowed(PROMPT + y[:5], [], width)
    assert torch.equal(after_cut, replayed)


def test_a_history_outside_the_grammar_leaves_the_rows_free(grammars, tokenizer, doc):
    # a run-ahead window behind one whose draft the grammar rejected: stage 0 discards it
    x, _, z = doc
    state = grammars.state(ENUM, len(PROMPT))
    masks = state.allowed(PROMPT + z[:5], [z[5]], tokenizer.vocab_size)
    assert bool(masks.all())
    assert state.tokens == x[:4]  # everything up to the token the grammar refused
    assert allowed_ids(state.allowed(PROMPT + x[:5], [], tokenizer.vocab_size)[0]) == {x[5]}


def test_a_complete_output_allows_only_the_end_of_generation_ids(grammars, tokenizer, doc):
    x, _, _ = doc
    state = grammars.state(ENUM, len(PROMPT))
    masks = state.allowed(PROMPT + x, [2], tokenizer.vocab_size)  # then a draft <|im_end|>
    assert allowed_ids(masks[0]) == set(tokenizer.eog_ids)
    assert bool(masks[1].all())  # nothing may follow the end: the row after it is left free


def test_masks_fit_the_logits_width(grammars, tokenizer, doc):
    x, _, _ = doc
    state = grammars.state(ENUM, len(PROMPT))
    wide = state.allowed(PROMPT + x, [], tokenizer.vocab_size + 64)  # a head padded past the vocabulary
    assert wide.shape == (1, tokenizer.vocab_size + 64) and not wide[0, tokenizer.vocab_size:].any()
    assert state.allowed(PROMPT + x, [], 16).shape == (1, 16)


def test_seeded_sampling_stays_inside_the_grammar(grammars, tokenizer):
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"type": "integer", "minimum": 10, "maximum": 99}))
    sampler = RequestSampler(SamplingConfig(temperature=1.0, seed=3, grammar=spec),
                             grammar=grammars.state(spec, 0))
    history: list[int] = []
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        token = sampler.sample(torch.randn(tokenizer.vocab_size, generator=generator), history)
        if token in tokenizer.eog_ids:
            break
        history.append(token)
    assert 10 <= int(tokenizer.decode(history)) <= 99


KNOBS = [
    # (sampling settings next to the grammar, one line each)
    dict(temperature=0.0, logit_bias={106: 100.0}),                       # greedy, a banned token pushed up
    dict(temperature=0.8, top_k=5, seed=1),                               # top_k over the allowed tokens
    dict(temperature=1.2, top_p=0.9, min_p=0.05, seed=2),                 # nucleus and min_p
    dict(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.5,  # penalties see the drafts
         presence_penalty=0.4, seed=3, logit_bias={106: 100.0}),
]


@pytest.mark.parametrize("knobs", KNOBS, ids=["greedy+bias", "top_k", "top_p+min_p", "penalties"])
def test_every_sampler_setting_picks_allowed_tokens(grammars, tokenizer, doc, knobs):
    x, _, z = doc  # token 106 is 'z', which the grammar never allows
    config = SamplingConfig(grammar=ENUM, **knobs)
    generator = torch.Generator().manual_seed(5)
    for _ in range(5):
        state = grammars.state(ENUM, len(PROMPT))
        sampler = RequestSampler(config, grammar=state)
        logits = torch.randn(3, tokenizer.vocab_size, generator=generator)
        history = PROMPT + x[:3]
        targets = sampler.sample(logits, history, row_tokens=x[3:5])
        masks = grammars.state(ENUM, len(PROMPT)).allowed(history, x[3:5], tokenizer.vocab_size)
        assert all(bool(masks[row, token]) for row, token in enumerate(targets)), targets
        assert z[4] not in targets


def test_the_sampler_needs_a_state_exactly_with_a_grammar(grammars):
    with pytest.raises(ValueError, match="grammar state"):
        RequestSampler(SamplingConfig(grammar=ENUM))
    with pytest.raises(ValueError, match="grammar state"):
        RequestSampler(SamplingConfig(), grammar=grammars.state(ENUM, 0))


def test_compiles_once_per_text_in_a_bounded_cache(tokenizer):
    grammars = GrammarCompiler(tokenizer, max_cached=2)
    specs = [GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"type": "integer", "maximum": n}))
             for n in range(3)]
    first = grammars._compile(specs[0])
    assert grammars._compile(specs[0]) is first  # cached, keyed by the text
    grammars.check(specs[1])
    grammars.check(specs[2])  # evicts specs[0], the least recently used
    assert grammars._compile(specs[0]) is not first
    assert grammars.state(GrammarSpec(GrammarKind.JSON_OBJECT), 0) is not None


UNUSABLE = [
    # (schema text, message fragment)
    ('{"type": "strin"}', "Invalid type"),                                    # no such type
    ('{"type": "string", "pattern": "(?<=a)b"}', "look-around"),              # regex the engine lacks
    ('{"properties": {"a": {"$ref": "#/nope"}}}', "does not exist"),          # a dangling $ref
    ("[1, 2]", "JSON Schema object"),                                          # not an object
    ("{not json", "valid JSON Schema"),                                        # not JSON
]


@pytest.mark.parametrize("text, fragment", UNUSABLE, ids=[row[1] for row in UNUSABLE])
def test_a_schema_the_engine_cannot_handle_is_a_grammar_error(grammars, text, fragment):
    with pytest.raises(GrammarError, match=fragment):
        grammars.check(GrammarSpec(GrammarKind.JSON_SCHEMA, text))

"""Chain restore across 3 in-process stages, each with its own prefix cache (spec §4.4).

One chain serves the whole module (prefills are what costs): a shared ~1,000-token
system prompt restores on every stage and decodes exactly like a cold run; an entry
evicted on one stage only makes every stage roll back and the answer stays right;
prompt_cache_key namespaces share nothing; no session or lane is left behind.
"""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from prefix_chain_support import (
    LoopThread, caches, clear_stage, session_counts, start_cached_chain, system_text,
)
from skippy.protocol import KvCacheConfig, cache_namespace_digest
from skippy.telemetry import Telemetry

pytestmark = pytest.mark.slow

KV = KvCacheConfig(max_bytes=256 << 20)
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def chain(make_stage, gguf_path):
    loop = LoopThread()
    spans = InMemorySpanExporter()
    chain = loop.run(start_cached_chain(make_stage, gguf_path, 3, KV,
                                        telemetry=Telemetry("stage0", span_exporter=spans)))
    chain.run, chain.spans = loop.run, spans
    try:
        yield chain
    finally:
        loop.run(chain.close())
        loop.close()


@pytest.fixture(scope="module")
def system_ids(tokenizer):
    ids = tokenizer.encode(system_text(41))
    assert 950 <= len(ids) <= 1300, len(ids)
    return ids


def generate(chain, prompt, key=None):
    result = chain.run(chain.client.generate(prompt, max_tokens=MAX_TOKENS,
                                             cache_namespace=cache_namespace_digest(key)))
    assert session_counts(chain) == [0, 0, 0]  # Stop reached every stage, nothing leaked
    assert chain.client._lanes.qsize() == 1    # the lane is back in the pool
    return result


def test_shared_prefix_with_another_tail_restores_and_matches_a_cold_run(chain, system_ids, tokenizer):
    first = generate(chain, system_ids + tokenizer.encode(" Question: what is rule 7?"))
    assert first.timings.restore_decision == "stage0_miss"
    assert first.stats.kv_record_stage_mask == 0b111  # every stage recorded its part
    second_prompt = system_ids + tokenizer.encode(" Question: which checklist does rule 12 use?")
    warm = generate(chain, second_prompt)
    assert warm.timings.restore_decision == "chain_restore_hit"
    assert warm.stats.kv_hit_stage_mask == 0b111 and warm.stats.kv_lookup_misses == 0
    restored = warm.timings.restored_tokens
    assert 0 < restored < len(system_ids) and restored % 128 == 0  # the longest aligned prefix
    assert warm.timings.prefilled_tokens == len(second_prompt) - restored
    assert warm.stats.kv_imported_tokens == 3 * restored  # every stage imported it
    # the same request on a cold cache: a namespace no request has used yet
    cold = generate(chain, second_prompt, key="never-used-before")
    assert cold.timings.restore_decision == "stage0_miss" and cold.timings.restored_tokens == 0
    assert warm.tokens == cold.tokens


def test_an_entry_evicted_on_the_middle_stage_rolls_back_everywhere(chain, tokenizer):
    prompt = tokenizer.encode(system_text(18) + " Question: summarise rule 3.")
    reference = generate(chain, prompt)
    stage0 = caches(chain)[0]
    again = generate(chain, prompt)
    assert again.timings.restore_decision == "chain_restore_hit"
    assert again.tokens == reference.tokens
    assert again.timings.restored_tokens == len(prompt) - 1  # the exact cacheable prefix
    assert again.timings.prefilled_tokens == 1  # TryRestorePrefillDecode brought the token

    rollbacks = [c.rollbacks for c in caches(chain)]
    assert chain.run(clear_stage(chain, 1)) > 0  # the middle stage forgets everything
    missed = generate(chain, prompt)
    assert missed.timings.restore_decision == "downstream_miss_rollback"
    assert missed.timings.restored_tokens == 0
    assert missed.tokens == reference.tokens
    assert missed.stats.kv_hit_stage_mask == 0b001 and missed.stats.kv_lookup_misses == 1
    # stage 0 dropped its restore; stage 1 missed (nothing to drop); stage 2 was never asked
    assert [c.rollbacks for c in caches(chain)] == [rollbacks[0] + 1, rollbacks[1], rollbacks[2]]

    # the cold prefill recorded the prompt again on stage 1; now evict on the final stage
    assert chain.run(clear_stage(chain, 2)) > 0
    missed = generate(chain, prompt)
    assert missed.timings.restore_decision == "downstream_miss_rollback"
    assert missed.tokens == reference.tokens
    assert missed.stats.kv_hit_stage_mask == 0b011 and missed.stats.kv_lookup_misses == 1
    # stage 1 hit, then rolled back on its downstream miss; stage 0 rolled back too
    assert [c.rollbacks for c in caches(chain)] == [rollbacks[0] + 2, rollbacks[1] + 1, rollbacks[2]]
    assert stage0.stats()["num_pinned"] == 0
    assert all(c.stats()["num_pinned"] == 0 for c in caches(chain))


def test_a_restored_prompts_first_token_comes_straight_back(chain, tokenizer, monkeypatch):
    """TryRestorePrefillDecode as in the seed: the final stage's first token reaches stage 0
    on the return stream and the request decodes from it, while the ACKs climb the chain
    behind it (held here at the middle stage for HOLD_S); their stats still join the request's."""
    from skippy.protocol import MessageKind
    from skippy.stage import handlers

    hold_s = 1.5
    restore = handlers.CONTROL_HANDLERS[MessageKind.TryRestorePrefillDecode]

    async def held_at_the_middle(ctl, span):
        if ctl.env.config.stage_index == 1:
            reply = ctl.reply
            ctl.reply = lambda ack: asyncio.get_running_loop().call_later(hold_s, reply, ack)
        await restore(ctl, span)

    prompt = tokenizer.encode("Straight back. " + system_text(9))
    reference = generate(chain, prompt)
    monkeypatch.setitem(handlers.CONTROL_HANDLERS, MessageKind.TryRestorePrefillDecode, held_at_the_middle)
    warm = generate(chain, prompt)
    assert warm.timings.prefilled_tokens == 1 and warm.timings.restore_decision == "chain_restore_hit"
    assert warm.timings.first_token_s < hold_s / 2, warm.timings.first_token_s  # not behind the ACK
    assert warm.stats.kv_hit_stage_mask == 0b111  # the held ACK's stats joined all the same
    assert warm.tokens == reference.tokens


def test_namespaces_share_nothing(chain, tokenizer):
    prompt = tokenizer.encode("Tenant notes. " + system_text(14) + " Question: what does rule 2 say?")
    alpha = generate(chain, prompt, key="tenant-alpha")
    assert alpha.timings.restore_decision == "stage0_miss"
    beta = generate(chain, prompt, key="tenant-beta")  # same prompt, another key: cold
    assert beta.timings.restore_decision == "stage0_miss" and beta.timings.restored_tokens == 0
    default = generate(chain, prompt)  # and no key at all is a namespace of its own
    assert default.timings.restore_decision == "stage0_miss"
    alpha_again = generate(chain, prompt, key="tenant-alpha")
    assert alpha_again.timings.restore_decision == "chain_restore_hit"
    assert alpha_again.timings.restored_tokens == len(prompt) - 1
    assert alpha.tokens == beta.tokens == default.tokens == alpha_again.tokens


def test_the_stage0_span_carries_the_decision_and_no_token_ids(chain, tokenizer):
    prompt = tokenizer.encode("Span check. " + system_text(4))
    chain.spans.clear()
    generate(chain, prompt)
    generate(chain, prompt)
    spans = [s for s in chain.spans.get_finished_spans() if s.name == "stage0.prefix_restore"]
    assert [s.attributes["kv_decision"] for s in spans] == ["stage0_miss", "chain_restore_hit"]
    hit = spans[1].attributes
    assert hit["kv_restored_tokens"] == len(prompt) - 1 and hit["kv_suffix_tokens"] == 1
    assert hit["kv_hit_stage_mask"] == 0b111 and hit["kv_restore_decode"] is True
    assert all(isinstance(v, (int, float, bool)) or v in ("stage0_miss", "chain_restore_hit")
               for s in spans for v in s.attributes.values())


def test_a_short_prompt_is_neither_restored_nor_recorded(chain, tokenizer):
    result = generate(chain, tokenizer.encode("Hello there, harbor office."))
    assert result.timings.restore_decision == "stage0_miss"
    assert result.stats.kv_recorded_pages == 0

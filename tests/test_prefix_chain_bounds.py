"""Prefix cache on a 2-stage chain: memory bounds, a stage without a cache, fused restore+decode."""

from __future__ import annotations

import pytest

from chain_support import run
from prefix_chain_support import caches, session_counts, start_cached_chain, system_text
from skippy.protocol import KvCacheConfig

pytestmark = pytest.mark.slow

TINY = KvCacheConfig(max_bytes=4 << 20)  # about two 70-token entries per stage


def test_memory_stays_under_a_tiny_byte_budget_over_50_distinct_prompts(make_stage, gguf_path):
    async def main():
        chain = await start_cached_chain(make_stage, gguf_path, 2, TINY)
        try:
            peaks = [0, 0]
            for i in range(50):
                prompt = [100 + (i * 997 + j * 31) % 40_000 for j in range(70)]
                result = await chain.client.generate(prompt, max_tokens=1)
                assert result.timings.restore_decision == "stage0_miss"  # all distinct
                assert session_counts(chain) == [0, 0]
                for index, cache in enumerate(caches(chain)):
                    stats = cache.stats()
                    assert stats["num_bytes"] <= TINY.max_bytes
                    peaks[index] = max(peaks[index], stats["num_bytes"])
            return peaks, [cache.stats() for cache in caches(chain)]
        finally:
            await chain.close()

    peaks, stats = run(main())
    for stage in stats:
        assert stage["recorded_entries"] == 50  # one entry (the exact 69 tokens) each
        assert stage["evictions"] >= 47 and stage["num_entries"] <= 3
        assert stage["num_pinned"] == 0
    assert all(0 < peak <= TINY.max_bytes for peak in peaks)


def test_a_stage_without_a_cache_is_a_miss_and_stage_0_rolls_back(make_stage, gguf_path, tokenizer):
    """Stage 1 has no cache: its neutral reply counts as a miss (spec §4.4)."""
    prompt = tokenizer.encode(system_text(8) + " Which rule mentions quartz?")

    async def main():
        chain = await start_cached_chain(make_stage, gguf_path, 2, [KvCacheConfig(), None])
        try:
            first = await chain.client.generate(prompt, max_tokens=6)
            second = await chain.client.generate(prompt, max_tokens=6)
            assert session_counts(chain) == [0, 0]
            return first, second, caches(chain)[0].rollbacks
        finally:
            await chain.close()

    first, second, rollbacks = run(main())
    assert first.timings.restore_decision == "stage0_miss"
    assert second.timings.restore_decision == "downstream_miss_rollback"
    assert second.stats.kv_lookup_hits == 1 and second.stats.kv_lookup_misses == 1
    assert second.timings.restored_tokens == 0 and rollbacks == 1
    assert second.tokens == first.tokens

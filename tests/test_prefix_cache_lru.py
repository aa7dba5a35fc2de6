"""PrefixCache bookkeeping with stand-in snapshots: ladder lookup, LRU bounds, pins, lower tier. No torch."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy.protocol.configs import KvCacheConfig
from skippy.runtime.prefix_cache import PrefixCache, RecordResult
from skippy.runtime.prefix_identity import CacheNamespace, cacheable_prefix_length, prefix_key

NS = CacheNamespace(model_digest="full:abc", layer_start=0, layer_end=4, kv_dtype="float32", ctx_size=4096)
BYTES_PER_TOKEN = 10


@dataclass(frozen=True)
class FakeSnapshot:
    num_tokens: int
    source: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.num_tokens * BYTES_PER_TOKEN


def snapshots_of(tokens):
    calls = []

    def snapshot_fn(n):
        calls.append(n)
        return FakeSnapshot(n, tuple(tokens[:n]))

    snapshot_fn.calls = calls
    return snapshot_fn


def prompt(seed: int, length: int) -> list[int]:
    return [seed * 100_000 + i for i in range(length)]


def record(cache, tokens, **kwargs):
    return cache.record(NS, tokens, snapshots_of(tokens), **kwargs)


def test_record_takes_the_top_of_the_ladder_and_skips_present_lengths():
    cache = PrefixCache(record_limit=2)
    tokens = prompt(1, 1019)
    fn = snapshots_of(tokens)
    assert cache.record(NS, tokens, fn) == RecordResult(2, (1019 + 896) * BYTES_PER_TOKEN)
    assert fn.calls == [1019, 896]
    fn2 = snapshots_of(tokens)
    assert cache.record(NS, tokens, fn2) == RecordResult(0, 0) and fn2.calls == []
    stats = cache.stats
    assert (stats.recorded_entries, stats.num_entries, stats.num_bytes) == (2, 2, 1915 * BYTES_PER_TOKEN)


def test_a_shared_prefix_is_recorded_even_when_every_tail_passes_the_next_stride():
    cache = PrefixCache()  # the original [exact, top aligned] policy would record 1152 and 1024 only
    system = prompt(7, 1000)
    first = system + prompt(8, 160)
    record(cache, first[:-1])
    second = system + prompt(9, 150)
    assert cache.lookup_longest(NS, second[:-1]).num_tokens == 896


def test_shared_system_prompt_with_a_new_tail_hits_the_longest_aligned_prefix():
    cache = PrefixCache()
    system = prompt(7, 1000)
    first = system + prompt(8, 20)
    record(cache, first[: cacheable_prefix_length(len(first))])
    second = system + prompt(9, 15)
    hit = cache.lookup_longest(NS, second[: cacheable_prefix_length(len(second))])
    assert hit is not None and hit.num_tokens == 896
    assert hit.snapshot.source == tuple(system[:896]) and hit.key == prefix_key(NS, system[:896])
    again = cache.lookup_longest(NS, first[:-1])
    assert again.num_tokens == len(first) - 1  # the exact length wins when present
    assert (cache.stats.hits, cache.stats.misses) == (2, 0)


def test_lookup_misses_on_another_namespace_start_or_prompt():
    cache = PrefixCache()
    tokens = prompt(1, 300)
    record(cache, tokens)
    assert cache.lookup_longest(NS.with_namespace("tenant-b"), tokens) is None
    assert cache.lookup_longest(NS, tokens, token_start=1) is None
    assert cache.lookup_longest(NS, prompt(2, 300)) is None
    assert cache.lookup_longest(NS, tokens[:50]) is None  # under min_tokens: nothing to probe
    assert (cache.stats.hits, cache.stats.misses) == (0, 4)


def test_exact_lookup_never_returns_a_shorter_prefix():
    cache = PrefixCache()
    tokens = prompt(1, 300)
    record(cache, tokens)  # records 300, 256 and 128
    assert cache.lookup(NS, tokens[:256]).num_tokens == 256
    assert cache.lookup(NS, tokens[:290]) is None
    assert cache.lookup(NS, []) is None
    assert cache.lookup_longest(NS, tokens[:290]).num_tokens == 256


def test_lru_evicts_the_least_recently_used_entry_by_count():
    cache = PrefixCache(max_entries=2, record_limit=1)
    a, b, c = prompt(1, 100), prompt(2, 100), prompt(3, 100)
    record(cache, a)
    record(cache, b)
    assert cache.lookup(NS, a) is not None  # a becomes the most recent
    record(cache, c)
    assert cache.lookup(NS, b) is None and cache.lookup(NS, a) and cache.lookup(NS, c)
    assert cache.stats.evictions == 1 and len(cache) == 2


def test_lru_evicts_by_bytes():
    cache = PrefixCache(max_bytes=250 * BYTES_PER_TOKEN, record_limit=1)
    record(cache, prompt(1, 100))
    record(cache, prompt(2, 100))
    record(cache, prompt(3, 100))  # 300 tokens > 250: the oldest goes
    assert cache.lookup(NS, prompt(1, 100)) is None
    assert cache.num_bytes == 200 * BYTES_PER_TOKEN and cache.stats.evictions == 1


def test_an_entry_larger_than_the_budget_is_not_recorded_and_evicts_nothing():
    cache = PrefixCache(max_bytes=150 * BYTES_PER_TOKEN, record_limit=1)
    record(cache, prompt(1, 100))
    assert record(cache, prompt(2, 200)) == RecordResult(0, 0)
    assert cache.lookup(NS, prompt(1, 100)) is not None
    assert cache.stats.skipped_records == 1 and cache.stats.evictions == 0


def test_pinned_entries_survive_eviction():
    cache = PrefixCache(max_entries=2, record_limit=1)
    a, b, c, d = (prompt(i, 100) for i in range(4))
    record(cache, a)
    hit = cache.lookup(NS, a, pin=True)
    record(cache, b)
    record(cache, c)  # a is the oldest but pinned: b goes
    assert cache.lookup(NS, a) and cache.lookup(NS, b) is None
    cache.pin(cache.lookup(NS, c).key)
    assert record(cache, d) == RecordResult(0, 0)  # every entry pinned: no room, nothing evicted
    assert cache.stats.skipped_records == 1 and cache.stats.num_pinned == 2
    cache.unpin(hit.key)
    assert record(cache, d) == RecordResult(1, 100 * BYTES_PER_TOKEN)
    assert cache.lookup(NS, a) is None and cache.lookup(NS, c) is not None


def test_pins_count_and_unpin_of_an_unpinned_key_raises():
    cache = PrefixCache()
    cache.pin("k")
    cache.pin("k")
    cache.unpin("k")
    assert cache.stats.num_pinned == 1
    cache.unpin("k")
    with pytest.raises(KeyError, match="unpinned"):
        cache.unpin("k")


def test_memory_stays_under_a_tiny_byte_budget_for_50_prompts():
    budget = 1000 * BYTES_PER_TOKEN
    cache = PrefixCache(max_bytes=budget)
    for i in range(50):
        tokens = prompt(i, 200 + 7 * i)
        hit = cache.lookup_longest(NS, tokens)
        assert hit is None or hit.snapshot.source == tuple(tokens[: hit.num_tokens])
        record(cache, tokens)
        assert cache.num_bytes <= budget
        assert cache.num_bytes == sum(e.nbytes for e in cache._entries.values())
    assert cache.stats.evictions > 0 and cache.stats.recorded_entries > 50


def test_zero_max_entries_stores_nothing():
    cache = PrefixCache(max_entries=0)
    assert record(cache, prompt(1, 200)) == RecordResult(0, 0) and len(cache) == 0


def test_from_config_copies_the_bounds():
    cache = PrefixCache.from_config(KvCacheConfig(max_entries=3, max_bytes=99, min_tokens=8, stride_tokens=16))
    assert (cache.max_entries, cache.max_bytes, cache.min_tokens, cache.stride_tokens) == (3, 99, 8, 16)
    assert PrefixCache.from_config(KvCacheConfig(mode="disabled")).max_entries == 0
    with pytest.raises(ValueError, match="disk_policy"):
        PrefixCache(disk_policy="always")


class DictTier:
    """A lower tier in a dict: what DiskCache does, without files."""

    def __init__(self, fail_reads: bool = False):
        self.store, self.fail_reads = {}, fail_reads

    def __contains__(self, key):
        return key in self.store

    def get(self, key):
        return None if self.fail_reads else self.store.get(key)

    def put(self, key, snapshot):
        self.store[key] = snapshot
        return True


def test_evicted_entries_spill_to_the_lower_tier_and_come_back_on_a_hit():
    tier = DictTier()
    cache = PrefixCache(max_entries=1, record_limit=1, disk=tier)
    a, b = prompt(1, 100), prompt(2, 100)
    record(cache, a)
    record(cache, b)
    assert prefix_key(NS, a) in tier.store and cache.stats.spilled == 1
    hit = cache.lookup(NS, a)
    assert hit.snapshot.source == tuple(a) and hit.key in cache  # promoted back to memory
    assert cache.stats.disk_hits == 1 and prefix_key(NS, b) in tier.store


def test_a_bad_lower_tier_read_falls_through_to_shorter_candidates():
    tier = DictTier(fail_reads=True)
    cache = PrefixCache(disk=tier)
    tokens = prompt(1, 300)
    tier.store[prefix_key(NS, tokens)] = FakeSnapshot(300)
    record(cache, tokens[:256])
    assert cache.lookup_longest(NS, tokens).num_tokens == 256


def test_record_policy_writes_through_and_flush_writes_the_rest():
    tier = DictTier()
    cache = PrefixCache(disk=tier, disk_policy="record")
    record(cache, prompt(1, 300))  # 300, 256, 128
    assert len(tier.store) == 3
    lazy = PrefixCache(disk=DictTier())
    record(lazy, prompt(1, 300))
    assert len(lazy.disk.store) == 0
    assert lazy.flush() == 3 and lazy.flush() == 0 and len(lazy.disk.store) == 3
    assert PrefixCache().flush() == 0


operations = st.lists(
    st.tuples(st.sampled_from(["record", "lookup", "pin", "unpin"]), st.integers(0, 9), st.integers(64, 400)),
    max_size=60,
)


@settings(max_examples=40, deadline=None)
@given(operations, st.integers(1, 6), st.integers(0, 2000))
def test_bounds_hold_and_pinned_entries_stay_under_any_sequence(ops, max_entries, max_tokens):
    cache = PrefixCache(max_entries=max_entries, max_bytes=max_tokens * BYTES_PER_TOKEN, min_tokens=64)
    pinned: list[str] = []
    for op, seed, length in ops:
        tokens = prompt(seed, length)
        if op == "record":
            record(cache, tokens)
        elif op == "lookup":
            hit = cache.lookup_longest(NS, tokens)
            assert hit is None or hit.snapshot.source == tuple(tokens[: hit.num_tokens])
        elif op == "pin" and (hit := cache.lookup_longest(NS, tokens, pin=True)):
            pinned.append(hit.key)
        elif op == "unpin" and pinned:
            cache.unpin(pinned.pop(0))
        assert len(cache) <= max_entries
        assert not max_tokens or cache.num_bytes <= max_tokens * BYTES_PER_TOKEN
        assert all(key in cache for key in pinned)

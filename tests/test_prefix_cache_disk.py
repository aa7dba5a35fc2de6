"""The disk tier: round trips, restart, quarantine of bad files, the byte budget, atomic writes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import skippy.runtime.disk_cache as disk_cache
from skippy.model.kv_cache import KVCache, KVSnapshot
from skippy.protocol.configs import KvCacheConfig
from skippy.runtime.disk_cache import QUARANTINE_DIR, DiskCache, encode_entry, read_entry
from skippy.runtime.prefix_cache import PrefixCache
from skippy.runtime.prefix_identity import CacheNamespace, prefix_key

NS = CacheNamespace(model_digest="full:abc", layer_start=0, layer_end=2, kv_dtype="float32", ctx_size=512)


def snapshot(seed: int, num_tokens: int = 8, dtype=torch.float32) -> KVSnapshot:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, 3, num_tokens, 4, generator=g).to(dtype)
    return KVSnapshot(k, torch.randn(2, 3, num_tokens, 4, generator=g).to(dtype))


def key(i: int) -> str:
    return prefix_key(NS, [i])


def file_size(snap: KVSnapshot) -> int:
    head, payload = encode_entry(snap)
    return len(head) + sum(p.nbytes for p in payload)


def assert_same(a: KVSnapshot, b: KVSnapshot) -> None:
    assert a.k.dtype == b.k.dtype and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def entry_files(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_file())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_gives_equal_tensors(tmp_path, dtype):
    store = DiskCache(tmp_path)
    snap = snapshot(1, dtype=dtype)
    assert store.put(key(1), snap) and key(1) in store
    assert_same(store.get(key(1)), snap)
    assert entry_files(tmp_path) == [f"{key(1)}.kv"]
    assert (store.stats.hits, store.stats.writes, store.stats.num_files) == (1, 1, 1)


def test_restart_finds_the_entries(tmp_path):
    first = DiskCache(tmp_path)
    snaps = {key(i): snapshot(i) for i in range(3)}
    for k, snap in snaps.items():
        first.put(k, snap)
    again = DiskCache(tmp_path)
    assert len(again) == 3 and again.num_bytes == first.num_bytes
    for k, snap in snaps.items():
        assert_same(again.get(k), snap)


def flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def flip_header_byte(path):
    data = bytearray(path.read_bytes())
    data[disk_cache.PREFIX.size + 3] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage",
    [
        flip_last_byte,                                         # payload bit rot
        flip_header_byte,                                       # header bit rot
        lambda p: p.write_bytes(p.read_bytes()[:-5]),           # truncated payload
        lambda p: p.write_bytes(p.read_bytes()[:30]),           # truncated header
        lambda p: p.write_bytes(b""),                           # empty file
        lambda p: p.write_bytes(b"not a cache file at all" * 9),  # garbage
        lambda p: p.write_bytes(p.read_bytes() + b"\0"),        # trailing bytes
        lambda p: p.write_bytes(p.read_bytes()[:8] + b"\x09" + p.read_bytes()[9:]),  # other format version
    ],
    ids=["payload", "header", "truncated", "truncated-header", "empty", "garbage", "trailing", "version"],
)
def test_a_bad_file_is_quarantined_and_reads_as_a_miss(tmp_path, damage):
    DiskCache(tmp_path).put(key(1), snapshot(1))
    damage(tmp_path / f"{key(1)}.kv")
    store = DiskCache(tmp_path)  # found again at restart; verified on read
    assert key(1) in store
    assert store.get(key(1)) is None
    assert key(1) not in store and entry_files(tmp_path) == []
    assert len(list((tmp_path / QUARANTINE_DIR).iterdir())) == 1
    assert store.stats.quarantined == 1 and store.get(key(1)) is None
    assert store.put(key(1), snapshot(1)) and store.get(key(1)) is not None  # rewritten cleanly


def test_a_file_removed_behind_the_stores_back_is_a_miss(tmp_path):
    store = DiskCache(tmp_path)
    store.put(key(1), snapshot(1))
    (tmp_path / f"{key(1)}.kv").unlink()
    assert store.get(key(1)) is None and key(1) not in store and store.stats.quarantined == 0


def test_the_budget_evicts_the_least_recently_used_file_first(tmp_path):
    size = file_size(snapshot(0))
    store = DiskCache(tmp_path, budget_bytes=2 * size)
    store.put(key(1), snapshot(1))
    store.put(key(2), snapshot(2))
    assert store.get(key(1)) is not None  # 1 is now the most recently used
    store.put(key(3), snapshot(3))
    assert (key(1) in store, key(2) in store, key(3) in store) == (True, False, True)
    assert not (tmp_path / f"{key(2)}.kv").exists() and store.num_bytes <= 2 * size
    assert store.stats.evictions == 1


def test_the_budget_at_restart_uses_the_file_times(tmp_path):
    store = DiskCache(tmp_path)
    for i in range(4):
        store.put(key(i), snapshot(i))
    now = time.time()
    for age, i in enumerate([2, 0, 3, 1]):  # key 1 is the oldest, then 3, 0, 2
        os.utime(tmp_path / f"{key(i)}.kv", (now - age * 100, now - age * 100))
    smaller = DiskCache(tmp_path, budget_bytes=2 * file_size(snapshot(0)))
    assert sorted(k for k in (key(i) for i in range(4)) if k in smaller) == sorted([key(2), key(0)])


def test_an_entry_bigger_than_the_budget_is_not_written(tmp_path):
    store = DiskCache(tmp_path, budget_bytes=file_size(snapshot(0)) - 1)
    assert not store.put(key(1), snapshot(1))
    assert entry_files(tmp_path) == [] and len(store) == 0


def test_a_failed_rename_leaves_no_partial_file(tmp_path, monkeypatch):
    store = DiskCache(tmp_path)

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_cache.os, "replace", broken_replace)
    assert not store.put(key(1), snapshot(1))
    assert entry_files(tmp_path) == [] and key(1) not in store and store.stats.write_errors == 1


def test_restart_removes_temp_files_of_dead_or_old_writers(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    names = {
        "dead": f".{key(1)}.{dead_pid}.00000000.tmp",
        "live": f".{key(2)}.{os.getpid()}.00000000.tmp",
        "old": f".{key(3)}.{os.getpid()}.11111111.tmp",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"partial")
    os.utime(tmp_path / names["old"], (0, 0))
    store = DiskCache(tmp_path)
    assert entry_files(tmp_path) == [names["live"]] and len(store) == 0


def test_concurrent_writers_and_readers_see_whole_files(tmp_path):
    snaps = {key(i): snapshot(i, num_tokens=128) for i in range(16)}
    done, errors = threading.Event(), []

    def writer(i):  # each thread is its own store (as another process would be), racing on the same keys
        try:
            store = DiskCache(tmp_path)
            for k in list(snaps)[i::2] + list(snaps)[1 - i % 2::2]:
                assert store.put(k, snaps[k])
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    def reader():  # whatever sits under a final name must be a whole, valid file
        try:
            while not done.is_set():
                for name in os.listdir(tmp_path):
                    if name.endswith(".kv"):
                        try:
                            got = read_entry(tmp_path / name)
                        except FileNotFoundError:
                            continue
                        assert_same(got, snaps[name[:-3]])
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    readers = [threading.Thread(target=reader) for _ in range(2)]
    writers = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    done.set()
    for t in readers:
        t.join()
    assert not errors, errors[0]
    assert entry_files(tmp_path) == sorted(f"{k}.kv" for k in snaps)  # no temp files left
    assert not list((tmp_path / QUARANTINE_DIR).iterdir())
    fresh = DiskCache(tmp_path)
    for k, snap in snaps.items():
        assert_same(fresh.get(k), snap)


def test_put_rejects_a_malformed_key(tmp_path):
    with pytest.raises(ValueError, match="64-hex-digit"):
        DiskCache(tmp_path).put("../escape", snapshot(1))


def test_unsupported_dtype_stays_memory_only(tmp_path):
    store = DiskCache(tmp_path)
    snap = KVSnapshot(torch.zeros(1, 1, 2, 2, dtype=torch.int8), torch.zeros(1, 1, 2, 2, dtype=torch.int8))
    assert not store.put(key(1), snap) and entry_files(tmp_path) == []


def filled_kv(seed: int, num_tokens: int) -> KVCache:
    kv = KVCache(num_layers=2, num_kv_heads=3, head_dim=4, max_tokens=512)
    snap = snapshot(seed, num_tokens)
    kv.reserve(0, num_tokens)
    for layer in range(2):
        kv.write(layer, 0, snap.k[layer], snap.v[layer])
    kv.commit(num_tokens)
    return kv


def test_prefix_cache_over_disk_survives_eviction_and_restart(tmp_path):
    tokens_a, tokens_b = list(range(1000, 1200)), list(range(5000, 5200))
    kv_a, kv_b = filled_kv(1, 200), filled_kv(2, 200)
    cache = PrefixCache(max_entries=2, disk=DiskCache(tmp_path))
    cache.record(NS, tokens_a, kv_a.snapshot)  # 200 and 128
    cache.record(NS, tokens_b, kv_b.snapshot)  # evicts both a entries to disk
    assert cache.stats.spilled == 2
    hit = cache.lookup_longest(NS, tokens_a + [7, 8], pin=True)
    assert hit.num_tokens == 128 and cache.stats.disk_hits == 1
    restored = KVCache(num_layers=2, num_kv_heads=3, head_dim=4, max_tokens=512)
    restored.restore(hit.snapshot)
    assert_same(restored.snapshot(128), kv_a.snapshot(128))
    cache.unpin(hit.key)
    cache.flush()

    after_restart = PrefixCache(disk=DiskCache(tmp_path))  # a new process: empty memory
    hit = after_restart.lookup_longest(NS, tokens_b)
    assert hit.num_tokens == 200 and after_restart.stats.disk_hits == 1
    assert_same(hit.snapshot, kv_b.snapshot(200))


def test_quarantine_keeps_only_the_newest_files(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_cache, "MAX_QUARANTINED", 2)
    store = DiskCache(tmp_path)
    for i in range(3):
        store.put(key(i), snapshot(i))
        flip_last_byte(tmp_path / f"{key(i)}.kv")
        assert store.get(key(i)) is None
    kept = sorted(p.name.split(".")[0] for p in (tmp_path / QUARANTINE_DIR).iterdir())
    assert kept == sorted([key(1), key(2)]) and store.stats.quarantined == 3


def test_from_config(tmp_path):
    assert DiskCache.from_config(KvCacheConfig()) is None
    assert DiskCache.from_config(KvCacheConfig(disk_dir=str(tmp_path), mode="disabled")) is None
    store = DiskCache.from_config(KvCacheConfig(disk_dir=str(tmp_path / "kv"), disk_budget_bytes=1234))
    assert store.root == tmp_path / "kv" and store.budget_bytes == 1234 and (tmp_path / "kv" / QUARANTINE_DIR).is_dir()

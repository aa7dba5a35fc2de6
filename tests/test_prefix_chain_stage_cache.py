"""StagePrefixCache on its own: restore into a session, record from its ledger, roll back,
namespaces, failures that fail open. Small KV caches, no model."""

from __future__ import annotations

import logging

import torch

from skippy.model.kv_cache import KVCache
from skippy.protocol import KvCacheConfig, SamplingConfig, cache_namespace_digest
from skippy.runtime.session import Session
from skippy.runtime.stage_cache import StagePrefixCache

LAYERS, HEADS, HEAD_DIM = 2, 1, 4


def new_cache() -> KVCache:
    return KVCache(LAYERS, HEADS, HEAD_DIM, 1024)


def filled_session(tokens: list[int], key=(1, 1), namespace: bytes | None = None) -> Session:
    """A session as a prefill leaves it: KV for every token, the ledger, the prompt length."""
    session = Session(key, request_id=key[1], prompt_token_count=len(tokens),
                      cache_namespace=namespace)
    cache = session.cache = new_cache()
    cache.reserve(0, len(tokens))
    for layer in range(LAYERS):
        values = torch.tensor(tokens, dtype=torch.float32).view(1, -1, 1).expand(HEADS, -1, HEAD_DIM)
        cache.write(layer, 0, values + layer, -values)
    cache.commit(len(tokens))
    session.ledger = list(tokens)
    return session


def build(tmp_path, model_file=None, **config) -> StagePrefixCache:
    model = model_file or tmp_path / "model.bin"
    model.write_bytes(b"weights")
    return StagePrefixCache.build(KvCacheConfig(**config), model_path=str(model), layer_start=0,
                                  layer_end=LAYERS, kv_dtype=torch.float32, ctx_size=1024)


def test_record_then_restore_gives_the_same_kv_and_ledger(tmp_path):
    kv = build(tmp_path)
    prompt = list(range(1000, 1300))
    recorded = kv.record(filled_session(prompt))
    assert recorded.num_entries == 3  # exact 299, then 256 and 128 on the ladder
    other = Session((2, 1), request_id=1)
    tail = prompt[:260] + [7, 8, 9]  # shares 260 tokens: the longest ladder hit is 256
    assert kv.restore(other, tail, longest=True, new_cache=new_cache) == 256
    assert other.ledger == prompt[:256] and other.cache.length == 256
    source = filled_session(prompt).cache
    assert torch.equal(other.cache.k[:, :, :256], source.k[:, :, :256])
    assert torch.equal(other.cache.v[:, :, :256], source.v[:, :, :256])
    # stages below restore exactly what stage 0 chose, never a shorter prefix
    assert kv.restore(Session((3, 1), 1), prompt[:260], longest=False, new_cache=new_cache) == 0
    assert kv.restore(Session((3, 2), 2), prompt[:256], longest=False, new_cache=new_cache) == 256
    assert kv.stats()["num_pinned"] == 0


def test_namespaces_partition_the_cache(tmp_path):
    kv = build(tmp_path)
    prompt = list(range(500, 700))
    kv.record(filled_session(prompt, namespace=cache_namespace_digest("a")))
    for namespace, expected in (("a", 199), ("b", 0), (None, 0)):
        session = Session((4, 1), 1, cache_namespace=cache_namespace_digest(namespace))
        assert kv.restore(session, prompt[:199], longest=False, new_cache=new_cache) == expected


def test_rollback_empties_the_session_but_keeps_its_settings(tmp_path):
    kv = build(tmp_path)
    prompt = list(range(200))
    kv.record(filled_session(prompt))
    session = Session((5, 1), 1, sampling=SamplingConfig(temperature=0.7), prompt_token_count=200)
    assert kv.restore(session, prompt[:199], longest=True, new_cache=new_cache) == 199
    kv.rollback(session)
    assert session.cache.length == 0 and session.ledger == [] and kv.rollbacks == 1
    assert session.sampling.temperature == 0.7 and session.prompt_token_count == 200


def test_only_the_known_prefix_of_the_prompt_is_recorded(tmp_path):
    kv = build(tmp_path)
    session = filled_session(list(range(300)))
    session.ledger[150] = -1  # a frame that carried no token ids
    assert kv.record(session).num_entries == 2  # 150 exact, then 128
    short = filled_session(list(range(40)))
    assert kv.record(short).num_entries == 0  # under min_tokens
    assert kv.record(Session((9, 9), 9)).num_entries == 0  # nothing computed yet


def test_a_failing_record_is_contained(tmp_path, caplog):
    kv = build(tmp_path)
    session = filled_session(list(range(300)))

    def broken(num_tokens):
        raise RuntimeError("out of memory")

    session.cache.snapshot = broken
    with caplog.at_level(logging.WARNING, logger="skippy.runtime"):
        assert kv.record(session).num_entries == 0
    assert kv.stats()["record_errors"] == 1 and "record failed" in caplog.text


def test_build_fails_open(tmp_path, caplog):
    assert build(tmp_path, mode="disabled") is None
    with caplog.at_level(logging.WARNING, logger="skippy.runtime"):
        missing = StagePrefixCache.build(KvCacheConfig(), model_path=str(tmp_path / "absent"),
                                         layer_start=0, layer_end=2, kv_dtype=torch.float32,
                                         ctx_size=64)
        assert missing is None and "cannot digest the model" in caplog.text
        blocker = tmp_path / "not-a-dir"
        blocker.write_text("x")
        memory_only = build(tmp_path, disk_dir=str(blocker / "kv"))
        assert memory_only is not None and memory_only.disk is None
        assert "unusable" in caplog.text


def test_close_writes_memory_to_disk_and_a_restart_restores_from_it(tmp_path):
    disk = tmp_path / "kv"
    prompt = list(range(3000, 3200))
    first = build(tmp_path, disk_dir=str(disk))
    first.record(filled_session(prompt))
    assert first.close() == 2 and len(list(disk.glob("*.kv"))) == 2
    again = build(tmp_path, disk_dir=str(disk))  # same model file: same identity
    session = Session((6, 1), 1)
    assert again.restore(session, prompt[:199], longest=True, new_cache=new_cache) == 199
    assert again.stats()["disk_hits"] == 1
    assert torch.equal(session.cache.k[:, :, :199], filled_session(prompt).cache.k[:, :, :199])

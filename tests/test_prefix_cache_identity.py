"""Prefix-cache identity: what separates two entries, the candidate ladder, the model digest. No torch."""

from __future__ import annotations

import ast
import dataclasses
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import skippy.runtime.prefix_identity as identity
from skippy.runtime.prefix_identity import (
    CacheNamespace,
    cacheable_prefix_length,
    candidate_lengths,
    model_digest,
    prefix_key,
    prefix_keys,
    record_lengths,
)

BASE = CacheNamespace(model_digest="full:abc", layer_start=0, layer_end=8, kv_dtype="float32", ctx_size=2048)
TOKENS = list(range(100, 300))


@pytest.mark.parametrize(
    "changes",
    [
        {"namespace": "tenant-a"},              # a prompt_cache_key partitions the cache
        {"namespace": ""},                      # an empty key is not the default namespace
        {"model_digest": "full:abd"},           # other weights
        {"layer_start": 1},                     # other layer range
        {"layer_end": 9},
        {"kv_dtype": "bfloat16"},               # other KV dtype
        {"kv_layout": "other-layout"},
        {"ctx_size": 4096},                     # other context size
        {"platform": "aarch64/little/64bit"},
        {"weights": "q4"},                      # the same file loaded quantized vs dequantized
    ],
    ids=lambda changes: ",".join(changes),
)
def test_each_namespace_field_changes_the_key(changes):
    other = dataclasses.replace(BASE, **changes)
    assert prefix_key(other, TOKENS) != prefix_key(BASE, TOKENS)


@pytest.mark.parametrize(
    ("tokens", "token_start"),
    [
        (TOKENS[:-1], 0),                       # one token shorter
        (TOKENS[:-1] + [TOKENS[-1] + 1], 0),    # last token differs
        ([TOKENS[1], TOKENS[0], *TOKENS[2:]], 0),  # order matters
        (TOKENS, 1),                            # other start position
    ],
)
def test_tokens_and_start_change_the_key(tokens, token_start):
    assert prefix_key(BASE, tokens, token_start) != prefix_key(BASE, TOKENS)


def test_equal_identities_give_equal_keys():
    again = CacheNamespace("full:abc", 0, 8, "float32", 2048)
    assert prefix_key(again, list(TOKENS)) == prefix_key(BASE, tuple(TOKENS))
    assert BASE.with_namespace("k").with_namespace(None) == BASE
    assert len(prefix_key(BASE, TOKENS)) == 64 and int(prefix_key(BASE, TOKENS), 16) >= 0


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=300), st.data())
def test_incremental_keys_equal_keys_of_slices(tokens, data):
    lengths = data.draw(st.lists(st.integers(1, len(tokens)), min_size=1, max_size=5))
    keys = prefix_keys(BASE, tokens, lengths, token_start=3)
    assert keys == {n: prefix_key(BASE, tokens[:n], token_start=3) for n in lengths}


@pytest.mark.parametrize("bad", [0, len(TOKENS) + 1])
def test_prefix_keys_reject_lengths_outside_the_tokens(bad):
    with pytest.raises(ValueError, match="prefix lengths"):
        prefix_keys(BASE, TOKENS, [bad])


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_digest": ""}, "model digest"),
        ({"layer_end": 0}, "layer_start < layer_end"),
        ({"layer_start": -1}, "layer_start < layer_end"),
        ({"ctx_size": 0}, "ctx_size"),
    ],
)
def test_namespace_rejects_bad_fields(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(BASE, **changes)


@pytest.mark.parametrize(
    ("num_tokens", "stride", "min_tokens", "expected"),
    [
        (0, 128, 64, []),                       # empty prompt
        (63, 128, 64, []),                      # under the minimum
        (64, 128, 64, [64]),                    # exactly the minimum, nothing aligned below
        (128, 128, 64, [128]),                  # exact length is aligned: no duplicate
        (129, 128, 64, [129, 128]),
        (256, 128, 64, [256, 128]),
        (1019, 128, 64, [1019, 896, 768, 640, 512, 384, 256, 128]),
        (300, 128, 200, [300, 256]),            # aligned lengths under the minimum dropped
        (10, 4, 1, [10, 8, 4]),
        (5, 1, 3, [5, 4, 3]),
    ],
)
def test_candidate_ladder(num_tokens, stride, min_tokens, expected):
    assert candidate_lengths(num_tokens, stride, min_tokens) == expected


def test_candidate_ladder_of_a_long_prompt():
    ladder = candidate_lengths(8000)
    assert ladder[:3] == [8000, 7936, 7808] and ladder[-1] == 128 and len(ladder) == 63
    assert ladder == sorted(ladder, reverse=True)


@pytest.mark.parametrize(
    ("num_tokens", "limit", "expected"),
    [
        (63, 4, []),                            # under the minimum
        (64, 4, [64]),
        (129, 4, [129, 128]),                   # fewer aligned lengths than the limit
        (1015, 4, [1015, 896, 768, 640]),
        (1030, 4, [1030, 1024, 896, 768]),
        (1030, 2, [1030, 1024]),                # the original policy (spec §4.3)
        (1030, 8, [1030, 1024, 896, 768, 512, 128]),  # ... then the lowest
        (8000, 8, [8000, 7936, 7808, 7680, 7424, 6912, 5888, 3840]),  # gaps of 0, 1, 2, 4... strides
        (8000, 1, [8000]),
    ],
)
def test_record_lengths(num_tokens, limit, expected):
    assert record_lengths(num_tokens, 128, 64, limit) == expected
    assert set(expected) <= set(candidate_lengths(num_tokens, 128, 64))  # lookup probes every recorded length


@settings(max_examples=30, deadline=None)
@given(st.integers(64, 5000), st.integers(1, 2000), st.integers(3, 8))
def test_record_lengths_reach_a_shared_prefix_within_reach(shared, tail, limit):
    if tail > 2 ** (limit - 3) * 128 or shared < 128:
        return
    recorded = record_lengths(shared + tail, 128, 64, limit)
    assert any(n <= shared for n in recorded)


@pytest.mark.parametrize(("prompt_len", "expected"), [(0, 0), (1, 0), (2, 1), (1000, 999)])
def test_cacheable_prefix_excludes_the_last_prompt_token(prompt_len, expected):
    assert cacheable_prefix_length(prompt_len) == expected


def test_model_digest_of_a_small_file_hashes_its_content(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"weights" * 100)
    b.write_bytes(b"weights" * 100)
    assert model_digest(a) == model_digest(b) == model_digest(a, full=True)
    assert model_digest(a).startswith("full:")
    b.write_bytes(b"weightz" * 100)
    assert model_digest(a) != model_digest(b)


def test_model_digest_of_a_large_file_samples_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(identity, "DIGEST_SAMPLE_BYTES", 64)  # "large" = over 18 blocks of 64 bytes
    path = tmp_path / "model.gguf"
    path.write_bytes(bytes(range(256)) * 40)
    first = model_digest(path)
    assert first.startswith("sampled:") and model_digest(path, full=True).startswith("full:")
    with open(path, "r+b") as f:  # edit a sampled block (the first), keep size and mtime
        f.write(b"\xff")
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    identity._file_digest.cache_clear()
    assert model_digest(path) != first
    second = model_digest(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a touch: safe miss
    assert model_digest(path) != second


def test_model_digest_is_cached_per_size_and_mtime(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"x" * 1000)
    identity._file_digest.cache_clear()
    model_digest(path)
    model_digest(path)
    assert identity._file_digest.cache_info().hits == 1


def test_model_digest_of_a_checkpoint_directory(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 100)
    first = model_digest(tmp_path)
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "lock").write_text("ignored")  # hidden files do not count
    assert model_digest(tmp_path) == first and first.startswith("dir-sampled:")
    (tmp_path / "extra.bin").write_bytes(b"1")
    assert model_digest(tmp_path) != first
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty directory"):
        model_digest(tmp_path / "empty")


@pytest.mark.parametrize("module", ["prefix_identity", "prefix_cache"])
def test_bookkeeping_modules_import_no_torch(module):
    path = Path(identity.__file__).with_name(f"{module}.py")
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    assert not roots & {"torch", "numpy"}

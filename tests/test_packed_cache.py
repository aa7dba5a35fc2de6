"""Packed weights kept on disk (skippy/model/packed_cache.py): a model built from them computes
bit for bit what the freshly packed one does, and a damaged or foreign file is packed anew."""

from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch

from skippy.model import packed_cache
from skippy.model.args import LayerRange
from skippy.model.llama import Segment, StageModel
from skippy.model.loader import kv_dtype_for
from skippy.model.packed_cache import PackedCache
from skippy.model.quant_linear import QuantLinear
from skippy.model.weight_arena import WeightArena

PROMPT = list(range(300, 324))


def build(quant_weights, directory, start=0, end=None) -> tuple[StageModel, PackedCache]:
    args, weights = quant_weights
    packed = PackedCache(directory)
    layers = LayerRange(start, args.num_layers if end is None else end, args.num_layers)
    model = StageModel(args, layers, weights, torch.device("cpu"), kv_dtype_for(weights),
                       arena=WeightArena(packed=packed))
    packed.start_writing()
    packed.close()
    return model, packed


def logits(model: StageModel) -> torch.Tensor:
    cache = model.new_cache()
    hidden = model.forward(torch.tensor(PROMPT), [Segment(cache, 0, len(PROMPT))])
    hidden = model.forward(torch.tensor([PROMPT[-1]]), [Segment(cache, len(PROMPT), 1)])  # the one-call step
    return model.compute_logits(hidden) if model.layers.is_last else hidden


def test_a_model_from_the_packed_cache_equals_a_freshly_packed_one(quant_weights, tmp_path):
    fresh, first = build(quant_weights, tmp_path)
    assert first.loaded_bytes == 0 and any(tmp_path.glob("*.bin"))
    mapped, second = build(quant_weights, tmp_path)
    linears = [m for m in mapped.linears if isinstance(m, QuantLinear)]
    assert second.loaded_bytes == sum(t.nbytes for m in linears for t in m.tensors) > 0
    assert torch.equal(logits(mapped), logits(fresh))
    # a later stage's layers come from the same files: any split finds its matmuls
    _, later = build(quant_weights, tmp_path, 20)
    assert later.loaded_bytes > 0 and not any(tmp_path.glob(".*.tmp"))


def test_a_damaged_matmul_is_packed_again(quant_weights, tmp_path):
    fresh, _ = build(quant_weights, tmp_path, 0, 2)
    data = sorted(tmp_path.glob("blk.1.*.bin"))[0]
    with open(data, "r+b") as f:  # an interrupted write: fewer bytes than its index names
        f.truncate(os.path.getsize(data) - 4096)
    index = data.with_suffix(".json")
    index.write_text(index.read_text()[:-10])  # and an index cut short
    again, packed = build(quant_weights, tmp_path, 0, 2)
    total = sum(t.nbytes for m in again.linears for t in m.tensors)
    assert 0 < packed.loaded_bytes < total
    assert torch.equal(logits(again), logits(fresh))


def test_the_key_follows_the_file_and_the_kernel_build(gguf_path, tmp_path, monkeypatch):
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(gguf_path, copy)
    key = packed_cache.model_key(copy)
    assert key == packed_cache.model_key(copy)
    os.utime(copy, ns=(0, 12345))  # a file replaced in place: same header, another modification time
    replaced = packed_cache.model_key(copy)
    assert replaced != key
    monkeypatch.setattr(packed_cache, "_packing_identity", lambda: "another kernel build, or quant.py")
    assert packed_cache.model_key(copy) not in (key, replaced)


def test_a_dead_writers_temporary_files_are_removed(tmp_path):
    stale, fresh = tmp_path / ".a.bin.1.tmp", tmp_path / ".b.bin.2.tmp"
    for tmp in (stale, fresh):
        tmp.write_bytes(b"partial")
    os.utime(stale, (0, 0))
    packed_cache._remove_stale_writes(tmp_path)
    assert not stale.exists() and fresh.exists()


def test_old_packed_models_are_evicted(tmp_path, monkeypatch):
    monkeypatch.setenv("SKIPPY_CACHE_DIR", str(tmp_path))
    for i in range(6):
        (packed_cache.packed_root() / f"m{i}").mkdir(parents=True)
        os.utime(packed_cache.packed_root() / f"m{i}", (i, i))
    packed_cache._evict_beyond(3, keep=packed_cache.packed_root() / "m0")
    assert sorted(d.name for d in packed_cache.packed_root().iterdir()) == ["m0", "m4", "m5"]


@pytest.mark.parametrize("full", [False, True])
def test_a_cache_directory_that_cannot_be_made_leaves_packing_alone(gguf_path, tmp_path, monkeypatch, full):
    if full:
        monkeypatch.setattr(packed_cache.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(1, 1, 0))
        cache = PackedCache(tmp_path)
        cache.store("x", {}, {"t": torch.zeros(4)})
        cache.start_writing()
        cache.close()
        assert not any(tmp_path.iterdir())
    else:
        blocked = tmp_path / "file"
        blocked.write_text("")
        monkeypatch.setenv("SKIPPY_CACHE_DIR", str(blocked))  # a file where the directory should be
        assert PackedCache.for_model(gguf_path) is None


def test_the_writer_makes_no_torch_call(tmp_path):
    """A process may exit while the writer writes. CPython then ends a daemon thread that wakes
    inside a torch call with pthread_exit, and its unwinding through torch's C++ aborted
    `skippy generate` at exit (SIGABRT, "terminate called without an active exception"), so
    the writer must not call torch at all: store() hands it numpy arrays."""
    calls: list[str] = []

    def watch(frame, event, arg):
        if event == "c_call" and threading.current_thread().name == "skippy-packed-writer":
            owner = getattr(arg, "__self__", None)
            if isinstance(owner, torch.Tensor) or (getattr(arg, "__module__", None) or "").startswith("torch"):
                calls.append(arg.__qualname__)

    cache = PackedCache(tmp_path)
    whole = torch.arange(64, dtype=torch.int32)
    cache.store("m", {"n": 1}, {"strided": whole[::2], "whole": whole, "half": whole.to(torch.float16)})
    threading.setprofile(watch)
    try:
        cache.start_writing()
        cache.close()
    finally:
        threading.setprofile(None)
    assert calls == []
    meta, tensors = cache.load("m")
    assert meta == {"n": 1} and torch.equal(tensors["strided"], whole[::2]) and torch.equal(tensors["whole"], whole)
    assert torch.equal(tensors["half"], whole.to(torch.float16))

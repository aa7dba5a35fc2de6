"""The weight arena (skippy/model/weight_arena.py): aligned, disjoint, huge-page backed, freed."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from skippy.model.weight_arena import ALIGN, HUGE_PAGE, WeightArena

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping(address: int) -> dict[str, int] | None:
    """The kB fields of /proc/self/smaps for the mapping holding `address` (None: unmapped)."""
    fields, inside = None, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            if inside:
                return fields
            inside = low <= address < high
            fields = {} if inside else None
        elif inside and line.endswith(" kB"):
            name, value, _ = line.split()
            fields[name.rstrip(":")] = int(value)
    return fields if inside else None


def test_tensors_are_aligned_disjoint_and_writable():
    arena = WeightArena(chunk_bytes=HUGE_PAGE)
    shapes = [((3,), torch.uint8), ((5, 7), torch.float16), ((100,), torch.float32), ((1,), torch.uint8)]
    tensors = [arena.empty(shape, dtype) for shape, dtype in shapes]
    for t, (shape, dtype) in zip(tensors, shapes):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % ALIGN == 0
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    for i, t in enumerate(tensors):
        t.fill_(i + 1)
    assert [int(t.flatten()[0]) for t in tensors] == [1, 2, 3, 4]


def test_chunks_start_on_huge_pages_and_a_large_tensor_gets_its_own():
    arena = WeightArena(chunk_bytes=HUGE_PAGE)
    small = arena.empty((1000,), torch.uint8)
    large = arena.empty((3 * HUGE_PAGE,), torch.uint8)  # more than a chunk
    after = arena.empty((10,), torch.uint8)  # the large one's chunk is full: a new chunk
    for t in (small, large, after):
        assert t.data_ptr() % HUGE_PAGE == 0


def test_huge_pages_back_the_weights_when_the_system_allows():
    setting = THP.read_text() if THP.exists() else "[never]"
    t = WeightArena().empty((4 * HUGE_PAGE,), torch.uint8)
    t.fill_(1)  # touched: resident
    fields = _mapping(t.data_ptr())
    assert fields is not None and fields["Rss"] >= 4 * HUGE_PAGE // 1024
    if "[never]" not in setting:
        assert fields["AnonHugePages"] >= 2 * HUGE_PAGE // 1024, (setting, fields)


def test_the_chunk_is_unmapped_with_its_last_tensor():
    arena = WeightArena(chunk_bytes=HUGE_PAGE)
    a, b = arena.empty((10,), torch.uint8), arena.empty((10,), torch.uint8)
    address = a.data_ptr()
    del arena, a
    gc.collect()
    assert _mapping(address) is not None  # b still lives in it
    del b
    gc.collect()
    assert _mapping(address) is None


def test_a_loaded_model_packs_its_matmuls_into_the_arena(make_quant_stage):
    model = make_quant_stage(0, 2)
    codes = model.blocks[0].wqkv.parts[0].codes
    fields = _mapping(codes.data_ptr())
    assert fields is not None and codes.data_ptr() % ALIGN == 0
    if "[never]" not in (THP.read_text() if THP.exists() else "[never]"):
        assert fields["AnonHugePages"] > 0

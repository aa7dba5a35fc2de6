"""Where a stage's packed weights live: 2 MiB-aligned memory marked for transparent huge pages.

A decode step streams every packed weight of the stage once. On 4 KiB pages that is one
page per 4 KiB of weights, far more pages than the TLB holds, so every page costs a page walk;
on 2 MiB pages it is 512 times fewer. Linux backs anonymous memory with huge pages only where
the mapping asks for them (`madvise` is the usual setting of
/sys/kernel/mm/transparent_hugepage/enabled) and only for 2 MiB-aligned ranges, which
torch's allocator does not give (docs/decisions.md, "Weights in a huge-page arena", has what
it gains).

Memory: the weights are the same bytes; an arena holds at most one partly used huge page
at the end of each chunk. Where huge pages are off (or on other systems) the arena is plain
anonymous memory. Chunks are freed when the last tensor in them is.
"""

from __future__ import annotations

import mmap
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from .packed_cache import PackedCache

HUGE_PAGE = 2 << 20
CHUNK_BYTES = 32 << 20   # a chunk holds several matmuls; a larger one gets its own
ALIGN = 64               # every tensor starts on a cache line, as torch's allocator's do


class WeightArena:
    """Bump allocation of one model's weight tensors, chunk by chunk. `packed`: where matmuls
    packed before are found, and packed ones kept for the next start (packed_cache.py)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, packed: PackedCache | None = None):
        self.chunk_bytes, self.packed = chunk_bytes, packed
        self._chunk: torch.Tensor | None = None  # uint8 view of the current chunk, 2 MiB-aligned
        self._used = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized contiguous tensor in the arena."""
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        start = -(-self._used // ALIGN) * ALIGN
        if self._chunk is None or start + nbytes > self._chunk.numel():
            self._chunk, start = _huge_chunk(max(self.chunk_bytes, nbytes)), 0
        self._used = start + nbytes
        return self._chunk[start:start + nbytes].view(dtype).view(shape)


def _huge_chunk(nbytes: int) -> torch.Tensor:
    """`nbytes` (rounded up to whole huge pages) of zeroed anonymous memory starting on a 2 MiB
    boundary, asked to be backed by huge pages. The tensor keeps the mapping alive."""
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    # mmap aligns to 4 KiB only: map a huge page more and start at the first 2 MiB boundary
    # (the pages before it are never touched, so never resident)
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE_PAGE
    return whole[skip:skip + size]

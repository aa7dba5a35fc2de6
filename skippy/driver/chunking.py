"""Prefill chunk policies (spec §6.4): how stage 0 cuts a prompt into chunks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class ChunkPolicy(Protocol):
    def chunk_sizes(self, num_tokens: int) -> list[int]:
        """Chunk sizes, in order, that add up to `num_tokens`."""


@dataclass(frozen=True, slots=True)
class FixedChunks:
    """Every chunk `size` tokens, the last one shorter (spec default 256)."""

    size: int = 256

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"Expected a chunk size >= 1, got {self.size}")

    def chunk_sizes(self, num_tokens: int) -> list[int]:
        full, rest = divmod(num_tokens, self.size)
        return [self.size] * full + ([rest] if rest else [])


@dataclass(frozen=True, slots=True)
class ScheduleChunks:
    """Chunks of sizes[0], sizes[1], ..., then sizes[-1] repeated (e.g. 128,256,384)."""

    sizes: Sequence[int]

    def __post_init__(self) -> None:
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError(f"Expected chunk sizes >= 1, got {list(self.sizes)}")

    def chunk_sizes(self, num_tokens: int) -> list[int]:
        out, index = [], 0
        while num_tokens > 0:
            size = min(self.sizes[min(index, len(self.sizes) - 1)], num_tokens)
            out.append(size)
            num_tokens -= size
            index += 1
        return out

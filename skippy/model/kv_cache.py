"""Per-session KV storage for one stage's layers. Storage only: no policy.

Keys and values live in one growing buffer per session:
    k, v: [num_local_layers, num_kv_heads, capacity, head_dim]
`length` is the number of committed positions. Writes at a position below
`length` overwrite it, which is how trim, rollback and the spec's authoritative
`pos_start` (auto-align) all work without copying.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import ContextOverflowError

INITIAL_CAPACITY = 256


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """A copy of the first `num_tokens` positions (for the prefix cache)."""

    k: torch.Tensor  # [layers, kv_heads, num_tokens, head_dim]
    v: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_tokens: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.max_tokens = max_tokens
        self.length = 0
        self._shape = (num_layers, num_kv_heads, head_dim)
        self._dtype, self._device = dtype, torch.device(device)
        self.k = self._empty(min(INITIAL_CAPACITY, max_tokens))
        self.v = self._empty(min(INITIAL_CAPACITY, max_tokens))
        self._checkpoints: dict[int, int] = {}  # checkpoint id -> length it restores
        self._next_checkpoint = 0
        # (what a kernel reads of k and v: their addresses and capacity; the arguments built
        # from them), kept while those stay (layers.decode_rows)
        self.kernel_view: tuple | None = None

    def _empty(self, capacity: int) -> torch.Tensor:
        layers, heads, head_dim = self._shape
        return torch.empty(layers, heads, capacity, head_dim, dtype=self._dtype, device=self._device)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def reserve(self, start: int, num_tokens: int) -> None:
        """Make room to write positions [start, start + num_tokens)."""
        if start > self.length:
            raise ValueError(f"Expected a write at position <= {self.length} (the cache length), got {start}")
        end = start + num_tokens
        if end > self.max_tokens:
            raise ContextOverflowError(
                f"Session needs {end} positions but its context size is {self.max_tokens}. "
                f"Fix: shorten the prompt or max_tokens, or raise --ctx-size."
            )
        for cp_id, cp_length in list(self._checkpoints.items()):
            if start < cp_length:  # the write clobbers what this checkpoint would restore
                del self._checkpoints[cp_id]
        if end > self.capacity:
            capacity = min(self.max_tokens, max(end, 2 * self.capacity))
            k, v = self._empty(capacity), self._empty(capacity)
            k[:, :, : self.length] = self.k[:, :, : self.length]
            v[:, :, : self.length] = self.v[:, :, : self.length]
            self.k, self.v = k, v

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [kv_heads, n, head_dim] at [start, start+n); return the keys
        and values for positions [0, start+n). Call reserve() first."""
        end = start + k.shape[1]
        keys, values = self.k[layer], self.v[layer]
        keys.narrow(1, start, k.shape[1]).copy_(k)
        values.narrow(1, start, v.shape[1]).copy_(v)
        return keys.narrow(1, 0, end), values.narrow(1, 0, end)

    def commit(self, length: int) -> None:
        self.length = length

    def truncate(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.length:
            raise ValueError(f"Expected a trim length in [0, {self.length}], got {num_tokens}")
        self.length = num_tokens

    def checkpoint(self) -> int:
        """Remember the current length; rollback() returns to it while no write has
        touched positions below it."""
        cp_id = self._next_checkpoint
        self._next_checkpoint += 1
        self._checkpoints[cp_id] = self.length
        return cp_id

    def rollback(self, checkpoint_id: int) -> None:
        length = self._checkpoints.pop(checkpoint_id, None)
        if length is None:
            raise KeyError(f"Checkpoint {checkpoint_id} is unknown or was overwritten")
        self.length = length  # positions below `length` were not written since

    def release(self, checkpoint_id: int) -> None:
        self._checkpoints.pop(checkpoint_id, None)

    def snapshot(self, num_tokens: int) -> KVSnapshot:
        if not 0 < num_tokens <= self.length:
            raise ValueError(f"Expected a snapshot length in [1, {self.length}], got {num_tokens}")
        return KVSnapshot(self.k[:, :, :num_tokens].clone(), self.v[:, :, :num_tokens].clone())

    def restore(self, snapshot: KVSnapshot) -> None:
        """Replace this session's contents with the snapshot's prefix."""
        n = snapshot.num_tokens
        self._checkpoints.clear()
        self.length = 0
        self.reserve(0, n)
        self.k[:, :, :n] = snapshot.k.to(self._device, self._dtype)
        self.v[:, :, :n] = snapshot.v.to(self._device, self._dtype)
        self.length = n

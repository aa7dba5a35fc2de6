"""A slice while its tensors arrive: resumable, and never mistaken for a finished one.

`<slice>.partial` is laid out as the finished file (header first, each tensor at its
offset), and `<slice>.progress` is a log of 12-byte records (the tensor's position in the
layout, how many of its bytes are written), appended after each write. A record never
claims bytes that were not written first, so a stage killed at any moment resumes from the
last record of each tensor. A tensor counts as done only once its digest matched; the file
takes its final name (`finish`) only when every tensor has, so nothing partial is loaded.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

from .errors import ModelLoadError
from .slice import SliceLayout
from .source import DIGEST, HASH_STEP

RECORD = struct.Struct("<IQ")  # tensor position in the layout, bytes of it written


class SliceIntegrityError(ModelLoadError):
    """A tensor's bytes do not match the holder's digest for it."""


class PartialSlice:
    def __init__(self, target: Path, layout: SliceLayout):
        """Resume the partial file of `target` if it was laid out as `layout`, else start it afresh.
        Bytes kept from an earlier try are hashed again before they count."""
        self.target, self.layout = target, layout
        self.path = target.with_name(target.name + ".partial")
        self.journal_path = target.with_name(target.name + ".progress")
        target.parent.mkdir(parents=True, exist_ok=True)
        self.done = [0] * len(layout.tensors)  # bytes written, per tensor
        self.resumed_bytes = 0                  # of them, what an earlier try wrote
        if self._same_layout():
            self._replay()
        else:
            with self.path.open("wb") as handle:
                handle.write(layout.header)
                handle.truncate(layout.size)  # sparse until written
            self.journal_path.write_bytes(b"")
        self._fd = os.open(self.path, os.O_RDWR)
        self._journal = os.open(self.journal_path, os.O_WRONLY | os.O_APPEND)
        self._hashes = [hashlib.new(DIGEST) for _ in layout.tensors]
        for position, done in enumerate(self.done):
            if done:
                self._rehash(position)

    def _same_layout(self) -> bool:
        try:
            if self.path.stat().st_size != self.layout.size or not self.journal_path.exists():
                return False
            with self.path.open("rb") as handle:
                return handle.read(len(self.layout.header)) == self.layout.header
        except OSError:
            return False

    def _replay(self) -> None:
        log = self.journal_path.read_bytes()
        for at in range(0, len(log) - len(log) % RECORD.size, RECORD.size):  # a torn last record: ignored
            position, done = RECORD.unpack_from(log, at)
            if position < len(self.done) and done <= self.layout.tensors[position].n_bytes:
                self.done[position] = done

    def _rehash(self, position: int) -> None:
        """Hash what an earlier try wrote of a tensor; a finished one whose bytes changed starts over."""
        tensor, done = self.layout.tensors[position], self.done[position]
        for at in range(0, done, HASH_STEP):
            self._hashes[position].update(os.pread(self._fd, min(HASH_STEP, done - at), tensor.offset + at))
        if done == tensor.n_bytes and self._hashes[position].digest() != tensor.digest:
            self._restart(position)
        self.resumed_bytes += self.done[position]

    def _restart(self, position: int) -> None:
        self.done[position] = 0
        self._hashes[position] = hashlib.new(DIGEST)
        os.write(self._journal, RECORD.pack(position, 0))

    @property
    def bytes_done(self) -> int:
        return sum(self.done)

    def missing(self) -> list[tuple[int, int]]:
        """(position in the layout, first byte not written) of every tensor not done yet."""
        return [(i, done) for i, (t, done) in enumerate(zip(self.layout.tensors, self.done)) if done < t.n_bytes]

    def write(self, position: int, offset: int, data) -> None:
        """The next bytes of a tensor. Its last ones check its digest: SliceIntegrityError names it
        (and the tensor starts over on the next try)."""
        tensor = self.layout.tensors[position]
        if offset != self.done[position] or offset + len(data) > tensor.n_bytes:
            raise ValueError(f"tensor {tensor.name}: expected bytes from {self.done[position]}, got "
                             f"[{offset}, {offset + len(data)}) of {tensor.n_bytes}")
        os.pwrite(self._fd, data, tensor.offset + offset)
        self._hashes[position].update(data)
        done = offset + len(data)
        if done == tensor.n_bytes and (found := self._hashes[position].hexdigest()) != tensor.digest.hex():
            self._restart(position)
            raise SliceIntegrityError(f"tensor {tensor.name} arrived corrupt: its bytes do not match the holder's "
                                      f"digest ({DIGEST} {tensor.digest.hex()[:16]}..., got {found[:16]}...); "
                                      f"refused, nothing of it is kept")
        self.done[position] = done
        os.write(self._journal, RECORD.pack(position, done))

    def finish(self) -> Path:
        """Every tensor done and checked: the file takes its final name, the log goes."""
        if self.missing():
            raise ValueError(f"{len(self.missing())} tensors of {self.target.name} are not complete")
        os.fsync(self._fd)
        self.close()
        self.path.replace(self.target)
        self.journal_path.unlink(missing_ok=True)
        directory = os.open(self.target.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself survives a crash
        finally:
            os.close(directory)
        return self.target

    def close(self) -> None:
        for fd in (self._fd, self._journal):
            try:
                os.close(fd)
            except OSError:
                pass
        self._fd = self._journal = -1

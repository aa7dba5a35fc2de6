"""Lending an asyncio stream's socket to the runtime's worker, and taking it back.

The one way both lenders do it: a stage connection's lane (lane_loan.py) and stage 0's
prediction-return stream (driver/run_ahead.py). The caller is between frames with nothing
in the StreamReader's buffer. The transport pauses first, so from then on every byte that
arrives is the worker's to read; once the worker gives the socket back, the bytes it read
and did not take go into the StreamReader ahead of anything later, and the transport
resumes. A lender that is cancelled (its connection closing) recalls the loan and waits
for it to end, so the socket never closes while the worker waits on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..runtime.engine import StageRuntime


def has_unread_bytes(reader: asyncio.StreamReader) -> bool:
    # asyncio.StreamReader keeps its unread bytes in _buffer; it has no public accessor
    return bool(reader._buffer)


class StreamLoan:
    def __init__(self, runtime: StageRuntime, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.runtime, self.reader, self.writer = runtime, reader, writer
        self._lent: asyncio.Future | None = None

    @staticmethod
    def can_lend(writer) -> bool:
        """Plain TCP only: a TLS stream's bytes are not the frames."""
        return writer.get_extra_info("sslcontext") is None and writer.get_extra_info("socket") is not None

    async def run(self, key: Hashable, feed, *, stop_reading: Callable[[], Awaitable[None]] | None = None) -> None:
        """Lend the socket until the worker gives it back. `stop_reading`: the caller's own
        reading task, stopped after the pause (it must be waiting between frames)."""
        transport = self.writer.transport
        transport.pause_reading()
        if stop_reading is not None:
            await stop_reading()
        try:
            self._lent = self.runtime.lend(self.writer.get_extra_info("socket").fileno(), key, feed)
        except RuntimeError:  # the runtime is closing, or holds another loan: read on as usual
            self._lent = None
        try:
            rest = b"" if self._lent is None else await asyncio.shield(self._lent)
        except asyncio.CancelledError:
            self.recall()
            await self._lent
            raise
        finally:
            self._lent = None
        if rest:
            self.reader.feed_data(rest)
        transport.resume_reading()

    def recall(self) -> None:
        """End the loan now (the stream is about to close)."""
        if self._lent is not None:
            self.runtime.recall(self._lent)

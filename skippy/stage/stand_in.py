"""What a stand-in for an asyncio.StreamWriter passes straight to the writer it wraps
(link.ConditionedWriter, shared_writer.SharedWriter): each defines its own write and drain."""

from __future__ import annotations

import asyncio


class WriterStandIn:
    def __init__(self, writer: asyncio.StreamWriter):
        self._writer = writer

    def close(self) -> None:
        self._writer.close()

    def is_closing(self) -> bool:
        return self._writer.is_closing()

    async def wait_closed(self) -> None:
        await self._writer.wait_closed()

    def get_extra_info(self, name: str, default=None):
        return self._writer.get_extra_info(name, default)

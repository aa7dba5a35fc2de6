"""Link conditioning, a test knob: frames this process sends arrive late, as over a WAN.

Set once per process (`use`), like its TLS identity; every connection it dials then writes
through a `ConditionedWriter`. Each frame gets a delivery time: now + delay + jitter, no
earlier than the previous frame's (a link keeps order), plus its bytes at the link's rate
after the previous one (the link is busy while it sends), plus a random stall. A task per
connection writes each frame at its time, so the sender is never blocked by the delay, as
with a real wire; only a backlog past MAX_QUEUED_BYTES makes `drain` wait.
"""

from __future__ import annotations

import asyncio
import random
import time

from ..protocol import LinkConditioning
from .stand_in import WriterStandIn

MAX_QUEUED_BYTES = 64 * 1024 * 1024
_conditioning: LinkConditioning | None = None


def use(conditioning: LinkConditioning | None) -> None:
    global _conditioning
    _conditioning = conditioning


def conditioned(writer: asyncio.StreamWriter):
    """`writer`, or a conditioned stand-in for it when this process conditions its links."""
    return writer if _conditioning is None else ConditionedWriter(writer, _conditioning)


class ConditionedWriter(WriterStandIn):
    """The asyncio.StreamWriter calls the protocol uses, with the link's delays in between."""

    def __init__(self, writer: asyncio.StreamWriter, conditioning: LinkConditioning):
        super().__init__(writer)
        self._link = conditioning
        self._random = random.Random(conditioning.seed)
        self._frames: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        self._pending = bytearray()  # one frame's parts, until drain() ends it
        self._queued_bytes, self._last_at = 0, 0.0
        self._room = asyncio.Event()
        self._room.set()
        self._task = asyncio.create_task(self._deliver())

    def write(self, data) -> None:
        self._pending += data

    async def drain(self) -> None:
        """End the frame written since the last drain and schedule it."""
        if self._pending:
            frame, self._pending = bytes(self._pending), bytearray()
            link, now = self._link, time.monotonic()
            at = max(now + (link.delay_ms + self._random.uniform(0, link.jitter_ms)) / 1e3, self._last_at)
            if link.mbps:
                at += len(frame) * 8 / (link.mbps * 1e6)
            if link.stall_p and self._random.random() < link.stall_p:
                at += link.stall_ms / 1e3
            self._last_at = at
            self._queued_bytes += len(frame)
            self._frames.put_nowait((at, frame))
            if self._queued_bytes > MAX_QUEUED_BYTES:
                self._room.clear()
        await self._room.wait()
        if self._task.done() and self._task.exception() is not None:
            raise self._task.exception()

    async def _deliver(self) -> None:
        while True:
            at, frame = await self._frames.get()
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            self._writer.write(frame)
            await self._writer.drain()
            self._queued_bytes -= len(frame)
            if self._queued_bytes <= MAX_QUEUED_BYTES:
                self._room.set()

    def close(self) -> None:
        self._task.cancel()
        super().close()

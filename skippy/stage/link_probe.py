"""The link probe: round-trip time and bandwidth to the next stage, from LinkProbe frames on a
connection dialed as a lane's link is, so it sees what the chain's frames see (docs/protocol.md).

The stage below ACKs a LinkProbe once it has read the whole frame. An empty probe's round trip
is the latency; the rate is that of a burst of large probes, grown until slow start and the
loops' overhead are a small part of it. Noise only ever reads a link slower than it is, so
the rate is the best of several bursts, as TCP BBR filters its samples (one burst read a veth
at 11 Mbit/s while others read 1-3 Gbit/s); the round trip stays a median.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..protocol import MessageKind, ProtocolError, ReplyKind, StageMessage, StageReply, encode_message
from .transport import LinkBroken, Transport, recv_reply, send_all

RTT_PROBES = 7
BURST_FRAMES = 4
BURST_SAMPLES = 3  # bursts at the final size: the best is the rate
FIRST_FRAME_BYTES = 64 * 1024
MAX_FRAME_BYTES = 1 << 20  # filler token ids (a frame may carry 4 MiB): a 4 MiB burst, 0.34 s at 100 Mbit/s
LONG_ENOUGH_S = 0.1
REPLY_TIMEOUT_S = 30.0
DIAL_RETRY_S = 0.5
DIAL_WAIT_S = 120.0


@dataclass(frozen=True, slots=True)
class LinkTimes:
    rtt_s: float
    bytes_per_s: float


async def dial_downstream(transport: Transport, endpoints: str | Sequence[str]) -> socket.socket:
    """A handshaken socket to the first of `endpoints` (a stage, then its standbys) that
    answers, dialing again for up to DIAL_WAIT_S (a stage below may still be loading)."""
    deadline = time.monotonic() + DIAL_WAIT_S
    while True:
        try:
            return (await transport.dial(endpoints))[0]
        except LinkBroken:
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(DIAL_RETRY_S)


async def measure_link(sock: socket.socket, transport: Transport) -> LinkTimes:
    """Round trip and rate of the link a dialed socket (dial_downstream) goes over."""
    conditioner = transport.conditioner()  # frames arrive as late as a lane's would (stage/link.py)

    async def send(frames: list[bytes]) -> None:
        now = time.perf_counter()
        due = [now if conditioner is None else conditioner.deliver_at(len(f), now) for f in frames]
        for at, frame in zip(due, frames):
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            await send_all(sock, frame)

    async def acked() -> StageReply:
        try:
            reply = await asyncio.wait_for(recv_reply(sock), REPLY_TIMEOUT_S)
        except (ProtocolError, OSError, TimeoutError) as error:
            raise LinkBroken(f"link probe: {type(error).__name__}: {error}") from error
        if reply.kind != ReplyKind.Ack:
            raise LinkBroken(f"link probe: expected an Ack, got {reply.kind.name}")
        return reply

    async def round_trip(frames: list[bytes]) -> float:
        started = time.perf_counter()
        sending = asyncio.create_task(send(frames))
        try:
            for _ in frames:
                await acked()
            await sending
        finally:
            sending.cancel()
        return time.perf_counter() - started

    def burst(size: int) -> list[bytes]:
        frame = encode_message(StageMessage(MessageKind.LinkProbe, tokens=np.zeros(size // 4, np.int32)))
        return [frame] * BURST_FRAMES

    empty = encode_message(StageMessage(MessageKind.LinkProbe))
    rtt = statistics.median([await round_trip([empty]) for _ in range(RTT_PROBES)])
    size = FIRST_FRAME_BYTES
    while True:
        elapsed = await round_trip(burst(size))
        if elapsed >= LONG_ENOUGH_S or size >= MAX_FRAME_BYTES:
            break
        size = min(4 * size, MAX_FRAME_BYTES)
    for _ in range(BURST_SAMPLES - 1):
        elapsed = min(elapsed, await round_trip(burst(size)))
    nbytes = BURST_FRAMES * size
    return LinkTimes(rtt, nbytes / max(elapsed - rtt, nbytes / 1e11))  # at most 100 GB/s


async def on_link_probe(ctl, span) -> None:
    """LinkProbe: read whole, so ACKed; not forwarded."""
    ctl.reply(StageReply.ack())

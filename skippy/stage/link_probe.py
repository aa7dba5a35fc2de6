"""The link probe: round-trip time and bandwidth to the next stage, from LinkProbe frames on a
connection dialed as a lane is (the auth token, TLS off loopback, this process's link knob),
so it sees what the chain's own frames see (docs/protocol.md, LinkProbe).

The downstream stage ACKs a LinkProbe once it has read the whole frame, and forwards nothing.
An empty probe's round trip is the link's latency plus both ends' event loops. The rate is
that of a burst of large probes sent back to back, grown until the burst takes long enough
that TCP's slow start and the loops' overhead are a small part of it.

Noise on a busy machine only ever reads a link slower than it is (an end descheduled mid-burst
delivers nothing meanwhile), never faster: as TCP BBR filters its delivery-rate samples, the
rate is the best of several bursts (the round trip, a hop's typical cost, stays a median). One burst
read a veth at 11 Mbit/s while other runs read it at 1-3 Gbit/s, and `auto` then sent q8.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..protocol import MessageKind, ReplyKind, StageMessage, StageReply, read_reply, write_message
from .downstream import LinkBroken, open_connection

RTT_PROBES = 7
BURST_FRAMES = 4
BURST_SAMPLES = 3  # bursts at the final size: the best is the rate
FIRST_FRAME_BYTES = 64 * 1024
MAX_FRAME_BYTES = 1 << 20  # filler token ids (a frame may carry 4 MiB): a 4 MiB burst, 0.34 s at 100 Mbit/s
LONG_ENOUGH_S = 0.1
REPLY_TIMEOUT_S = 30.0
DIAL_RETRY_S = 0.5


@dataclass(frozen=True, slots=True)
class LinkTimes:
    rtt_s: float
    bytes_per_s: float


async def dial_downstream(endpoints: str | Sequence[str], auth_token: str | None, *, wait_s: float = 120.0):
    """(reader, writer) of a connection to the first of `endpoints` (a stage, then its
    standbys) that answers, dialing again for up to `wait_s` (a stage below may still be
    loading). LinkBroken if none answers."""
    endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
    deadline = time.monotonic() + wait_s
    while True:
        for endpoint in endpoints:
            try:
                return await open_connection(endpoint, auth_token=auth_token)
            except LinkBroken as error:
                failure = error
        if time.monotonic() > deadline:
            raise failure
        await asyncio.sleep(DIAL_RETRY_S)


async def measure_link(reader: asyncio.StreamReader, writer) -> LinkTimes:
    """Round trip and rate of the link a dialed connection (dial_downstream) goes over."""
    async def round_trip(frames: list[StageMessage]) -> float:
        started = time.perf_counter()
        for frame in frames:
            await write_message(writer, frame)
        for _ in frames:
            reply = await asyncio.wait_for(read_reply(reader), REPLY_TIMEOUT_S)
            if reply is None or reply.kind != ReplyKind.Ack:
                raise LinkBroken(f"link probe: expected an Ack, got {reply and reply.kind.name}")
        return time.perf_counter() - started

    def burst(size: int) -> list[StageMessage]:
        return [StageMessage(MessageKind.LinkProbe, tokens=np.zeros(size // 4, np.int32))] * BURST_FRAMES

    empty = StageMessage(MessageKind.LinkProbe)
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


async def on_link_probe(conn, msg: StageMessage, span) -> None:
    """LinkProbe: read whole, so ACKed; not forwarded."""
    await conn.reply(StageReply.ack())

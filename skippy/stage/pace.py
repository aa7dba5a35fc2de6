"""A fetch yields to the holder's own frames at the link they share.

A bulk TCP flow keeps a standing queue at its path's bottleneck (a shaper's FIFO, a switch's
buffer), and every frame the holder sends after it waits there: across a veth capped by
`tc tbf` at 100 Mbit/s, stage 0 decoded 0.878-0.895x as fast while it served a fetch, and
0.978x when the same fetch went at the same rate but paced below the link's (bench/fetch.py;
that 2% is the transfer's CPU). So the holder paces a fetch's socket in the kernel
(SO_MAX_PACING_RATE) at HEADROOM of what the link delivered when it last probed: PROBE_S
unpaced, counting the bytes the peer acknowledged (TCP_INFO), then CRUISE_S paced, when the
queue drains; each probe follows a link whose rate changed. Where the kernel has neither
option (not Linux), the fetch runs unpaced.
"""

from __future__ import annotations

import socket
import struct
import time

SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)  # Linux's number; Python names it on few builds
TCPI_BYTES_ACKED = 120   # offset of the u64 tcpi_bytes_acked in Linux's struct tcp_info
TCP_INFO_BYTES = 232
UNPACED = 0xFFFFFFFF     # the kernel's "no limit" for a 32-bit rate
PROBE_S = 1.0
CRUISE_S = 9.0
HEADROOM = 0.9


class Pace:
    def __init__(self, sock):
        """`sock`: the fetch's TCP socket (under TLS too: pacing sees the bytes on the wire)."""
        self.sock = sock
        self.rate: float | None = None  # bytes/s the last probe saw delivered
        self.probing, self.since, self.acked_then = True, time.monotonic(), self._acked()
        self.works = self.acked_then is not None and self._set(UNPACED)

    def tick(self) -> None:
        """After each chunk: end a probe (pace at HEADROOM of what it saw) or a cruise (probe again)."""
        if not self.works:
            return
        now = time.monotonic()
        if self.probing and now - self.since >= PROBE_S:
            acked = self._acked()
            if acked is None:
                return
            self.rate = (acked - self.acked_then) / (now - self.since)
            self.probing, self.since = False, now
            self._set(max(HEADROOM * self.rate, 1.0))
        elif not self.probing and now - self.since >= CRUISE_S:
            self.probing, self.since, self.acked_then = True, now, self._acked()
            self._set(UNPACED)

    def _acked(self) -> int | None:
        try:
            info = self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES)
            return struct.unpack_from("<Q", info, TCPI_BYTES_ACKED)[0]
        except (OSError, AttributeError, struct.error):
            return None

    def _set(self, rate: float) -> bool:
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, struct.pack("=I", min(int(rate), UNPACED)))
            return True
        except OSError:
            return False

"""Link conditioning, a test knob: frames a stage sends arrive late, as over a WAN.

Every channel a stage writes is conditioned: the links it dials, its return streams and the
replies (ACKs, relayed tokens) it sends back up its accepted connections, so a round trip
pays the delay both ways, as on a real link, and a link probe's round trip reads 2 x delay.

Each frame gets a delivery time: now + delay + jitter, no earlier than the previous frame's
(a link keeps order), plus its bytes at the link's rate after the previous one (the link is
busy while it sends), plus a random stall. The channel that writes the frame holds it until
then (stage/channel.py), so the sender is never blocked by the delay, as with a real wire.
Seeded: a run repeats.
"""

from __future__ import annotations

import random

from ..protocol import LinkConditioning


class Conditioner:
    def __init__(self, conditioning: LinkConditioning):
        self.link = conditioning
        self._random = random.Random(conditioning.seed)
        self._last_at = 0.0

    def deliver_at(self, nbytes: int, now: float) -> float:
        """When a frame of `nbytes` written at `now` reaches the far end."""
        link = self.link
        at = max(now + (link.delay_ms + self._random.uniform(0, link.jitter_ms)) / 1e3, self._last_at)
        if link.mbps:
            at += nbytes * 8 / (link.mbps * 1e6)
        if link.stall_p and self._random.random() < link.stall_p:
            at += link.stall_ms / 1e3
        self._last_at = at
        return at

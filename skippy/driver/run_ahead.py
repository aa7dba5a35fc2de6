"""Stage 0 of a chain starts each decode step from its token as the token arrives.

One stream decoding without speculation: the token the final stage returns is the next
step's input unless it ends the request (a stop id, max_tokens, the context's end), and
stage 0's worker can tell that as well as the decoder can (`DecodePlan`). While the
session's prediction-return stream is lent to the worker (runtime/lending.py,
stage/stream_loan.py), the worker reads each token and, when the request goes on, runs
the next step at once and sends its row down; `decode` then finds that step started or
done instead of submitting it. The loop's wake-up, the waiter, the decoder and the submit
leave the chain's path.

The token reaches the loop when that step's forward has ended, not when it starts: the
loop's work for a token (the decoder's, and when served the API's detokenizing and
streaming) then runs while the stages below compute. Handed over at once, that work ran
beside the step's own Python, and the two took turns at the GIL: measured in blocks of 20
tokens alternated in one generation (2 stages on 2 cores), a step ran ahead saved nothing
that way (-33 us) and 439 us this way.

A request that ends some other way (a stop string, a client gone) may have one step run
ahead: `ChainSession.stop` waits for it before Stop goes down the lane, and the final
stage's prediction for it is dropped with the request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from ..protocol import ProtocolError, StageReply
from ..protocol.constants import REPLY_FIXED_BYTES, REPLY_HEADER
from ..protocol.decode_frames import TOKEN_REPLY_BYTES, token_of_reply
from ..protocol.frames import parse_reply_header
from ..runtime.lending import NEED_MORE, Taken


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """When a plain decode loop goes on after a token: what the decoder checks (speculation.py)."""
    stop_ids: Collection[int]
    max_tokens: int
    ctx_size: int

    def continues(self, token: int, position: int, emitted: int) -> bool:
        """Whether, after `token` returns from the step at `position` with `emitted` tokens out
        before it, the decoder decodes `token` at position + 1."""
        return token not in self.stop_ids and emitted + 1 < self.max_tokens and position + 2 <= self.ctx_size


class RunAhead:
    """A session's run-ahead state, shared by the event loop (arm, take, disarm) and stage
    0's worker (feed). `start_step(token, position, decode_step)` builds the step and its
    outgoing frame's send, as `ChainSession._submit` would."""

    def __init__(self, plan: DecodePlan, start_step: Callable[[int, int, int], tuple[Any, Any]],
                 deliver: Callable[[StageReply], None], loop: asyncio.AbstractEventLoop):
        self.plan, self._start_step, self._deliver, self._loop = plan, start_step, deliver, loop
        self._lock = threading.Lock()
        self._armed = False
        self._position = self._emitted = self._decode_step = 0  # of the step whose token comes next
        self._started: dict[int, tuple[int, concurrent.futures.Future]] = {}  # position -> (token, result)

    # -- the event loop -----------------------------------------------------------------------
    def arm(self, position: int, emitted: int, decode_step: int) -> None:
        """The step at `position` (its `decode_step`) is about to go, `emitted` tokens out."""
        with self._lock:
            self._armed = True
            self._position, self._emitted, self._decode_step = position, emitted, decode_step

    def take(self, position: int, token: int) -> concurrent.futures.Future | None:
        """The step the worker started for `token` at `position` (its result: (Timed, send)),
        or None: none was started, the loop runs it."""
        with self._lock:
            started = self._started.pop(position, None)
        if started is None:
            return None
        if started[0] != token:  # the decoder and DecodePlan disagree: a bug, never a guess
            raise RuntimeError(f"run-ahead step at {position} fed token {started[0]}, the decoder {token}")
        return started[1]

    def disarm(self) -> list[concurrent.futures.Future]:
        """Start nothing more; returns the steps still running (Stop waits for them)."""
        with self._lock:
            self._armed = False
            started, self._started = list(self._started.values()), {}
        return [future for _, future in started]

    # -- stage 0's worker ---------------------------------------------------------------------
    def feed(self, buffer: bytearray) -> Taken | object | None:
        """The return stream's bytes: a plain token reply whose request goes on returns its
        step to run (the token goes to the waiter when the step is done); one that ends it
        goes to the waiter now. Any other reply ends the loan (None)."""
        while True:
            if len(buffer) < REPLY_HEADER.size:
                return NEED_MORE
            try:
                size = REPLY_FIXED_BYTES + parse_reply_header(buffer).body_bytes
            except ProtocolError:
                return None
            if size != TOKEN_REPLY_BYTES:
                return None
            if len(buffer) < size:
                return NEED_MORE
            token = token_of_reply(buffer)
            if token is None:
                return None
            del buffer[:size]
            reply = StageReply.token(token)
            taken = self._next(token, reply)
            if taken is not None:
                return taken
            self._loop.call_soon_threadsafe(self._deliver, reply)
            if not buffer:
                return NEED_MORE

    def _next(self, token: int, reply: StageReply) -> Taken | None:
        """The step of `token` when the request goes on (`reply` reaches the loop once it is
        done); None when it does not, or nothing is armed: the caller hands `reply` on."""
        with self._lock:
            if not self._armed:
                return None
            position, emitted, decode_step = self._position, self._emitted, self._decode_step
            if not self.plan.continues(token, position, emitted):
                self._armed = False
                return None
            self._position, self._emitted, self._decode_step = position + 1, emitted + 1, decode_step + 1
            result = concurrent.futures.Future()
            self._started[position + 1] = (token, result)
        try:
            step, send = self._start_step(token, position + 1, decode_step + 1)
        except Exception as error:  # noqa: BLE001 - decode() raises it, as a step of its own would
            result.set_exception(error)
            return None

        def done(error: Exception | None, timed) -> bool:
            # the token reaches the loop now, not as the step starts: the loop's work for it then
            # runs while the stages below compute, not beside this step's Python for the GIL
            self._loop.call_soon_threadsafe(self._deliver, reply)
            if error is not None:
                result.set_exception(error)
                return False
            result.set_result((timed, send))
            return True

        return Taken(step, send, done)

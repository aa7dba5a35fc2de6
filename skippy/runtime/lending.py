"""A socket lent to the runtime's worker: single-stream decode steps without the event loop.

With one stream decoding, every token crosses each stage as: the packet wakes the event
loop, its reader parses the frame and queues it, the connection's task runs the handler,
which submits the step, and the worker wakes to run it. On a 2-stage chain sharing 2
cores that path measured ~250 us a hop (spec of the figures: docs/architecture.md), and
it wakes two threads where one would do. While its lane is the only one decoding, a
connection lends its socket to the worker instead (`IterationScheduler.lend`): when it has
nothing queued, the worker waits on that socket itself, and `feed` turns each frame that
arrives into the step to run at once, sent on by the step's `then` as ever
(stage/shared_writer.py). The first frame that is not such a step (a Stop, a window, a
prompt), any work submitted the usual way, an error or EOF ends the loan: the bytes read
and not taken go back to the event loop's reader, in order, and the connection reads on.

The lender owns the socket's read side only while its transport is paused; the worker
reads it only between the lend and the give-back, so no byte is read twice or lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

NEED_MORE = object()  # feed: the buffer holds no whole frame yet


@dataclass(slots=True)
class Taken:
    """A step `feed` took from the buffer: run as an iteration of `key`'s, then `done`."""
    step: Any
    then: Callable[[Any], None] | None
    done: Callable[[Exception | None, Any], bool]  # (error, Timed): True to keep the loan


@dataclass(slots=True)
class Loan:
    """What the worker holds while a socket is lent (see the module doc)."""
    fd: int
    key: Hashable
    # On the worker, with the bytes read and not yet taken: a Taken (having deleted its
    # frame from the front), NEED_MORE, or None to give the loan back here.
    feed: Callable[[bytearray], Taken | object | None]
    future: asyncio.Future          # settles with the bytes handed back
    loop: asyncio.AbstractEventLoop
    buffer: bytearray = field(default_factory=bytearray)
    recalled: bool = False

    def give_back(self) -> None:
        """On the worker: hand the unread bytes to the lender (its future's result)."""
        rest = bytes(self.buffer)

        def settle() -> None:
            if not self.future.done():
                self.future.set_result(rest)

        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

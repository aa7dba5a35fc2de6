"""Direct prediction return (spec §2.7): the final stage sends tokens straight to stage 0.

* Stage 0 runs a `ReturnListener` with a `PredictionHub` of waiters keyed by
  (request_id, session_id). The driver registers a waiter before it generates.
* At ConfigureGeneration the final stage dials that listener (`ReturnStreams.open`):
  connect (2 s), auth, READY, then one `PredictionReturnOpen` frame naming the key.
  After that only replies flow on the stream, final -> stage 0.
* If the stream cannot be opened, the final stage replies upstream instead, and
  every middle stage relays the reply (the hop-by-hop fallback).
* The stream is the session's (`ReturnStreams`): it is closed on Stop, when a new request
  replaces the session, or when the session's connection ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ..protocol import (
    MessageKind, ProtocolError, StageMessage, StageReply, parse_endpoint, read_message, read_reply,
    server_handshake, write_message, write_reply,
)
from ..runtime.session import SessionKey
from . import tls
from .downstream import CONNECT_TIMEOUT_S, LinkBroken, open_connection
from .shared_writer import SharedWriter
from .stream_loan import StreamLoan, has_unread_bytes

log = logging.getLogger("skippy.stage")

ReturnKey = tuple[int, int]  # (request_id, session_id)
OPEN_TIMEOUT_S = 20.0         # the PredictionReturnOpen frame must follow READY within this


class PredictionHub:
    """Stage 0's waiters: one queue per in-flight request."""

    def __init__(self) -> None:
        self._waiters: dict[ReturnKey, asyncio.Queue] = {}
        self._lenders: dict[ReturnKey, Callable[[], tuple | None]] = {}

    def register(self, key: ReturnKey, queue: asyncio.Queue | None = None,
                 lender: Callable[[], tuple | None] | None = None) -> asyncio.Queue:
        """`lender()`: (runtime, session key, feed) when the key's stream may be lent to stage
        0's worker now (driver/run_ahead.py), else None."""
        queue = self._waiters[key] = asyncio.Queue() if queue is None else queue
        if lender is not None:
            self._lenders[key] = lender
        return queue

    def unregister(self, key: ReturnKey) -> None:
        self._waiters.pop(key, None)
        self._lenders.pop(key, None)

    def loan(self, key: ReturnKey) -> tuple | None:
        lender = self._lenders.get(key)
        return None if lender is None else lender()

    def deliver(self, key: ReturnKey, item: StageReply | Exception) -> bool:
        queue = self._waiters.get(key)
        if queue is None:
            return False
        queue.put_nowait(item)
        return True


class ReturnListener:
    """Stage 0's endpoint for prediction-return streams."""

    def __init__(self, hub: PredictionHub, bind_addr: str = "127.0.0.1:0", *,
                 auth_token: str | None = None):
        self.hub = hub
        self.bind_addr = bind_addr
        self.auth_token = auth_token
        self.num_streams = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> str:
        host, port = parse_endpoint(self.bind_addr, allow_port_zero=True)
        self._server = await tls.start_server(self._serve, host, port, where="stage 0's return listener")
        bound = self._server.sockets[0].getsockname()
        return f"{host}:{bound[1]}" if ":" not in host else f"[{host}]:{bound[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tasks.add(asyncio.current_task())
        key = None
        try:
            await server_handshake(reader, writer, self.auth_token)
            opening = await asyncio.wait_for(read_message(reader), OPEN_TIMEOUT_S)
            if opening is None or opening.kind != MessageKind.PredictionReturnOpen:
                got = "EOF" if opening is None else opening.kind.name
                raise ProtocolError(f"first frame: expected PredictionReturnOpen, got {got}")
            key = (opening.request_id, opening.session_id)
            self.num_streams += 1
            lendable = StreamLoan.can_lend(writer)
            while (reply := await read_reply(reader)) is not None:
                if not self.hub.deliver(key, reply):
                    log.debug("prediction for a finished request dropped")
                if lendable and not has_unread_bytes(reader) and (loan := self.hub.loan(key)) is not None:
                    runtime, session_key, feed = loan
                    await StreamLoan(runtime, reader, writer).run(session_key, feed)
        except (ProtocolError, TimeoutError) as error:
            log.warning("prediction-return stream refused or broken: %s", error)
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            # close() cancels us; ending normally keeps Python 3.11's stream callback from
            # logging the cancellation as an "Exception in callback" traceback
            pass
        finally:
            self._tasks.discard(asyncio.current_task())
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class ReturnStreams:
    """The final stage's open streams back to stage 0: one per session, keyed as the runtime
    keys it, (connection id, session id), and held for the request it was opened for.

    Keyed by the session, not by the (request_id, session_id) stage 0 reads on the stream, so
    a connection owns its streams: no other connection's frames reach or close them, and
    whatever ends or replaces the session ends its stream (a new request on the session id,
    Stop, the connection's end).
    """

    def __init__(self, driver_endpoint: str | None, *, auth_token: str | None = None):
        self.driver_endpoint = driver_endpoint
        self.auth_token = auth_token
        self._streams: dict[SessionKey, tuple[int, SharedWriter | asyncio.StreamWriter]] = {}

    def __len__(self) -> int:
        return len(self._streams)

    async def open(self, key: SessionKey, request_id: int) -> bool:
        """Dial stage 0 for the session's request; False (and the fallback path) if that is
        not possible. A stream the session holds for an earlier request is closed first."""
        held = self._streams.get(key)
        if held is not None and held[0] == request_id:
            return True
        self.close(key)
        if self.driver_endpoint is None:
            return False
        try:
            _, writer = await open_connection(self.driver_endpoint, auth_token=self.auth_token,
                                              timeout_s=CONNECT_TIMEOUT_S)
            await write_message(writer, StageMessage(MessageKind.PredictionReturnOpen,
                                                     request_id=request_id, session_id=key[1]))
        except (LinkBroken, ConnectionError, OSError) as error:
            log.warning("direct prediction return unavailable, relaying upstream: %s", error)
            return False
        self._streams[key] = (request_id, SharedWriter.wrap(writer))
        return True

    def _writer(self, key: SessionKey, request_id: int):
        held = self._streams.get(key)
        return held[1] if held is not None and held[0] == request_id else None

    def writer(self, key: SessionKey, request_id: int) -> SharedWriter | None:
        """The session's stream for `request_id`, when a worker may send on it (plain TCP)."""
        writer = self._writer(key, request_id)
        return writer if isinstance(writer, SharedWriter) else None

    async def send(self, key: SessionKey, request_id: int, reply: StageReply) -> bool:
        """Write a prediction on the session's stream; False if it has none for `request_id`
        (or it broke)."""
        writer = self._writer(key, request_id)
        if writer is None:
            return False
        try:
            await write_reply(writer, reply)
            return True
        except (ConnectionError, OSError) as error:
            log.warning("direct prediction return lost, relaying upstream: %s", error)
            self.close(key)
            return False

    def release_other(self, key: SessionKey, request_id: int) -> None:
        """Close the session's stream unless it is `request_id`'s (a new request replaces it)."""
        held = self._streams.get(key)
        if held is not None and held[0] != request_id:
            self.close(key)

    def close(self, key: SessionKey) -> None:
        held = self._streams.pop(key, None)
        if held is not None:
            held[1].close()

    def close_lane(self, lane_id: int) -> None:
        """Close every stream of one connection's sessions (the connection ended)."""
        for key in [key for key in self._streams if key[0] == lane_id]:
            self.close(key)

    def close_all(self) -> None:
        for key in list(self._streams):
            self.close(key)

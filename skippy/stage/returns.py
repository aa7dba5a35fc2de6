"""Direct prediction return (spec §2.7): the final stage sends tokens straight to stage 0.

At ConfigureGeneration the final stage dials stage 0's `ReturnListener` and sends one
`PredictionReturnOpen` naming (request_id, session_id); then only replies flow, engine to
engine. A stream that cannot open or breaks falls back to relaying up the lanes. The stream
is the session's: Stop, a new request on the session, or the lane's end closes it. The
listener's port also serves the tensor side channel (holder.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ..protocol import MessageKind, ProtocolError, StageMessage, StageReply, encode_message, parse_endpoint
from ..protocol.constants import MESSAGE_HEADER
from ..protocol.decode_frames import read_reply_from
from ..protocol.frames import decode_message_body, parse_message_header
from ..runtime.session import SessionKey
from .channel import Channel
from .engine import Engine
from .holder import TensorHolder, serve_tensors
from .transport import Transport, recv_exactly, send_all

log = logging.getLogger("skippy.stage")

ReturnKey = tuple[int, int]  # (request_id, session_id)


class ReturnStreams:
    """The final stage's streams back to stage 0: dialed on the event loop, written by the
    engine; one per session, keyed (lane id, session id), for the request it was opened for."""

    def __init__(self, engine: Engine, transport: Transport, driver_endpoint: str | None):
        self.engine, self.transport = engine, transport
        self.driver_endpoint = driver_endpoint
        self._streams: dict[SessionKey, tuple[int, Channel]] = {}  # the engine's

    def __len__(self) -> int:
        return len(self._streams)

    async def dial(self, request_id: int, session_id: int):
        """On the event loop: a stream to stage 0 for the request, its opening frame sent, for
        `attach`; None (and the fallback path) when that is not possible."""
        if self.driver_endpoint is None:
            return None
        sock = None
        try:
            sock, _ = await self.transport.dial(self.driver_endpoint)
            await send_all(sock, encode_message(StageMessage(MessageKind.PredictionReturnOpen, request_id=request_id,
                                                             session_id=session_id)))
        except OSError as error:  # LinkBroken too
            if sock is not None:
                sock.close()
            log.warning("direct prediction return unavailable, relaying upstream: %s", error)
            return None
        return sock

    def attach(self, key: SessionKey, request_id: int, sock) -> None:
        """On the engine: the session's stream for `request_id`, written by the engine from now on."""
        self.close(key)
        channel = Channel(self.engine, sock, name=f"return stream {key}", parse=None, on_frame=lambda _: None,
                          on_close=lambda reason, fault: self._lost(key, channel, reason),
                          conditioner=self.transport.conditioner())
        self._streams[key] = (request_id, channel)

    def _lost(self, key: SessionKey, channel: Channel, reason: str) -> None:
        held = self._streams.get(key)
        if held is not None and held[1] is channel:
            del self._streams[key]
            log.warning("direct prediction return lost, relaying upstream: %s", reason)

    # -- on the engine ------------------------------------------------------------------------
    def send(self, key: SessionKey, request_id: int, frame: bytes) -> bool:
        """Write a prediction on the session's stream; False if it has none for `request_id`
        (or it broke)."""
        held = self._streams.get(key)
        if held is None or held[0] != request_id:
            return False
        held[1].send(frame)
        return not held[1].closed

    def close(self, key: SessionKey) -> None:
        held = self._streams.pop(key, None)
        if held is not None:
            held[1].close("closed")

    def close_lane(self, lane_id: int) -> None:
        """Close every stream of one lane's sessions (the lane ended)."""
        for key in [key for key in self._streams if key[0] == lane_id]:
            self.close(key)

    def close_all(self) -> None:
        for key in list(self._streams):
            self.close(key)


class ReturnInbox:
    """Stage 0's return streams, on its engine: each reply goes to its request's handler."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.handlers: dict[ReturnKey, Callable[[StageReply], None]] = {}
        self._channels: set[Channel] = set()
        self.num_streams = 0

    def adopt(self, key: ReturnKey, sock) -> None:
        """On the engine: a return stream for `key` (its opening frame read)."""
        self.num_streams += 1

        def deliver(reply: StageReply) -> None:
            handler = self.handlers.get(key)
            if handler is None:
                log.debug("prediction for a finished request dropped")
            else:
                handler(reply)

        def closed(reason: str, fault: bool) -> None:
            self._channels.discard(channel)
            if fault:
                log.warning("prediction-return stream refused or broken: %s", reason)

        channel = Channel(self.engine, sock, name=f"return stream {key}", parse=read_reply_from,
                          on_frame=deliver, on_close=closed)
        self._channels.add(channel)

    def close_all(self) -> None:
        for channel in list(self._channels):
            channel.close("closed")


class ReturnListener:
    """Stage 0's endpoint for prediction-return streams: handshakes on the event loop, then the
    stream is its engine's (`ReturnInbox`)."""

    def __init__(self, inbox: ReturnInbox, transport: Transport, bind_addr: str = "127.0.0.1:0", *,
                 holder: TensorHolder | None = None):
        """`holder`: serves stage 0's model file to stages that fetch their layers (holder.py)."""
        self.inbox, self.transport, self.bind_addr, self.holder = inbox, transport, bind_addr, holder
        self._listener = None

    async def start(self) -> str:
        host, port = parse_endpoint(self.bind_addr, allow_port_zero=True)
        self._listener = await self.transport.listen(
            host, port, self._opened, where="stage 0's return listener",
            on_tensors=lambda stream: serve_tensors(self.holder, stream, where="stage 0"))
        bound = self._listener.port
        return f"{host}:{bound}" if ":" not in host else f"[{host}]:{bound}"

    async def _opened(self, sock, peer) -> None:
        try:
            async with asyncio.timeout(self.transport.timeouts.handshake_s):
                header = parse_message_header(await recv_exactly(sock, MESSAGE_HEADER.size, "message header"))
                body = await recv_exactly(sock, header.body_bytes, "message body")
            opening = decode_message_body(header, body)
            if opening.kind != MessageKind.PredictionReturnOpen:
                raise ProtocolError(f"first frame: expected PredictionReturnOpen, got {opening.kind.name}")
        except (ProtocolError, TimeoutError) as error:
            log.warning("prediction-return stream refused or broken: %s", error or "no opening frame in time")
            sock.close()
            return
        except OSError:
            sock.close()
            return
        key = (opening.request_id, opening.session_id)
        try:
            await self.inbox.engine.call(lambda: self.inbox.adopt(key, sock))
        except Exception:  # noqa: BLE001 - the engine stopped: nobody to hand it to
            sock.close()

    async def close(self) -> None:
        if self._listener is not None:
            await self._listener.close()
        if self.holder is not None:
            self.holder.close()

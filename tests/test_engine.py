"""The engine thread and its sockets, without a model: commands and events in order, frames
whole and in order over plain TCP and TLS, the downstream link's reply checks (the seed's
"expected downstream ACK")."""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time

import numpy as np
import pytest

from chain_support import run
from skippy.protocol import MessageKind, StageMessage, StageReply, encode_message, encode_reply
from skippy.protocol.decode_frames import MessageReader
from skippy.stage import certificates, tls
from skippy.stage.channel import Channel
from skippy.stage.downlink import DownLink
from skippy.stage.engine import Engine, EngineClosed
from skippy.stage.transport import LinkBroken


class NoModel:
    """A runtime with nothing to run: the engine only moves commands, events and bytes."""

    def run_ready(self):
        return None


async def started_engine() -> Engine:
    engine = Engine(NoModel(), asyncio.get_running_loop(), name="test-engine")
    engine.start()
    return engine


def test_commands_run_on_the_engine_in_order_and_answer_on_the_loop():
    async def main():
        engine = await started_engine()
        try:
            order = []
            results = await asyncio.gather(*(engine.call(lambda i=i: order.append(i) or threading.current_thread().name)
                                             for i in range(20)))
            assert order == list(range(20)) and set(results) == {"test-engine"}
            with pytest.raises(ValueError, match="boom"):
                await engine.call(lambda: (_ for _ in ()).throw(ValueError("boom")))
            fired = asyncio.get_running_loop().create_future()
            await engine.call(lambda: engine.at(time.perf_counter() + 0.05,
                                                lambda: engine.emit(fired.set_result, time.perf_counter())))
            assert await asyncio.wait_for(fired, 5) > 0
        finally:
            await asyncio.to_thread(engine.close)
        with pytest.raises(EngineClosed):
            engine.post(lambda: None)

    run(main())


def timer_lateness(exact: bool, rounds: int = 15) -> list[float]:
    """How late each of `rounds` timers 2.5 ms ahead fired on an idle engine (seconds)."""
    async def main():
        engine = await started_engine()
        try:
            late = []
            for _ in range(rounds):
                fired = asyncio.get_running_loop().create_future()

                def arm(fired=fired):
                    due = time.perf_counter() + 0.0025
                    engine.at(due, lambda: engine.emit(fired.set_result, time.perf_counter() - due), exact=exact)

                await engine.call(arm)
                late.append(await asyncio.wait_for(fired, 5))
            return late
        finally:
            await asyncio.to_thread(engine.close)

    return run(main())


def test_a_timer_fires_on_time_not_at_the_next_whole_millisecond():
    """A WAN knob's frames leave on a timer (stage/channel.py); epoll counts whole milliseconds,
    which fired each one up to 1 ms late (a timer 2.5 ms ahead at ~3 ms). Load only ever
    delays a wake-up, so the best of 15 such timers is the engine's own precision."""
    late = timer_lateness(exact=False)
    assert min(late) >= 0.0 and min(late) < 0.0003, [round(x * 1e3, 3) for x in late]


def test_an_exact_timer_fires_at_its_time_never_before():
    """A WAN knob's timer is exact: the engine wakes early and yields the core until the
    time, so an idle VM's wake-up latency (~0.3 ms here) no longer delays the frame. Never
    early; the best of 15 within 0.05 ms (an inexact timer's best: 0.12-0.13 ms, its median 0.19)."""
    late = timer_lateness(exact=True)
    assert min(late) >= 0.0 and min(late) < 0.00005, [round(x * 1e3, 3) for x in late]


def test_a_timed_wait_that_select_cannot_take_falls_back_to_epoll(monkeypatch):
    """select(2) takes no fd past FD_SETSIZE (1024): the engine's timers then wait in epoll,
    whole milliseconds, and still fire."""
    import types

    from skippy.stage import engine as engine_module

    def refuse(*_):
        raise ValueError("filedescriptor out of range in select()")

    monkeypatch.setattr(engine_module, "select", types.SimpleNamespace(select=refuse))

    async def main():
        engine = await started_engine()
        try:
            fired = asyncio.get_running_loop().create_future()
            await engine.call(lambda: engine.at(time.perf_counter() + 0.005, lambda: engine.emit(fired.set_result, 1)))
            assert await asyncio.wait_for(fired, 5) == 1 and not engine._fine_wait
        finally:
            await asyncio.to_thread(engine.close)

    run(main())


def frames(count: int, width: int = 600) -> list[StageMessage]:
    rows = np.arange(width, dtype=np.float32).reshape(1, width)
    return [StageMessage(MessageKind.DecodeEmbd, pos_start=i, token_count=1, tokens=[i], current_token=i,
                         request_id=3, session_id=1, decode_step=i, source_stage_index=0, activation_rows=1,
                         activation_width=width, activation=(rows + i).data) for i in range(count)]


def tls_pair(tmp_path) -> tuple[ssl.SSLSocket, ssl.SSLSocket]:
    """Two ends of a mutual-TLS connection over a socket pair, handshaken."""
    issued = certificates.issue_certificates(tmp_path / "tls", {"a": "127.0.0.1", "b": "127.0.0.1"})
    a, b = (issued[name].resolved(tmp_path) for name in "ab")
    server_context = tls._contexts(a, ssl.Purpose.CLIENT_AUTH)
    client_context = tls._contexts(b, ssl.Purpose.SERVER_AUTH)
    left, right = socket.socketpair()
    wrapped = {}

    def handshake(name, context, sock, **options):
        wrapped[name] = context.wrap_socket(sock, **options)

    threads = [threading.Thread(target=handshake, args=("server", server_context, left), kwargs={"server_side": True}),
               threading.Thread(target=handshake, args=("client", client_context, right),
                                kwargs={"server_hostname": "127.0.0.1"})]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    return wrapped["server"], wrapped["client"]


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "tls"])
def test_frames_arrive_whole_and_in_order_however_the_bytes_are_cut(secure, tmp_path):
    """A burst of frames, written in pieces of every size: the engine hands each over whole, in
    order; over TLS too, where decrypted bytes wait in the socket where the selector cannot see
    them (`pending()`)."""
    sent = frames(200)
    wire = b"".join(encode_message(m) for m in sent)

    async def main():
        engine = await started_engine()
        ours, theirs = tls_pair(tmp_path) if secure else socket.socketpair()
        got, closed = [], asyncio.get_running_loop().create_future()
        try:
            await engine.call(lambda: Channel(engine, ours, name="test", parse=MessageReader(),
                                              on_frame=got.append,
                                              on_close=lambda reason, fault: engine.emit(closed.set_result,
                                                                                         (reason, fault))))
            cuts = [1, 7, 104, 2500, 3, 65536, 11]
            offset, i = 0, 0
            while offset < len(wire):
                piece = wire[offset:offset + cuts[i % len(cuts)]]
                await asyncio.to_thread(theirs.sendall, piece)
                offset, i = offset + len(piece), i + 1
            await asyncio.to_thread(theirs.sendall, encode_message(sent[0])[:50])  # then a cut frame
            await asyncio.to_thread(theirs.close)
            reason, fault = await asyncio.wait_for(closed, 10)
        finally:
            await asyncio.to_thread(engine.close)
        assert [(m.pos_start, m.current_token, bytes(m.activation)) for m in got] == \
               [(m.pos_start, m.current_token, bytes(m.activation)) for m in sent]
        assert fault and "truncated" in reason

    run(main())


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "tls"])
def test_what_the_socket_will_not_take_goes_later_in_order(secure, tmp_path):
    """10 MB written at once to a peer that reads slowly: nothing blocks the engine, nothing
    is lost or reordered (a TLS write that cannot finish is retried with the same bytes)."""
    chunks = [bytes([i % 251]) * 250_000 for i in range(40)]

    async def main():
        engine = await started_engine()
        ours, theirs = tls_pair(tmp_path) if secure else socket.socketpair()
        try:
            channel = await engine.call(lambda: Channel(engine, ours, name="test", parse=None,
                                                        on_frame=lambda _: None, on_close=lambda *_: None))
            await engine.call(lambda: [channel.send(chunk) for chunk in chunks])
            assert await engine.call(lambda: 1) == 1  # the engine is not blocked

            def read_all() -> bytes:
                theirs.settimeout(20)
                data, want = bytearray(), sum(map(len, chunks))
                while len(data) < want:
                    time.sleep(0.001)
                    data += theirs.recv(65536)
                return bytes(data)

            assert await asyncio.to_thread(read_all) == b"".join(chunks)
        finally:
            await asyncio.to_thread(engine.close)
            theirs.close()

    run(main())


def link_pair(engine: Engine, on_broken) -> tuple[DownLink, socket.socket, list]:
    ours, theirs = socket.socketpair()
    relayed = []
    link = DownLink(engine, ours, endpoint="peer", stage_index=1, max_deferred=3, reply_s=30.0,
                    on_prediction=relayed.append, on_broken=on_broken)
    return link, theirs, relayed


def test_a_control_message_answered_with_a_prediction_breaks_the_link_at_once():
    """The seed's rule ("stop expected downstream ACK"): a prediction where a control message's
    ACK is owed fails the lane with a named reason, not after a 30 s wait; the token a final
    stage relays ahead of its TryRestorePrefillDecode ACK still goes through."""
    async def main():
        engine = await started_engine()
        broken = asyncio.get_running_loop().create_future()
        try:
            link, theirs, relayed = await engine.call(
                lambda: link_pair(engine, lambda reason: engine.emit(broken.set_result, reason)))
            acks = []
            restore = StageMessage(MessageKind.TryRestorePrefillDecode, pos_start=2, token_count=1, tokens=[1, 2, 3],
                                   current_token=3)
            await engine.call(lambda: link.send(restore, acks.append))
            await asyncio.to_thread(theirs.sendall, encode_reply(StageReply.token(42)) + encode_reply(StageReply.ack()))
            await asyncio.sleep(0.2)
            assert [r.predicted for r in relayed] == [42] and len(acks) == 1 and not broken.done()
            await engine.call(lambda: link.send(StageMessage(MessageKind.Stop), acks.append))
            started = time.perf_counter()
            await asyncio.to_thread(theirs.sendall, encode_reply(StageReply.token(7)))
            reason = await asyncio.wait_for(broken, 5)
            assert time.perf_counter() - started < 2
            assert "Stop" in reason and "PredictedToken" in reason and "ACK" in reason
            assert isinstance(acks[-1], LinkBroken)  # the Stop's waiter hears it at once
        finally:
            await asyncio.to_thread(engine.close)

    run(main())

"""A stream written by the event loop and by a worker thread at once keeps every frame whole
and each writer's frames in order, partial sends included (stage/shared_writer.py)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from skippy.protocol import LinkConditioning
from skippy.stage import link
from skippy.stage.shared_writer import SharedWriter, WorkerSend

FRAMES = 60


def frame(tag: bytes, index: int, size: int) -> bytes:
    return b"<" + tag + b"%04d:" % index + bytes([97 + index % 26]) * size + b">"


def parse(stream: bytes) -> list[tuple[bytes, int, int]]:
    """(tag, index, payload size) of every frame; fails on a torn or interleaved one."""
    frames = []
    for piece in stream.split(b">")[:-1]:
        assert piece[:1] == b"<", piece[:20]
        tag, index, payload = piece[1:2], int(piece[2:6]), piece[7:]
        assert payload == bytes([97 + index % 26]) * len(payload), (tag, index)
        frames.append((tag, index, len(payload)))
    return frames


@pytest.mark.parametrize("size", [100, 40_000])  # 40 KB into an 8 KB send buffer: partial sends
def test_frames_from_the_loop_and_a_worker_stay_whole_and_in_order(size):
    async def main() -> bytes:
        received = bytearray()

        async def serve(reader, writer):
            while data := await reader.read(16384):
                received.extend(data)
                await asyncio.sleep(0.0005)  # a slow reader fills the sender's buffer
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, raw = await asyncio.open_connection("127.0.0.1", port)
        raw.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
        writer = SharedWriter.wrap(raw)
        assert isinstance(writer, SharedWriter)
        refused, handed_back = [], []
        write_backlog = writer._write_backlog
        writer._write_backlog = lambda: (handed_back.append(1), write_backlog())

        def worker():
            for i in range(FRAMES):
                while not writer.try_send_now(frame(b"W", i, size)):
                    refused.append(i)  # busy stream: a real step's frame goes the loop's way
                    time.sleep(0.0002)

        thread = threading.Thread(target=worker)
        thread.start()
        for i in range(FRAMES):
            writer.write(frame(b"L", i, size))
            await writer.drain()
            await asyncio.sleep(0.0003)
        while thread.is_alive():
            await asyncio.sleep(0.001)
        for _ in range(200):  # a partial send's rest goes out from the loop
            if writer._backlog is None and not raw.transport.get_write_buffer_size():
                break
            await asyncio.sleep(0.005)
        writer.close()
        await writer.wait_closed()
        for _ in range(400):
            if len(received) >= 2 * FRAMES * (size + 8):
                break
            await asyncio.sleep(0.005)
        server.close()
        return bytes(received), len(handed_back)

    stream, partial_sends = asyncio.run(main())
    if size > 8192:
        assert partial_sends, "the test meant to send frames larger than the socket's buffer in part"
    frames = parse(stream)
    assert [i for tag, i, _ in frames if tag == b"L"] == list(range(FRAMES))
    assert [i for tag, i, _ in frames if tag == b"W"] == list(range(FRAMES))
    assert all(n == size for _, _, n in frames)


def test_a_worker_send_reports_what_went_out():
    async def main():
        got = asyncio.Queue()

        async def serve(reader, writer):
            got.put_nowait(await reader.readexactly(5))

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        _, raw = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        send = WorkerSend(SharedWriter.wrap(raw), lambda result: result.encode())
        await asyncio.to_thread(send, "hello")
        assert send.sent and send.write_s > 0
        assert await asyncio.wait_for(got.get(), 5) == b"hello"
        raw.close()
        too_big = WorkerSend(SharedWriter.wrap(raw), lambda result: b"x" * 100_000)
        too_big("ignored")  # over ONE_WRITE_BYTES, or closed: nothing written, the loop's way
        assert not too_big.sent
        server.close()

    asyncio.run(main())


def test_tls_and_conditioned_links_are_not_shared():
    async def main():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        _, raw = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        link.use(LinkConditioning(delay_ms=1.0))
        try:
            conditioned = link.conditioned(raw)
        finally:
            link.use(None)
        assert SharedWriter.wrap(conditioned) is conditioned
        conditioned.close()
        server.close()

    asyncio.run(main())

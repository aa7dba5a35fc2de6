"""The event loop's socket I/O (stage/transport.py): one socket read and written at once by
two coroutines, as a link probe does (its frames go out while their ACKs come back)."""

from __future__ import annotations

import asyncio
import socket

from skippy.protocol import ReplyKind, StageReply, encode_reply
from skippy.stage.transport import recv_reply, send_all


def test_a_blocked_send_leaves_the_sockets_reader_awake():
    """A send that finds the buffer full waits for the socket to be writable. It once waited for
    readable, took the reader's place in the loop and removed it once done: the link probe's
    ACKs then sat unread until its 30 s timeout (a flaky `--split auto` start-up)."""

    async def main():
        ours, peer = socket.socketpair()
        for sock in (ours, peer):
            sock.setblocking(False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            reader = asyncio.create_task(recv_reply(ours))
            await asyncio.sleep(0.05)  # the reader waits first
            sender = asyncio.create_task(send_all(ours, bytes(4 << 20)))  # the peer reads none yet: it blocks
            await asyncio.sleep(0.05)
            assert not sender.done()
            peer.send(encode_reply(StageReply.ack()))
            reply = await asyncio.wait_for(reader, 5)
            assert reply.kind == ReplyKind.Ack
            received = 0
            while received < 4 << 20:  # now the peer reads: the send finishes
                try:
                    received += len(peer.recv(1 << 20))
                except BlockingIOError:
                    await asyncio.sleep(0.001)
            await asyncio.wait_for(sender, 5)
        finally:
            ours.close()
            peer.close()

    asyncio.run(main())

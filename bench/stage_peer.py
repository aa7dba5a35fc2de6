"""A blocking peer of a live stage, for the fuzz (bench/fuzz_stage.py) and the isolation tests.

It speaks docs/protocol.md from the outside: the auth preamble and READY (§2), frames it is
handed as bytes, replies parsed strictly by the reference decoder (a malformed one raises),
and a close told apart from a reply still owed (a read that times out).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import numpy as np

from skippy.protocol import AuthPreamble, MessageKind, SamplingConfig, StageMessage, encode_message
from skippy.protocol.constants import READY, READY_MAGIC, REPLY_HEADER, STATS_BLOCK, ReplyKind
from skippy.protocol.frames import StageReply, decode_reply_body, parse_reply_header

K = MessageKind


class ReplyOwed(AssertionError):
    """The stage kept the connection open and sent nothing within the timeout."""


@dataclass
class Closed:
    """The stage closed the connection (EOF or a reset) where a reply could have come."""


CLOSED = Closed()


class Peer:
    """One authenticated connection to a stage (`endpoint` "host:port")."""

    def __init__(self, endpoint: str, token: str | None = None, timeout_s: float = 30.0):
        host, port = endpoint.rsplit(":", 1)
        self.sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if token is not None:
            self.sock.sendall(AuthPreamble(token.encode()).encode())
        ready = self._read(READY.size)
        if ready is None or READY.unpack(ready)[0] != READY_MAGIC:
            raise ConnectionError(f"no READY from {endpoint} (token refused?)")

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def send(self, *frames: bytes | StageMessage) -> bool:
        """Write the frames; False when the stage already closed (or reset) the connection."""
        data = b"".join(f if isinstance(f, (bytes, bytearray)) else encode_message(f) for f in frames)
        try:
            self.sock.sendall(data)
            return True
        except OSError:
            return False

    def _read(self, nbytes: int) -> bytes | None:
        data = b""
        try:
            while len(data) < nbytes:
                chunk = self.sock.recv(nbytes - len(data))
                if not chunk:
                    break
                data += chunk
        except TimeoutError:
            if data:
                raise ReplyOwed(f"a reply stopped after {len(data)} of {nbytes} bytes") from None
            raise ReplyOwed("no reply and no close within the timeout") from None
        except (ConnectionResetError, BrokenPipeError):
            pass
        if len(data) < nbytes:
            if data:
                raise AssertionError(f"a reply cut off after {len(data)} of {nbytes} bytes (malformed)")
            return None
        return data

    def reply(self) -> StageReply | Closed:
        """The next reply, decoded (a malformed one raises FrameError), or CLOSED."""
        head = self._read(REPLY_HEADER.size)
        if head is None:
            return CLOSED
        header = parse_reply_header(head)
        body = self._read(STATS_BLOCK.size + header.body_bytes)
        if body is None:
            raise AssertionError("a reply cut off after its header (malformed)")
        return decode_reply_body(header, body)

    def replies_until_close(self) -> list[StageReply]:
        """Half-close, then every reply until the stage closes (ReplyOwed if it never does)."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        out = []
        while not isinstance(reply := self.reply(), Closed):
            out.append(reply)
        return out

    def status(self):
        """This stage's StageStatusReport (GetStageStatus: §5 StageStatus)."""
        self.send(StageMessage(K.GetStageStatus))
        reply = self.reply()
        assert not isinstance(reply, Closed) and reply.kind == ReplyKind.StageStatus, reply
        return reply.status


def rows(n: int, width: int, seed: int, dtype=np.float32) -> memoryview:
    """`n` activation rows of `width`, standard normal, as the wire carries them."""
    return np.random.default_rng(seed).standard_normal((n, width), dtype=np.float32).astype(dtype).data


@dataclass
class Request:
    """A well-formed request to a final stage, as stage 0 would send it: configure, a prompt
    of `prompt_len` rows in one PrefillFinalEmbd, then decode steps fed with each token."""

    session_id: int
    width: int
    sampling: SamplingConfig
    prompt_len: int = 3
    seed: int = 0
    request_id: int | None = None  # None: the session id

    @property
    def ids(self) -> dict:
        request_id = self.session_id if self.request_id is None else self.request_id
        return dict(request_id=request_id, session_id=self.session_id)

    def configure(self) -> StageMessage:
        return StageMessage(K.ConfigureGeneration, sampling=self.sampling, prompt_token_count=self.prompt_len,
                            **self.ids)

    def prompt(self) -> StageMessage:
        n = self.prompt_len
        return StageMessage(K.PrefillFinalEmbd, pos_start=0, token_count=n, tokens=list(range(1, n + 1)),
                            prompt_token_count=n, activation_rows=n, activation_width=self.width,
                            activation=rows(n, self.width, self.seed), **self.ids)

    def decode(self, step: int, token: int) -> StageMessage:
        """Decode step `step` (0-based) feeding `token`."""
        return StageMessage(K.DecodeEmbd, pos_start=self.prompt_len + step, token_count=1, tokens=[token],
                            current_token=token, decode_step=step + 1, prompt_token_count=self.prompt_len,
                            activation_rows=1, activation_width=self.width,
                            activation=rows(1, self.width, self.seed + 1 + step), **self.ids)

    def stop(self) -> StageMessage:
        return StageMessage(K.Stop, **self.ids)


def expect(reply: StageReply | Closed, kind: ReplyKind) -> StageReply:
    assert not isinstance(reply, Closed), f"expected {kind.name}, the stage closed the connection"
    assert reply.kind == kind, f"expected {kind.name}, got {reply.kind.name}"
    return reply


def established(port: int) -> int:
    """TCP connections in ESTABLISHED state whose local port is `port` (this machine's
    /proc/net/tcp and tcp6): a listener's accepted sockets."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as lines:
                next(lines)
                for line in lines:
                    local, state = line.split()[1], line.split()[3]
                    count += state == "01" and int(local.rsplit(":", 1)[1], 16) == port
        except FileNotFoundError:
            pass
    return count

"""The stage's asyncio TCP server: handshake, one task per upstream connection.

Binds loopback unless the config says otherwise. A connection that fails the
auth check or speaks another protocol version is refused with a logged reason;
a malformed frame later on closes that connection only (spec §2.1, §2.11).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket

from ..protocol import PeerEndpoint, ProtocolError, StageConfig, Topology, server_handshake
from ..runtime.engine import StageRuntime
from ..telemetry import Telemetry
from . import tls
from .connection import StageConnection
from .downstream import REPLY_TIMEOUT_S
from .holder import TensorHolder, serve_tensors
from .measure import StageMeasurement
from .prediction_return import ReturnStreams

log = logging.getLogger("skippy.stage")
_connection_ids = itertools.count(1)   # spec §3.1: a fresh id per connection, process-wide


class StageServer:
    def __init__(self, config: StageConfig, runtime: StageRuntime, *,
                 topology: Topology | None = None, driver_endpoint: str | None = None,
                 telemetry: Telemetry | None = None, reply_timeout_s: float = REPLY_TIMEOUT_S):
        """`driver_endpoint` (default: stage 0's endpoint in `topology`) is where the final
        stage dials the direct prediction return."""
        if driver_endpoint is None and topology is not None and len(topology.stages) > 1:
            driver_endpoint = topology.driver_endpoint
        self.config = config
        self.runtime = runtime
        self.telemetry = telemetry or runtime.telemetry
        self.reply_timeout_s = reply_timeout_s
        self.returns = ReturnStreams(driver_endpoint, auth_token=config.auth_token)
        # serves the tensors of the model file it loaded to stages that have none (holder.py)
        self.holder = None if topology is None else TensorHolder(config.model_path, topology,
                                                                  where=f"stage {config.stage_index}")
        self.connections: dict[int, StageConnection] = {}
        self.refusals: list[str] = []      # handshake refusals, newest last (also logged)
        # its forward and its link to the stage below, measured once it is up (measure.py)
        self.measurement = StageMeasurement(
            runtime, activation_dtype=config.activation_dtype, auth_token=config.auth_token,
            downstream=None if config.downstream is None else config.downstream.endpoints)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def endpoint(self) -> str:
        """host:port actually bound (the port is the OS's choice when the config says 0)."""
        if self._server is None:
            raise RuntimeError("the stage server is not started")
        port = self._server.sockets[0].getsockname()[1]
        host = self.config.bind_host
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    async def start(self, sock: socket.socket | None = None) -> str:
        """Listen on the config's bind address, or on `sock` (already bound)."""
        self._server = await tls.start_server(self._accept, self.config.bind_host, self.config.bind_port, sock=sock,
                                              where=f"stage {self.config.stage_index}")  # TLS off loopback
        log.info("stage %d (%s) listening on %s, layers [%d, %d)", self.config.stage_index,
                 self.config.stage_id, self.endpoint, self.config.layer_start,
                 self.config.layer_end)
        self.measurement.start()
        return self.endpoint

    def repoint(self, downstream: PeerEndpoint | None) -> None:
        """Dial `downstream` from now on: the next stage moved (a Ray stage placed on another node).
        Connections that hold a link keep it; a link to a lost stage is broken and its lane re-dialed."""
        if (downstream is None) != (self.config.downstream is None):
            raise ValueError(f"stage {self.config.stage_index}: a final stage cannot gain a downstream, "
                             "nor another stage lose one")
        self.config = self.config.model_copy(update={"downstream": downstream})
        log.warning("stage %d: the next stage is now at %s", self.config.stage_index,
                    ", ".join(downstream.endpoints) if downstream else "none")

    async def serve_forever(self) -> None:
        if self._server is None:
            await self.start()
        await self._server.serve_forever()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        conn_id = next(_connection_ids)
        peer = writer.get_extra_info("peername")
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            tensors = await server_handshake(reader, writer, self.config.auth_token)
        except (ProtocolError, ConnectionError, OSError) as error:
            reason = f"{type(error).__name__}: {error}"
            self.refusals.append(reason)
            log.warning("stage %d: refused connection %d from %s: %s", self.config.stage_index,
                        conn_id, peer, reason)
            writer.close()
            self._tasks.discard(task)
            return
        if tensors:  # the side channel: a stage fetching its layers, not a lane (holder.py)
            with contextlib.suppress(asyncio.CancelledError):  # the server is closing
                await serve_tensors(self.holder, reader, writer, f"stage {self.config.stage_index}")
            self._tasks.discard(task)
            return
        connection = self.connections[conn_id] = StageConnection(self, conn_id, reader, writer)
        try:
            await connection.run()
        except asyncio.CancelledError:
            pass  # the server is closing; asyncio 3.11's stream callback mishandles a re-raise
        finally:
            self.connections.pop(conn_id, None)
            self._tasks.discard(task)

    async def close(self, *, abort: bool = False) -> None:
        """Stop listening and end every connection (abort: drop them like a crash would)."""
        if self._server is not None:
            self._server.close()
        await self.measurement.close()
        for connection in list(self.connections.values()):
            if abort:
                connection.writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.returns.close_all()
        if self.holder is not None:
            self.holder.close()
        self.runtime.close()

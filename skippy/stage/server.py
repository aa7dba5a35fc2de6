"""A stage's server: the listener and handshakes on the event loop, every lane on the engine.

A connection that passes its handshake (stage/transport.py) is a lane, the engine's for the
rest of its life (stage/lane.py); its control messages come back here (stage/handlers.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket

from ..protocol import PeerEndpoint, StageConfig, Topology
from ..runtime.stage_runtime import StageRuntime
from ..telemetry import Telemetry
from .engine import Engine, EngineClosed
from .handlers import run_control
from .holder import TensorHolder, serve_tensors
from .lane import Lane, LaneControl, LaneEnv, dial_link
from .measure import StageMeasurement
from .returns import ReturnStreams
from .transport import LinkBroken, Listener, Transport

log = logging.getLogger("skippy.stage")
_lane_ids = itertools.count(1)   # spec §3.1: a fresh id per connection


class StageServer:
    def __init__(self, config: StageConfig, runtime: StageRuntime, *, topology: Topology | None = None,
                 telemetry: Telemetry | None = None):
        self.config = config
        self.runtime = runtime
        self.telemetry = telemetry or runtime.telemetry
        # where the final stage dials the direct prediction return: stage 0's endpoint
        self.driver_endpoint = topology.driver_endpoint if topology is not None and len(topology.stages) > 1 else None
        self.transport = Transport.for_stage(config)
        # serves the tensors of the model file it loaded to stages that have none (holder.py)
        self.holder = None if topology is None else TensorHolder(config.model_path, topology,
                                                                  where=f"stage {config.stage_index}")
        self.engine: Engine | None = None
        self.returns: ReturnStreams | None = None
        self.env: LaneEnv | None = None
        # its forward and its link to the stage below, measured once it is up (measure.py)
        self.measurement = StageMeasurement(
            runtime, activation_dtype=config.activation_dtype, transport=self.transport,
            downstream=None if config.downstream is None else config.downstream.endpoints)
        self._listener: Listener | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def endpoint(self) -> str:
        """host:port actually bound (the port is the OS's choice when the config says 0)."""
        if self._listener is None:
            raise RuntimeError("the stage server is not started")
        host = self.config.bind_host
        return f"[{host}]:{self._listener.port}" if ":" in host else f"{host}:{self._listener.port}"

    @property
    def refusals(self) -> list[str]:
        """Handshake refusals, newest last (also logged)."""
        return [] if self._listener is None else self._listener.refusals

    @property
    def lanes(self) -> dict[int, Lane]:
        return {} if self.env is None else self.env.lanes

    async def start(self, sock: socket.socket | None = None) -> str:
        """Start the engine and listen on the config's bind address, or on `sock` (bound, listening)."""
        config = self.config
        self.engine = Engine(self.runtime, asyncio.get_running_loop(), name=f"skippy-stage{config.stage_index}",
                             join_timeout_s=config.timeouts.shutdown_s)
        self.returns = ReturnStreams(self.engine, self.transport, self.driver_endpoint)
        self.env = LaneEnv(config, self.engine, self.runtime, self.telemetry, self.returns, self.transport,
                           self.measurement, control=self._control, needs_link=self._needs_link, ended=self._ended)
        self.engine.on_close(self._close_lanes)
        self.engine.start()
        where = f"stage {config.stage_index}"
        self._listener = await self.transport.listen(
            config.bind_host, config.bind_port, self._adopt, where=where, sock=sock,
            on_tensors=lambda stream: serve_tensors(self.holder, stream, where=where))  # a stage fetching its layers
        log.info("stage %d (%s) listening on %s, layers [%d, %d)", config.stage_index, config.stage_id,
                 self.endpoint, config.layer_start, config.layer_end)
        self.measurement.start(self.engine.call)
        return self.endpoint

    def repoint(self, downstream: PeerEndpoint | None) -> None:
        """Dial `downstream` from now on: the next stage moved (a Ray stage placed on another node).
        Connections that hold a link keep it; a link to a lost stage is broken and its lane re-dialed."""
        if (downstream is None) != (self.config.downstream is None):
            raise ValueError(f"stage {self.config.stage_index}: a final stage cannot gain a downstream, "
                             "nor another stage lose one")
        self.config = self.config.model_copy(update={"downstream": downstream})
        if self.env is not None:  # the lanes (re-)dial what their env's config names
            self.env.config = self.config
        log.warning("stage %d: the next stage is now at %s", self.config.stage_index,
                    ", ".join(downstream.endpoints) if downstream else "none")

    async def serve_forever(self) -> None:
        if self._listener is None:
            await self.start()
        await asyncio.Event().wait()

    # -- the event loop's part of a lane ---------------------------------------------------------
    async def _adopt(self, sock: socket.socket, peer) -> None:
        """A connection past its handshake: a lane, the engine's from now on."""
        env, lane_id = self.env, next(_lane_ids)

        def open_lane() -> None:
            env.lanes[lane_id] = Lane(env, lane_id, sock, peer)

        try:
            await self.engine.call(open_lane)
        except EngineClosed:
            sock.close()

    def _control(self, ctl: LaneControl) -> None:
        self._spawn(run_control(ctl))

    def _needs_link(self, lane: Lane) -> None:
        async def dial() -> None:
            try:
                await dial_link(lane)
            except (LinkBroken, EngineClosed) as error:
                self._post(lambda: lane.fail(error))
                return
            self._post(lane.resume)

        self._spawn(dial())

    def _ended(self, lane: Lane) -> None:
        self.env.lanes.pop(lane.lane_id, None)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _post(self, command) -> None:
        try:
            self.engine.post(command)
        except EngineClosed:
            pass

    # -- the end -------------------------------------------------------------------------------
    def _close_lanes(self) -> None:
        """On the engine, as it stops: every lane and return stream closes."""
        for lane in list(self.env.lanes.values()):
            lane.close()
        self.returns.close_all()

    async def close(self) -> None:
        """Stop listening and end every connection."""
        if self._listener is not None:
            await self._listener.close()
        await self.measurement.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.engine is not None:
            await asyncio.to_thread(self.engine.close)
        if self.holder is not None:
            self.holder.close()
        self.runtime.close()

"""What a stage measures of itself and of its link at start, and the codec that reads it.

`StageMeasurement` runs once, at the stage's first quiet moment after start: its forward
(model/probe.py, on the engine thread) and its link below (link_probe.py); StageStatus
carries the result to the split planner and `/v1/stages`. Processes on one machine take
turns with the compute probe (a file lock), or stages sharing cores would measure each
other's forwards too. `LinkCodec` is the wire dtype of each frame sent down (under
`--activation-dtype auto`, chosen from the measured link and forward).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from ..model.probe import ForwardTimes, cpu_share, measure_forward, memory_available
from ..protocol import ActivationDtype, is_loopback, parse_endpoint
from ..protocol.activation_codec import auto_dtype
from ..protocol.stage_probe import FAILED, StageProbe
from .link_probe import LinkTimes, dial_downstream, measure_link
from .transport import LinkBroken, Transport

log = logging.getLogger("skippy.stage")

PROBE_LOCK = Path(tempfile.gettempdir()) / "skippy-probe.lock"
CHUNK_ROWS = 64      # the prompt chunk the probe times (with one row, a forward's cost is affine in rows)
LOCK_POLL_S = 0.05
QUIET_S = 0.5        # no session open this long: the probe may take the engine
LINK_TRIES = 3       # a link probe that fails (a stage below busy past the reply timeout, a reset) is tried again
LINK_RETRY_S = 0.25  # before the second try; doubled before each next


class LinkCodec:
    """The dtype of the rows this stage sends downstream, frame by frame."""

    def __init__(self, setting: str, width: int, *, loopback: bool = False):
        self.setting, self.width, self.loopback = setting, width, loopback
        self.forward: ForwardTimes | None = None  # this stage's own, measured
        self.link: LinkTimes | None = None        # to the stage below, measured

    def dtype_for(self, rows: int) -> ActivationDtype:
        if self.setting != "auto":
            return ActivationDtype[self.setting]
        # A loopback link costs a copy, whatever a probe on a busy machine reads: f32 keeps a
        # chain on one machine bit for bit one process's (a probe under load read it slow, and
        # greedy text then changed with the machine's load).
        if self.loopback or self.forward is None or self.link is None:
            return ActivationDtype.f32  # until measured: as a chain always sent them
        return auto_dtype(rows, self.width, self.link.bytes_per_s, self.compute_s(rows))

    def compute_s(self, rows: int) -> float:
        """This stage's forward of `rows` rows, affine between the probe's one row and chunk."""
        f = self.forward
        return f.row_s + (rows - 1) * (f.chunk_s - f.row_s) / (f.chunk_rows - 1)


class StageMeasurement:
    def __init__(self, runtime, *, activation_dtype: str, downstream: str | Sequence[str] | None,
                 transport: Transport):
        """`runtime`: the stage's StageRuntime; `downstream`: the next stage's endpoints (its
        own, then its standbys'), None on the final stage; `transport`: how its lanes dial."""
        self.downstream = [downstream] if isinstance(downstream, str) else downstream
        self.runtime, self.transport = runtime, transport
        self.codec = LinkCodec(activation_dtype, runtime.model.args.hidden_size, loopback=bool(self.downstream) and all(
            is_loopback(parse_endpoint(endpoint)[0]) for endpoint in self.downstream))
        self._cpu_share_milli = round(cpu_share() * 1000)
        self._task: asyncio.Task | None = None
        self.failed = False  # the measurement ended without its figures: the probe says so (FAILED)
        self.done = asyncio.Event()

    def start(self, call: Callable[[Callable[[], object]], Awaitable[object]]) -> None:
        """`call`: runs a function on the thread that owns the model (the engine's `call`)."""
        self._task = asyncio.create_task(self._run(call))

    async def _run(self, call) -> None:
        try:
            if self.downstream:  # the stage below may still be loading: wait until it answers
                (await dial_downstream(self.transport, self.downstream)).close()
            await self._quiet()
            async with _machine_turn():  # a link probe's bytes cost CPU too
                model = self.runtime.model
                self.codec.forward = await call(lambda: measure_forward(model, CHUNK_ROWS))
                if self.downstream:
                    self.codec.link = await self._measure_link()
            probe = self.probe
            log.info("stage measured: decode row %.2f ms, %d-row chunk %.1f ms, link rtt %.2f ms %.0f Mbit/s, "
                     "sends %s rows / %s chunks", probe.row_ns / 1e6, probe.chunk_rows, probe.chunk_ns / 1e6,
                     probe.link_rtt_ns / 1e6, probe.link_bytes_per_s * 8 / 1e6,
                     self.codec.dtype_for(1).name, self.codec.dtype_for(CHUNK_ROWS).name)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - a stage serves without its measurements
            self.failed = True  # a planner waiting for them learns it from the probe at once
            log.warning("stage measurement failed: %s: %s", type(error).__name__, error)
        finally:
            self.done.set()

    async def _measure_link(self) -> LinkTimes:
        """The link below, tried LINK_TRIES times: under load one probe can fail (a reply past
        its timeout, a connection reset) where the next one passes."""
        for attempt in range(1, LINK_TRIES + 1):
            sock = None
            try:
                sock = await dial_downstream(self.transport, self.downstream)
                return await measure_link(sock, self.transport)
            except (LinkBroken, OSError) as error:
                if attempt == LINK_TRIES:
                    raise
                delay = LINK_RETRY_S * 2 ** (attempt - 1)
                log.info("link probe failed (%s); trying again in %.2f s", error, delay)
                await asyncio.sleep(delay)
            finally:
                if sock is not None:
                    sock.close()

    async def _quiet(self) -> None:
        """Wait for a moment without sessions: the probe's forwards would delay a request's
        and be timed beside them (a chain that starts with work measures once it is idle)."""
        quiet_since = None
        while True:
            now = asyncio.get_running_loop().time()
            if self.runtime.sessions:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            elif now - quiet_since >= QUIET_S:
                return
            await asyncio.sleep(QUIET_S / 4)

    @property
    def probe(self) -> StageProbe:
        """What is measured so far (0: not yet; FAILED: it will not be)."""
        forward, link, codec = self.codec.forward, self.codec.link, self.codec
        sends = self.downstream is not None
        missing = FAILED if self.failed else 0
        return StageProbe(
            row_ns=missing if forward is None else round(forward.row_s * 1e9),
            chunk_ns=0 if forward is None else round(forward.chunk_s * 1e9),
            chunk_rows=0 if forward is None else forward.chunk_rows,
            row_cpu_ns=0 if forward is None else round(forward.row_cpu_s * 1e9),
            threads=0 if forward is None else forward.threads, cpu_share_milli=self._cpu_share_milli,
            cpu_ns=time.process_time_ns(),
            weight_bytes=self.runtime.model.parameter_bytes, memory_available_bytes=memory_available(),
            link_rtt_ns=(missing if sends else 0) if link is None else round(link.rtt_s * 1e9),
            link_bytes_per_s=0 if link is None else round(link.bytes_per_s),
            row_dtype=int(codec.dtype_for(1)) if sends else -1,
            chunk_dtype=int(codec.dtype_for(CHUNK_ROWS)) if sends else -1)

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is None or task.done():
            return  # (a stage started under another event loop, since closed, ended it there)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@contextlib.asynccontextmanager
async def _machine_turn():
    """This machine's probe lock, polled so a cancelled wait holds nothing."""
    fd = os.open(PROBE_LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(LOCK_POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock

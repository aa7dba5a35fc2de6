"""The engine: one thread per stage process that owns the model, the KV caches and every data socket.

The shape of llama.cpp's server loop and vLLM's EngineCore, one loop: commands from asyncio ->
due timers -> the forward the batch policy picks -> events to asyncio -> wait on every socket
(plain or TLS) and the command pipe. A token crosses a stage with no hand-off between
threads. asyncio keeps the control plane and talks to the engine through two queues only:
`post` (a callable run on this thread, in order) and `emit` (one run on the event loop);
`call` is the pair of them that asyncio awaits. A decode token's event waits for the next
forward (`emit_after_forward`), so the loop's work for it overlaps the stages' compute
(docs/decisions.md).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import os
import select
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from ..runtime.stage_runtime import StageRuntime

T = TypeVar("T")
log = logging.getLogger("skippy.stage")

# An idle vCPU here wakes 0.24-0.35 ms after its timer (a WAN knob's releases, traced), so an
# exact timer wakes this much early and yields the core until its time comes.
EXACT_LEAD_S = 0.0003
_yield = getattr(os, "sched_yield", lambda: None)


class EngineClosed(RuntimeError):
    """The engine has stopped (the stage is shutting down)."""


class Timer:
    __slots__ = ("when", "fn", "cancelled")

    def __init__(self, when: float, fn: Callable[[], None]):
        self.when, self.fn, self.cancelled = when, fn, False

    def cancel(self) -> None:
        self.cancelled = True


class Engine:
    def __init__(self, runtime: StageRuntime, loop: asyncio.AbstractEventLoop, *, name: str = "skippy-engine",
                 join_timeout_s: float = 10.0):
        self.runtime = runtime
        self.name = name
        self.join_timeout_s = join_timeout_s
        self._loop = loop
        self._commands: deque[Callable[[], None]] = deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        # epoll_wait counts whole milliseconds and the selector rounds a wait up: a timer due in
        # 4.1 ms fired at 5 (a WAN knob's frame ~0.35 ms late a hop, measured). select(2) on the
        # epoll fd itself counts microseconds, so a timed wait waits there first (_wait).
        self._fine_wait = isinstance(self._selector, selectors.EpollSelector)
        self._timers: list[tuple[float, int, Timer]] = []
        self._timer_ids = itertools.count()
        # events: (loop, fn) for the end of this turn, and those held until after the next forward
        self._events: list[tuple[asyncio.AbstractEventLoop, Callable[[], None]]] = []
        self._after_forward: list[tuple[asyncio.AbstractEventLoop, Callable[[], None]]] = []
        self._events_lock = threading.Lock()
        self._pending_events: dict[asyncio.AbstractEventLoop, deque[Callable[[], None]]] = {}  # per loop, to drain
        self._sleeping = False
        self._closing = False
        self.num_events = 0  # events handed to the event loop so far (a decode token at stage k > 0 adds none)
        self.closed = False
        self._on_close: list[Callable[[], None]] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    # -- from any thread ------------------------------------------------------------------
    def post(self, command: Callable[[], None]) -> None:
        """Run `command` on the engine thread, after the commands posted before it."""
        if self.closed or self._closing:
            raise EngineClosed("the stage's engine has stopped")
        self._commands.append(command)
        if self._sleeping:
            try:
                self._wake_w.send(b"\0")
            except (BlockingIOError, OSError):
                pass  # a wake-up is already pending, or the engine is gone

    async def call(self, fn: Callable[[], T]) -> T:
        """fn() on the engine thread, in order with the other commands; its result or exception here."""
        future = asyncio.get_running_loop().create_future()
        self.post(_Call(self, fn, future))
        return await future

    # -- on the engine thread -------------------------------------------------------------
    def emit(self, fn: Callable[..., None], *args: Any, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Run fn(*args) on the event loop (`loop`, default the engine's), once this turn ends."""
        self._events.append((loop or self._loop, fn if not args else (lambda: fn(*args))))

    def emit_after_forward(self, fn: Callable[..., None], *args: Any,
                           loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Run fn(*args) on the event loop after the engine's next forward (or its next wait)."""
        self._after_forward.append((loop or self._loop, fn if not args else (lambda: fn(*args))))

    def settle(self, future: asyncio.Future, value: Any) -> None:
        """Set `future` (of whichever loop made it) to `value` at the end of this turn."""
        self._events.append((future.get_loop(), lambda: _settle(future, value, None)))

    def at(self, when: float, fn: Callable[[], None], *, exact: bool = False) -> Timer:
        """fn() on the engine thread at `when` (time.perf_counter); cancel() to forget it.
        `exact`: not later than the wake-up's own latency allows (a WAN knob's frame stands
        for a wire, which is never late): the engine wakes EXACT_LEAD_S early and yields the
        core until `when`."""
        timer = Timer(when, fn)
        heapq.heappush(self._timers, (when - EXACT_LEAD_S if exact else when, next(self._timer_ids), timer))
        return timer

    def watch(self, sock: socket.socket, handler: Callable[[int], None], *, read: bool = True,
              write: bool = False) -> None:
        """handler(event mask) when `sock` is readable (`read`) or writable (`write`); neither: forget it."""
        events = (selectors.EVENT_READ if read else 0) | (selectors.EVENT_WRITE if write else 0)
        if not events:
            self.unwatch(sock)
            return
        try:
            self._selector.modify(sock, events, handler)
        except KeyError:
            self._selector.register(sock, events, handler)

    def unwatch(self, sock: socket.socket) -> None:
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass

    def on_close(self, fn: Callable[[], None]) -> None:
        """fn() on the engine thread as it stops (close the sockets it owns)."""
        self._on_close.append(fn)

    # -- the loop ------------------------------------------------------------------------------
    def _run(self) -> None:
        runtime = self.runtime
        try:
            while True:
                self._run_commands()
                if self._closing:
                    break
                now = time.perf_counter()
                self._run_timers(now)
                held, self._after_forward = self._after_forward, []
                ready_at = runtime.run_ready()  # at most one forward
                if ready_at == 0.0:  # a forward ran: what waited for it goes to the loop now
                    self._events.extend(held)
                    timeout = 0.0
                else:
                    self._after_forward[:0] = held
                    timeout = self._timeout(ready_at)
                    if timeout != 0.0:  # about to wait: nothing is held back any longer
                        self._events.extend(self._after_forward)
                        self._after_forward = []
                self._flush_events()
                self._sleeping = True
                if self._commands:
                    timeout = 0.0
                ready = self._wait(timeout)
                self._sleeping = False
                for key, mask in ready:
                    if key.data is None:
                        self._drain_wake()
                    else:
                        try:
                            key.data(mask)
                        except Exception:  # noqa: BLE001 - one socket's bug must not stop the stage
                            log.exception("%s: a socket handler failed", self.name)
        except Exception:  # noqa: BLE001
            log.exception("%s: the engine stopped on an error", self.name)
        finally:
            self.closed = True
            for fn in self._on_close:
                try:
                    fn()
                except Exception:  # noqa: BLE001
                    log.exception("%s: closing failed", self.name)
            self._events.extend(self._after_forward)
            for command in self._commands:  # whoever waits on them learns the engine is gone
                fail = getattr(command, "fail", None)
                if fail is not None:
                    fail()
            self._commands.clear()
            self._flush_events()
            self._selector.close()
            self._wake_r.close()

    def _run_commands(self) -> None:
        commands = self._commands
        while commands:
            command = commands.popleft()
            try:
                command()
            except Exception:  # noqa: BLE001 - a command's failure is its caller's, never the engine's
                log.exception("%s: a command failed", self.name)

    def _run_timers(self, now: float) -> None:
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, _, timer = heapq.heappop(timers)
            if not timer.cancelled:
                while time.perf_counter() < timer.when:  # an exact timer, woken early: at most EXACT_LEAD_S
                    _yield()
                try:
                    timer.fn()
                except Exception:  # noqa: BLE001
                    log.exception("%s: a timer failed", self.name)

    def _timeout(self, ready_at: float | None) -> float | None:
        timers = self._timers
        while timers and timers[0][2].cancelled:
            heapq.heappop(timers)
        when = ready_at
        if timers and (when is None or timers[0][0] < when):
            when = timers[0][0]
        return None if when is None else max(0.0, when - time.perf_counter())

    def _wait(self, timeout: float | None) -> list:
        """The selector's ready keys, waiting at most `timeout` seconds (None: until one is),
        to the microsecond: a finite wait sleeps in select(2) on the epoll fd, which is
        readable once any socket it watches is, then takes what is ready without waiting."""
        if timeout and self._fine_wait:
            try:
                select.select([self._selector.fileno()], [], [], timeout)
                timeout = 0.0
            except InterruptedError:
                timeout = 0.0
            except ValueError:  # an fd past select's FD_SETSIZE (1024): epoll's milliseconds, then
                self._fine_wait = False
        return self._selector.select(timeout)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _flush_events(self) -> None:
        if not self._events:
            return
        events, self._events = self._events, []
        self.num_events += len(events)
        wake = []
        with self._events_lock:
            for loop, event in events:
                pending = self._pending_events.get(loop)
                if pending is None:
                    pending = self._pending_events[loop] = deque()
                    wake.append(loop)
                pending.append(event)
        for loop in wake:  # one wake-up a loop, however many events its drain takes
            try:
                loop.call_soon_threadsafe(self._drain_events, loop)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _drain_events(self, loop: asyncio.AbstractEventLoop) -> None:
        """On `loop`: run every event the engine emitted for it, in order."""
        with self._events_lock:
            events = self._pending_events.pop(loop, ())
        for event in events:
            try:
                event()
            except Exception:  # noqa: BLE001
                log.exception("%s: an event failed on the event loop", self.name)

    # -- stopping ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the engine (from the event loop): it closes what it owns and ends its thread."""
        if self.closed or self._closing:
            return
        self._commands.append(_Stop(self))
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass
        if self._thread.is_alive() and not self.on_thread:
            self._thread.join(self.join_timeout_s)
        self._wake_w.close()


class _Call:
    """A command whose outcome settles an asyncio future (Engine.call)."""

    __slots__ = ("engine", "fn", "future")

    def __init__(self, engine: Engine, fn: Callable[[], Any], future: asyncio.Future):
        self.engine, self.fn, self.future = engine, fn, future

    def __call__(self) -> None:
        future = self.future
        try:
            value, error = self.fn(), None
        except Exception as failed:  # noqa: BLE001 - raised where it was asked for
            value, error = None, failed
        self.engine._events.append((future.get_loop(), lambda: _settle(future, value, error)))

    def fail(self) -> None:
        error = EngineClosed("the stage's engine has stopped")
        self.engine._events.append((self.future.get_loop(), lambda: _settle(self.future, None, error)))


class _Stop:
    def __init__(self, engine: Engine):
        self.engine = engine

    def __call__(self) -> None:
        self.engine._closing = True


def _settle(future: asyncio.Future, value: Any, error: Exception | None) -> None:
    if future.done():  # the awaiting task was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)

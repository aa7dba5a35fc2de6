"""Admission control for generations (spec §6.3): lanes, a bounded FIFO queue, a timeout.

A request that could never fit the context is a 400 before it waits (`check_fits`). Then
it takes a free lane or queues; a full queue, or a wait past the admission timeout, is
refused with a Retry-After estimate. A freed lane passes straight to the oldest waiter.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time


class AdmissionError(Exception):
    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFull(AdmissionError):
    pass


class AdmissionTimeout(AdmissionError):
    pass


class ContextTooLong(ValueError):
    """A request that could never fit in one session's context."""


def default_queue_size(num_lanes: int) -> int:
    return min(max(8 * num_lanes, 16), 256)


def check_fits(num_prompt_tokens: int, max_tokens: int | None, ctx_size: int) -> int:
    """The max_tokens to run with: the request's, or what the context leaves when it has none.
    Refusals use OpenAI's (and vLLM's) words, which clients such as LiteLLM and LangChain
    recognise as a context-window error."""
    requested = num_prompt_tokens + (1 if max_tokens is None else max_tokens)
    if requested > ctx_size:
        completion = "at least 1" if max_tokens is None else str(max_tokens)
        raise ContextTooLong(
            f"This model's maximum context length is {ctx_size} tokens. However, you requested {requested} "
            f"tokens ({num_prompt_tokens} in the messages, {completion} in the completion). Please reduce the "
            f"length of the messages or completion."
        )
    return ctx_size - num_prompt_tokens if max_tokens is None else max_tokens


class Admission:
    """At most `max_active` leases at once, at most `max_queue` waiting for one."""

    def __init__(self, max_active: int, max_queue: int | None = None, timeout_s: float = 60.0):
        if max_active < 1:
            raise ValueError(f"Expected a concurrency limit >= 1, got {max_active}")
        self.max_active = max_active
        self.max_queue = default_queue_size(max_active) if max_queue is None else max_queue
        if self.max_queue < 0:
            raise ValueError(f"Expected a queue size >= 0, got {self.max_queue}")
        self.timeout_s = timeout_s  # 0 = wait until the client goes away
        self.num_active = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._mean_lease_s = 1.0  # EWMA of how long a lease is held, for Retry-After

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    def retry_after_s(self) -> int:
        """Seconds until the queue has likely drained by one lane's worth."""
        turns = (self.num_waiting + 1) / self.max_active
        return max(1, math.ceil(turns * self._mean_lease_s))

    async def acquire(self) -> Lease:
        if self.num_active < self.max_active and not self._waiters:
            self.num_active += 1
            return Lease(self)
        if len(self._waiters) >= self.max_queue:
            raise QueueFull(
                f"The server is busy: {self.num_active} generations running and {len(self._waiters)} "
                f"waiting (queue limit {self.max_queue}). Retry later.",
                self.retry_after_s(),
            )
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.timeout_s or None):
                await waiter
        except (TimeoutError, asyncio.CancelledError) as exc:
            is_served = waiter.done() and not waiter.cancelled()  # the lane came just as we gave up
            if isinstance(exc, TimeoutError):
                if is_served:
                    return Lease(self)
                raise AdmissionTimeout(
                    f"No generation lane became free within {self.timeout_s:g} s. Retry later.",
                    self.retry_after_s(),
                ) from None
            if is_served:
                self._release()  # pass it on
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
        return Lease(self)

    def _release(self, held_s: float | None = None) -> None:
        if held_s is not None:
            self._mean_lease_s += 0.25 * (held_s - self._mean_lease_s)
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the lane passes on; num_active stays the same
                return
        self.num_active -= 1


class Lease:
    """One generation lane; release exactly once (or use `async with`)."""

    def __init__(self, admission: Admission):
        self._admission = admission
        self._acquired_at = time.monotonic()
        self._is_released = False

    def release(self) -> None:
        if not self._is_released:
            self._is_released = True
            self._admission._release(time.monotonic() - self._acquired_at)

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.release()

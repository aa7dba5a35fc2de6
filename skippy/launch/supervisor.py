"""Local stage processes kept alive (`skippy serve --stages N`).

Each child stage has a watcher: it waits for the process to exit and asks it for its status
(`GetStageStatus`, the protocol's own health query) every `probe_interval_s`. A stage that
exits, or misses `probe_failures` answers in a row (it is then killed), is started again from
its config on its own port, after a backoff that doubles with each restart in a row (a stage
that stayed up `STABLE_S` starts the count again). Past `max_restarts` in a row the watcher
gives up: the stage stays down, marked "failed" with its last failure, and the API's /readyz
and every request answer 503 naming it.

While a stage is down, requests fail fast with 503 (a lane to it is broken); once it is back,
the next request re-dials its lane. Stage 0 runs in the serving process and is not supervised.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .local_chain import LocalChain

log = logging.getLogger("skippy.launch")

MAX_RESTARTS = 5
PROBE_INTERVAL_S = 1.0
PROBE_FAILURES = 3
BACKOFF_S = 0.5
MAX_BACKOFF_S = 8.0
STABLE_S = 10.0  # up this long, a stage's next failure is a first one again (backoff and budget)


@dataclass(slots=True)
class StageHealth:
    state: str = "ready"    # "ready", "restarting" or "failed" (the restart budget is spent)
    restarts: int = 0       # in all
    in_a_row: int = 0       # restarts since it last stayed up STABLE_S
    last_failure: str = ""  # why it last went down ("" while it never has)


class Supervisor:
    def __init__(self, chain: LocalChain, *, max_restarts: int = MAX_RESTARTS,
                 probe_interval_s: float = PROBE_INTERVAL_S, probe_failures: int = PROBE_FAILURES,
                 backoff_s: float = BACKOFF_S, max_backoff_s: float = MAX_BACKOFF_S):
        self.chain, self.max_restarts = chain, max_restarts
        self.probe_interval_s, self.probe_failures = probe_interval_s, probe_failures
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.health = [StageHealth() for _ in range(chain.num_stages)]  # index 0: stage 0, never down
        self._tasks: list[asyncio.Task] = []

    def can_heal(self) -> bool:
        """False once a stage is down for good: a request waiting for the chain gives up."""
        return all(health.state != "failed" for health in self.health)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._watch(index), name=f"skippy-supervise-{index}")
                       for index in range(1, self.chain.num_stages)]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _watch(self, index: int) -> None:
        health = self.health[index]
        while True:
            up_since = time.monotonic()
            health.last_failure = await self._failure(index)
            if time.monotonic() - up_since >= STABLE_S:
                health.in_a_row = 0
            if health.in_a_row >= self.max_restarts:
                health.state = "failed"
                log.error("stage %d %s; gave up after %d restart(s) in a row. Fix: see its log above, "
                          "then restart skippy serve", index, health.last_failure, health.in_a_row)
                return
            health.state = "restarting"
            delay = min(self.max_backoff_s, self.backoff_s * 2 ** health.in_a_row)
            log.warning("stage %d %s; restarting it in %.1f s (restart %d of %d in a row)", index,
                        health.last_failure, delay, health.in_a_row + 1, self.max_restarts)
            await asyncio.sleep(delay)
            health.restarts += 1
            health.in_a_row += 1
            try:
                await self.chain.restart_stage(index)
            except Exception as error:  # noqa: BLE001 - a failed restart is one more failure
                log.warning("stage %d: restart failed: %s", index, error)
                continue  # its process has exited: the next _failure returns at once
            health.state = "ready"
            log.warning("stage %d is back (restart %d)", index, health.restarts)

    async def _failure(self, index: int) -> str:
        """Wait until stage `index` exits or stops answering; what happened, for the log."""
        process, endpoint = self.chain.processes[index - 1], self.chain.topology.stages[index].endpoint
        misses = 0
        while True:
            try:
                code = await asyncio.wait_for(asyncio.shield(process.wait()), self.probe_interval_s)
                return f"exited with {_describe_exit(code)}"
            except TimeoutError:
                pass
            misses = 0 if await self.chain.client.transport.query_status(endpoint) else misses + 1
            if misses >= self.probe_failures:
                process.kill()
                await process.wait()
                return f"stopped answering status queries ({misses} in a row at {endpoint}; killed)"


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"

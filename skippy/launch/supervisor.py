"""Stages kept alive, wherever they run (placement.py: local processes or Ray actors).

Each stage 1..N-1 has a watcher: it waits for the placement to report the stage down and asks
the stage for its status (`GetStageStatus`, the protocol's own health query) every
`probe_interval_s`. A stage that goes down, or misses `probe_failures` answers in a row (it is
then killed), is started again from its config, after a backoff that doubles with each
restart in a row (a stage that stayed up `STABLE_S` starts the count again). Past
`max_restarts` in a row the watcher gives up: the stage stays down, marked "failed" with its
last failure, and the API's /readyz and every request answer 503 naming it. A stage that comes
back at another address (its Ray node was lost) counts a move. Before a restart the chain may
take it over (`on_down`): under `--split auto`, when the split advice names other ranges, it
starts every stage again on them instead (split_restart.py).

While a stage is down, requests wait for it up to the recovery timeout and replay themselves
onto it (driver/client.py); once it is back, the next request re-dials its lane. Stage 0 runs
in the serving process and is not supervised.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ..protocol import StageStatusReport, parse_endpoint

from ..stage.transport import Transport
from .placement import Placement

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
    endpoint: str = ""      # where it listens now ("" : where the topology says)
    node_ip: str = ""       # the cluster node it runs on ("" when not on a cluster)
    moves: int = 0          # restarts that came back on another host
    last_report: StageStatusReport | None = None  # its last status answer: a dead stage's figures


class Supervisor:
    def __init__(self, placement: Placement, num_stages: int, transport: Transport | None, *,
                 max_restarts: int = MAX_RESTARTS, probe_interval_s: float = PROBE_INTERVAL_S,
                 probe_failures: int = PROBE_FAILURES, backoff_s: float = BACKOFF_S,
                 max_backoff_s: float = MAX_BACKOFF_S, on_back: Callable[[], None] = lambda: None,
                 on_down: Callable[[int], Awaitable[bool]] | None = None):
        """`transport`: how stage 0 reaches the stages (None: plain, no token), for the status
        queries. `on_back`: called when a stage is back (stage 0's waiting requests try the
        chain at once). `on_down(index)`: asked before a restart of stage `index`; True: the
        chain restarted every stage itself, under a new supervisor, and this one is closed."""
        self.placement, self.num_stages, self.transport = placement, num_stages, transport or Transport()
        self.on_back, self.on_down = on_back, on_down
        self.max_restarts = max_restarts
        self.probe_interval_s, self.probe_failures = probe_interval_s, probe_failures
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.health = [StageHealth() for _ in range(num_stages)]  # index 0: stage 0, never down
        self._tasks: list[asyncio.Task] = []

    def can_heal(self) -> bool:
        """False once a stage is down for good: a request waiting for the chain gives up."""
        return all(health.state != "failed" for health in self.health)

    def start(self) -> None:
        for index, health in enumerate(self.health):
            health.endpoint, health.node_ip = self.placement.endpoint(index), self.placement.node_ip(index)
        self._tasks = [asyncio.create_task(self._watch(index), name=f"skippy-supervise-{index}")
                       for index in range(1, self.num_stages)]

    async def close(self) -> None:
        """Stop watching (a watcher that calls this, through `on_down`, ends on its own)."""
        tasks, self._tasks = [t for t in self._tasks if t is not asyncio.current_task()], []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _watch(self, index: int) -> None:
        health = self.health[index]
        while True:
            up_since = time.monotonic()
            health.last_failure = await self._failure(index)
            if time.monotonic() - up_since >= STABLE_S:
                health.in_a_row = 0
            if health.in_a_row >= self.max_restarts:
                health.state = "failed"
                await self.placement.give_up(index)
                log.error("stage %d %s; gave up after %d restart(s) in a row. Fix: see its log above, "
                          "then restart skippy serve", index, health.last_failure, health.in_a_row)
                return
            health.state = "restarting"
            delay = min(self.max_backoff_s, self.backoff_s * 2 ** health.in_a_row)
            log.warning("stage %d %s; restarting it in %.1f s (restart %d of %d in a row)", index,
                        health.last_failure, delay, health.in_a_row + 1, self.max_restarts)
            await asyncio.sleep(delay)
            if self.on_down is not None and await self.on_down(index):
                return
            health.restarts += 1
            health.in_a_row += 1
            try:
                endpoint = await self.placement.restart(index)
            except Exception as error:  # noqa: BLE001 - a failed restart is one more failure
                log.warning("stage %d: restart failed: %s", index, error)
                continue  # it is down: the next _failure returns at once
            moved = parse_endpoint(endpoint)[0] != parse_endpoint(health.endpoint)[0]
            health.moves += moved
            health.endpoint, health.node_ip = endpoint, self.placement.node_ip(index)
            health.state = "ready"
            self.on_back()
            log.warning("stage %d is back (restart %d)%s", index, health.restarts, f" on {endpoint}" * moved)

    async def _failure(self, index: int) -> str:
        """Wait until stage `index` goes down or stops answering; what happened, for the log."""
        down = asyncio.ensure_future(self.placement.wait_down(index))
        try:
            misses = 0
            while True:
                done, _ = await asyncio.wait({down}, timeout=self.probe_interval_s)
                if done:
                    return down.result()
                endpoint = self.placement.endpoint(index)
                report = await self.transport.query_status(endpoint)
                if report is not None:
                    self.health[index].last_report = report
                misses = 0 if report is not None else misses + 1
                if misses >= self.probe_failures:
                    await self.placement.kill(index)
                    return f"stopped answering status queries ({misses} in a row at {endpoint}; killed)"
        finally:
            down.cancel()

"""A restart after a stage's death that applies the chain's split advice (`--split auto`).

When a stage of a `--split auto` chain dies and the advice as it stood then (its last status
answer) names other ranges for the same stages, the supervisor's restart becomes a re-split
through the chain's own `restart_on`, stage 0 included, as a new ChainClient; waiting
requests move to it (ChainClient.hand_over) and the old stage 0 closes once none is on it.
Otherwise the restart is the supervisor's usual one (docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from ..driver.client import ChainClient
from ..tasks import to_the_end

if TYPE_CHECKING:  # local_chain imports this module
    from .local_chain import Chain

log = logging.getLogger("skippy.launch")

RETIRE_POLL_S = 0.1
RETIRE_WAIT_S = 60.0  # a replaced stage 0's requests have moved on by then (they replay at their next try)


def advised_ranges(advice: dict | None, current: list[tuple[int, int]]) -> list[tuple[int, int]] | None:
    """The ranges a restart applies: the advice's, when it has some for as many stages as the
    chain has and they are not `current`; None otherwise."""
    if not advice or "ranges" not in advice:
        return None
    ranges = [(start, end) for start, end in advice["ranges"]]
    if ranges == current:
        return None
    if len(ranges) != len(current):
        log.warning("the split advice uses %d of the %d stages; a restart keeps every stage, on its ranges. "
                    "Fix: restart with fewer --stages (see /v1/stages' split_advice)", len(ranges), len(current))
        return None
    return ranges


async def restart_on_advice(chain: Chain, index: int) -> bool:
    """The supervisor's `on_down`: stage `index` is down. True when the chain started every
    stage again on the advised split; False: restart it as usual."""
    if not chain.apply_split_advice or chain.backend is None:
        return False
    try:
        advice = await chain.backend.split_advice_after_loss()
    except Exception as error:  # noqa: BLE001 - no advice: the usual restart
        log.warning("no split advice for stage %d's restart: %s", index, error)
        return False
    current = [(s.layer_start, s.layer_end) for s in chain.topology.stages]
    ranges = advised_ranges(advice, current)
    if ranges is None:
        return False
    log.warning("stage %d is down; restarting every stage on the advised split: %s -> %s", index,
                _ranges(current), _ranges(ranges))
    old = chain.client
    old.retiring = True  # its requests wait, dialing nothing: a new stage 1 may listen where the old did
    await chain.supervisor.close()  # the other stages' watchers: every stage stops now
    try:
        await chain.restart_on(ranges, lost=index)
    except Exception as error:  # noqa: BLE001 - back to the split that ran
        log.error("the advised split did not start (%s); starting every stage again on %s", error, _ranges(current))
        try:
            await chain.restart_on(current, lost=index)
        except Exception as again:  # noqa: BLE001
            log.error("the chain did not start again either (%s): requests fail until skippy serve restarts", again)
            chain.supervisor.health[index].state = "failed"  # /readyz and /v1/stages name it
            old.can_recover = lambda: False
            old.chain_changed()
            return True
    chain.supervise()
    chain.backend.rebind(chain.client, chain.topology, chain.supervisor.health)
    old.hand_over(chain.client)
    task = asyncio.create_task(_retire(old), name="skippy-retire-stage0")
    chain.retiring.add(task)
    task.add_done_callback(chain.retiring.discard)
    return True


async def _retire(client: ChainClient) -> None:
    """Close a replaced stage 0 once no request holds a lane of it (they moved to its
    successor), or after RETIRE_WAIT_S whatever holds one."""
    try:
        deadline = asyncio.get_running_loop().time() + RETIRE_WAIT_S
        while not client.idle and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(RETIRE_POLL_S)
    finally:
        await to_the_end(_close_quietly(client))


async def _close_quietly(client: ChainClient) -> None:
    try:
        await client.close()
    except Exception as error:  # noqa: BLE001 - it served its last request
        log.warning("the replaced stage 0 did not close cleanly: %s", error)


def _ranges(ranges: list[tuple[int, int]]) -> str:
    return " ".join(f"[{start}, {end})" for start, end in ranges)

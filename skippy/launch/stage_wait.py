"""Stage 0 of a running topology waits for the other stages before it dials its lanes.

A stage with no model file first fetches its layers from stage 0 (stage/fetch.py), so
stage 0 must be up, listening and serving them, before the chain is whole: `skippy serve
--topology` may start first and waits here. A stage that is not listening yet, or listens
but is still loading (no READY), is waited for, at most `wait_s`; one that refuses stage 0
(its token, its certificate) is not, nor is any other then: the chain cannot be whole, and
the lanes fail at once with the reason.
"""

from __future__ import annotations

import asyncio
import time

from ..console import say
from ..protocol import Topology, TopologyStage
from ..stage.transport import LinkBroken, Transport, answers_later

RETRY_S = 1.0
SAY_EVERY_S = 30.0
DIAL_TIMEOUT_S = 2.0


async def wait_for_stages(topology: Topology, wait_s: float, transport: Transport) -> None:
    """Return once every stage after stage 0 answers a dial (with stage 0's `transport`), one
    refuses it, or `wait_s` passed; say every SAY_EVERY_S which stages it waits for, and why."""
    deadline, said = time.monotonic() + wait_s, float("-inf")
    pending = topology.stages[1:]
    while pending:
        try:
            reasons = {stage.stage_id: await _not_up_yet(stage, transport) for stage in pending}
        except _Refused:
            return
        pending = [stage for stage in pending if reasons[stage.stage_id] is not None]
        if not pending or time.monotonic() >= deadline:
            return
        if time.monotonic() - said >= SAY_EVERY_S:
            waiting = "; ".join(f"{stage.stage_id} at {stage.endpoint} ({reasons[stage.stage_id]})"
                                for stage in pending)
            say(f"stage 0 waits for {waiting}")
            said = time.monotonic()
        await asyncio.sleep(RETRY_S)


class _Refused(Exception):
    pass


async def _not_up_yet(stage: TopologyStage, transport: Transport) -> str | None:
    """Why none of the stage's endpoints answers yet, or None: one answers. _Refused: one refuses us."""
    reason = None
    for endpoint in stage.endpoints:
        try:
            sock, _ = await transport.dial(endpoint, connect_s=DIAL_TIMEOUT_S)
        except LinkBroken as error:
            if not answers_later(error):
                raise _Refused from error  # waiting will not help: the lanes say why
            reason = str(error)
            continue
        sock.close()  # a lane with no session: the stage ends it quietly
        return None
    return reason

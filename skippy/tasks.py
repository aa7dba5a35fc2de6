"""The one way cleanup outlives a cancellation (a leaf: imports no skippy code).

A request's Stop, a lane's release, a backend's close must run to their end even when the task
awaiting them is cancelled, or a stage keeps a session nobody will stop. `to_the_end` runs the
cleanup as a task of its own and holds back both kinds of cancellation meanwhile (asyncio's,
edge-triggered: waited out; anyio's scopes, level-triggered: shielded), then lets it through.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

import anyio

T = TypeVar("T")


async def to_the_end(cleanup: Awaitable[T]) -> T:
    """Await `cleanup` to its end, cancelled or not; a cancellation that came meanwhile is
    raised once it has ended (its own exception first, if it failed)."""
    task = asyncio.ensure_future(cleanup)
    cancelled = False
    with anyio.CancelScope(shield=True):
        while not task.done():
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                if task.cancelled():
                    raise
                cancelled = True
    result = task.result()
    if cancelled:
        raise asyncio.CancelledError
    return result

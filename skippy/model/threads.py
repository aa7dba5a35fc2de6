"""Which thread runs parallel work, and why it matters.

libgomp (torch's OpenMP and our kernels alike) gives every thread that opens a parallel
region a team of worker threads of its own, kept until that thread exits. Once a process
holds more such threads than it has cores, libgomp stops letting idle workers spin (100
spins instead of ~300,000) and every one of a decode step's ~150 parallel regions pays a
futex wake-up. Measured on 2 cores with the bundled model: 150 tok/s with load and decode
on one thread, 53 tok/s with the model loaded on one thread and decoded on another (138
with loading on a passing thread, as below).

So a process runs its model on one long-lived thread (the runtime's scheduler, see
runtime/scheduler.py), and one-off parallel work, loading above all, runs on a thread that
exits when it is done and takes its team with it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Callable, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


def on_passing_thread(fn: Callable[..., T], /, *args, **kwargs) -> T:
    """fn(*args, **kwargs) on a new thread that ends with it; its result or exception here."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, fn(*args, **kwargs)))
        except BaseException as error:  # re-raised on the calling thread
            outcome.append((False, error))

    thread = threading.Thread(target=run, name=f"skippy-{getattr(fn, '__name__', 'work')}", daemon=True)
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


# libgomp's idle workers spin ~300,000 pauses (milliseconds here) before they sleep. Stages
# that share one machine's cores take turns on a single stream, so a stage that has
# finished its forward must let the next one have the cores soon: on 2 cores, a 2-stage
# chain with every core per stage decoded 77 tok/s at libgomp's default, 108 at 10,000
# spins, 61 at 1,000 (a step's own gaps outlast that). One process alone keeps the
# default: 10,000 cost it 10% (149 -> 135 tok/s).
CO_LOCATED_SPIN_COUNT = "10000"


def spin_for_co_located_stages() -> None:
    """Shorten libgomp's idle spin for this process and the stage processes it starts,
    unless the user set GOMP_SPINCOUNT. libgomp reads it once, when torch loads it."""
    if "torch" in sys.modules:
        log.warning("GOMP_SPINCOUNT set after torch loaded: it applies to child stages only")
    os.environ.setdefault("GOMP_SPINCOUNT", CO_LOCATED_SPIN_COUNT)

"""What a stage's host gives it, measured: its forward on its own kernels, and the memory it
may still use. The split planner (launch/planner.py) turns these into layer ranges.

Call `measure_forward` on the thread that runs the model (runtime.call): a forward on any
other thread opens a second OpenMP team (model/threads.py) and measures that instead.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .inference import inference_mode
from .llama import Segment, StageModel
from .loader import available_memory_bytes

# The forward of one row is timed for at least this long and by its mean: a host capped by a
# cgroup's CPU quota runs full speed for part of each period and not at all for the rest, and
# only an average over several periods sees the rate it gives.
ROW_SECONDS = 0.25
MIN_ROW_FORWARDS = 8
CHUNK_FORWARDS = 2
DECODE_POSITIONS = 512  # the rows decode after the chunk, then start there again


@dataclass(frozen=True, slots=True)
class ForwardTimes:
    row_s: float    # one decode row through the stage (its logits too on the final stage): the mean
    chunk_s: float  # a prompt chunk of `chunk_rows` rows (and its last row's logits on the final stage)
    chunk_rows: int
    # the process's CPU time per row forward (every thread's, spinning included), and the threads
    # it ran on. A CPU quota (a cgroup's cpu.max) stops the process once a period's share is
    # spent, so back to back the forwards run at the quota's pace: row_s is then the rate it
    # keeps up, and row_cpu_s / threads the speed of one forward (launch/planner.py)
    row_cpu_s: float = 0.0
    threads: int = 1


@inference_mode
def measure_forward(model: StageModel, chunk_rows: int = 64, *, row_seconds: float = ROW_SECONDS,
                    seed: int = 0) -> ForwardTimes:
    """Time the stage's forward on inputs of its own shape (token ids on the first stage,
    random hidden rows elsewhere), in a KV cache of its own: a prompt chunk once to warm up,
    then decode rows after it for `row_seconds`, then the chunk again."""
    generator = torch.Generator().manual_seed(seed)
    cache = model.new_cache(chunk_rows + DECODE_POSITIONS)

    def rows(n: int) -> torch.Tensor:
        if model.layers.is_first:
            return torch.randint(0, model.args.vocab_size, (n,), generator=generator)
        return torch.randn(n, model.args.hidden_size, generator=generator)

    def forward(start: int, n: int) -> None:
        hidden = model.forward(rows(n), [Segment(cache, start, n)])
        if model.layers.is_last:  # the row a step samples (a decode step's layers' call computed it already)
            model.compute_logits(hidden if n == 1 else hidden[-1:])
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)

    forward(0, chunk_rows)  # warm: weights paged in, the thread team up
    count, started, cpu = 0, time.perf_counter(), time.process_time()
    while count < MIN_ROW_FORWARDS or time.perf_counter() - started < row_seconds:
        position = chunk_rows + count % DECODE_POSITIONS
        cache.truncate(position)
        forward(position, 1)
        count += 1
    row_s, row_cpu_s = (time.perf_counter() - started) / count, (time.process_time() - cpu) / count
    started = time.perf_counter()
    for _ in range(CHUNK_FORWARDS):
        cache.truncate(0)
        forward(0, chunk_rows)
    return ForwardTimes(row_s, (time.perf_counter() - started) / CHUNK_FORWARDS, chunk_rows, row_cpu_s,
                        torch.get_num_threads())


def cpu_share() -> float:
    """The cores' worth of CPU time this process may use per second: the cores it may run on,
    within its cgroup's quota (v2 cpu.max; v1 cpu.cfs_quota_us over cpu.cfs_period_us). 0.0:
    unknown, the process is in a cgroup whose files it cannot read (`ip netns exec` mounts a
    sysfs of its own, without the cgroup tree); the planner then takes what the probe's
    forwards got (launch/measured_split.py)."""
    cores = float(len(os.sched_getaffinity(0)))
    unknown = False
    for path, base, v2 in _cgroups("cpu"):
        try:
            if v2:
                quota, period = (base / "cpu.max").read_text().split()
            else:
                quota, period = (base / "cpu.cfs_quota_us").read_text(), (base / "cpu.cfs_period_us").read_text()
            if quota.strip() not in ("max", "-1"):
                cores = min(cores, int(quota) / int(period))
        except (OSError, ValueError):
            unknown = unknown or path.strip() not in ("", "/")  # the root has no quota to read
    return 0.0 if unknown else cores


def memory_available() -> int:
    """Bytes this process may still allocate: the system's MemAvailable, within what its
    cgroup's memory limit leaves (v2 memory.max, v1 memory.limit_in_bytes); 0 if unknown."""
    available = available_memory_bytes()
    left = _cgroup_memory_left()
    candidates = [value for value in (available, left) if value is not None]
    return min(candidates) if candidates else 0


def _cgroup_memory_left() -> int | None:
    for _, base, v2 in _cgroups("memory"):
        limit, usage = ((base / "memory.max", base / "memory.current") if v2
                        else (base / "memory.limit_in_bytes", base / "memory.usage_in_bytes"))
        try:
            text = limit.read_text().strip()
            if text == "max" or int(text) >= 1 << 60:  # no limit (v1 writes a huge number)
                continue
            return max(0, int(text) - int(usage.read_text()))
        except (OSError, ValueError):
            continue
    return None


def _cgroups(controller: str) -> Iterator[tuple[str, Path, bool]]:
    """(its path, its directory, whether v2) of each of this process's cgroups that may hold
    `controller`'s files: the unified hierarchy's, and v1's of that controller."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            yield path, Path("/sys/fs/cgroup") / path.lstrip("/"), True
        elif controller in controllers.split(","):
            yield path, Path("/sys/fs/cgroup") / controller / path.lstrip("/"), False

"""Where a chain's stages 1..N-1 run, behind the one seam the supervisor watches.

* `LocalProcesses`: `skippy stage` child processes on this machine (`skippy serve --stages N`).
* `RayActors` (ray_chain.py): one actor per stage on a Ray cluster's nodes, each running
  `skippy stage` as its child (`skippy serve --ray`).

Both start a stage from its config and report where it listens; the supervisor
(supervisor.py) waits for a stage to go down, restarts it within its budget, or gives up.
A restarted stage may come back at another address (a Ray stage whose node was lost):
`restart` returns where it listens now.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..stage.lifecycle import EXIT_ADDRESS_IN_USE, READY_PREFIX

if TYPE_CHECKING:  # only a type here: the Ray actor imports this module and stays light
    from ..protocol import StageConfig

STARTUP_TIMEOUT_S = 600.0


class PortTaken(RuntimeError):
    pass


class Placement(Protocol):
    def endpoint(self, index: int) -> str:
        """Where stage `index` listens now."""

    def node_ip(self, index: int) -> str:
        """The cluster node stage `index` runs on ("" when not on a cluster)."""

    async def wait_down(self, index: int) -> str:
        """Return once stage `index` is down: why, for the log and /v1/stages."""

    async def kill(self, index: int) -> None:
        """Take a hung stage down (`wait_down` then returns)."""

    async def restart(self, index: int) -> str:
        """Start stage `index` again; its endpoint once it is ready (it may have moved)."""

    async def give_up(self, index: int) -> None:
        """Past its restart budget: leave stage `index` down for good."""


def stage_command(config_path: Path, topology_path: Path, log_level: str) -> list[str]:
    """`skippy stage` for one config, with this Python."""
    return [sys.executable, "-m", "skippy.cli", "--log-level", log_level, "stage",
            "--config", str(config_path), "--topology", str(topology_path)]


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


class LocalProcesses:
    """Stages 1..N-1 as child processes of this one, from config files in `directory`."""

    def __init__(self, directory: Path, configs: list[StageConfig], *, log_level: str):
        self.directory, self.configs, self.log_level = Path(directory), configs, log_level
        self.processes: list[asyncio.subprocess.Process] = []

    def endpoint(self, index: int) -> str:
        return self.configs[index].bind_addr

    def node_ip(self, index: int) -> str:
        return ""

    async def start(self, on_ready) -> None:
        """Start every stage (they load at once), then wait for each in turn."""
        for config in self.configs[1:]:
            self.processes.append(await self._spawn(config.stage_index))
        for config, process in zip(self.configs[1:], self.processes):
            await self._wait_ready(config, process)
            on_ready()

    async def wait_down(self, index: int) -> str:
        return f"exited with {describe_exit(await self.processes[index - 1].wait())}"

    async def kill(self, index: int) -> None:
        process = self.processes[index - 1]
        if process.returncode is None:
            process.kill()
        await process.wait()

    async def restart(self, index: int) -> str:
        """Start stage `index` again from its config, on its own port; returns once it is ready.
        The lanes through it are broken and re-dialed by their next request."""
        process = self.processes[index - 1] = await self._spawn(index)
        await self._wait_ready(self.configs[index], process)
        return self.endpoint(index)

    async def give_up(self, index: int) -> None:
        pass  # its process has exited

    async def _spawn(self, index: int):
        command = stage_command(self.directory / f"stage-{index}.json", self.directory / "topology.json",
                                self.log_level)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # the spin: the config's (StageConfig.omp_spin_count)
        return await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE, env=env)

    async def _wait_ready(self, config: StageConfig, process) -> None:
        async def ready() -> None:
            while line := await process.stdout.readline():
                if line.decode(errors="replace").startswith(READY_PREFIX):
                    return
            code = await process.wait()
            if code == EXIT_ADDRESS_IN_USE:
                raise PortTaken(f"stage {config.stage_index}'s port {config.bind_port} was taken")
            raise RuntimeError(f"stage {config.stage_index} exited with code {code} before it "
                               "was ready (its error is above)")

        try:
            await asyncio.wait_for(ready(), config.timeouts.startup_s)
        except TimeoutError:
            raise RuntimeError(f"stage {config.stage_index} not ready within "
                               f"{config.timeouts.startup_s:g} s") from None

    async def stop(self) -> None:
        for process in self.processes:
            if process.returncode is None:
                process.terminate()
        for process in self.processes:
            try:
                await asyncio.wait_for(process.wait(), 10)
            except TimeoutError:
                process.kill()
                await process.wait()
        self.processes.clear()

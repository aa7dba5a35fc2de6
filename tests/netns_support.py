"""Hosts made on one machine, for tests/test_multihost_netns.py and bench/wan.py, split.py: network
namespaces on a bridge, each with its own address on a veth link, the kernel's `tc tbf` to
cap what a host sends, and a cgroup's CPU quota to make a host slower. Needs root and `ip`/`tc`
(iproute2); this kernel has no netem, so delay and jitter come from skippy's own knob
(stage/link.py), not from here.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str   # IPv4, on `device`
    device: str    # its end of the veth link, inside the namespace


def sh(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True)


@contextmanager
def namespace_hosts(count: int) -> Iterator[list[Host]]:
    """`count` namespaces on one bridge, 10.213.X.1 upwards (X random, so runs side by side
    do not clash); every namespace and the bridge are removed afterwards."""
    tag = secrets.token_hex(2)
    bridge, names = f"skbr{tag}", [f"sk{tag}h{i}" for i in range(count)]
    subnet = f"10.213.{int(tag, 16) % 250}"
    sh("ip", "link", "add", bridge, "type", "bridge")
    sh("ip", "link", "set", bridge, "up")
    try:
        hosts = []
        for i, name in enumerate(names):
            sh("ip", "netns", "add", name)
            sh("ip", "link", "add", f"{name}a", "type", "veth", "peer", "name", f"{name}b")
            sh("ip", "link", "set", f"{name}a", "master", bridge, "up")
            sh("ip", "link", "set", f"{name}b", "netns", name)
            sh("ip", "-n", name, "addr", "add", f"{subnet}.{i + 1}/24", "dev", f"{name}b")
            sh("ip", "-n", name, "link", "set", f"{name}b", "up")
            sh("ip", "-n", name, "link", "set", "lo", "up")
            hosts.append(Host(name, f"{subnet}.{i + 1}", f"{name}b"))
        yield hosts
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def cap_bandwidth(host: Host, mbps: float | None) -> None:
    """What `host` sends leaves at most at `mbps` (a tbf qdisc on its veth end); None: uncapped."""
    if mbps is None:
        subprocess.run(["tc", "-n", host.namespace, "qdisc", "del", "dev", host.device, "root"],
                       capture_output=True)  # none there already is fine
        return
    # the bucket holds at least a 64 KiB GSO segment and the rate's worth of one 4 ms kernel tick
    burst = max(128 * 1024, int(mbps * 1e6 / 8 / 250))
    sh("tc", "-n", host.namespace, "qdisc", "replace", "dev", host.device, "root", "tbf",
       "rate", f"{mbps:g}mbit", "burst", str(burst), "latency", "100ms")


@contextmanager
def cpu_limited(share: float, period_us: int = 20_000) -> Iterator[Path]:
    """A cgroup whose processes get at most `share` of one core: every `period_us` they run
    for share x period_us, then wait for the next period (v2's cpu.max; v1's cpu.cfs_quota_us
    where only v1's cpu controller is mounted, as on this kernel). Yields its cgroup.procs:
    `start_in(..., cgroup=...)` starts a process in it. Removed afterwards."""
    name = f"skippy-{secrets.token_hex(3)}"
    controllers = Path("/sys/fs/cgroup/cgroup.controllers")
    if controllers.exists() and "cpu" in controllers.read_text().split():
        group, limits = Path("/sys/fs/cgroup") / name, {"cpu.max": f"{round(share * period_us)} {period_us}"}
    else:
        group = Path("/sys/fs/cgroup/cpu") / name
        limits = {"cpu.cfs_period_us": str(period_us), "cpu.cfs_quota_us": str(round(share * period_us))}
    group.mkdir()
    try:
        for file, value in limits.items():
            (group / file).write_text(value)
        yield group / "cgroup.procs"
    finally:
        for pid in (group / "cgroup.procs").read_text().split():  # what is left goes back to the root
            try:
                (group.parent / "cgroup.procs").write_text(pid)
            except OSError:
                pass
        group.rmdir()


def run_in(namespace: str, *command: str, **options) -> subprocess.CompletedProcess:
    options.setdefault("timeout", 300)
    return subprocess.run(["ip", "netns", "exec", namespace, *command], capture_output=True, text=True, **options)


def start_in(namespace: str, *command: str, log_path, cgroup: Path | None = None) -> subprocess.Popen:
    """`command` in `namespace` (and in the cgroup whose cgroup.procs is `cgroup`, from its
    first instruction), once it prints a line with "ready" (stderr to `log_path`); its stdout
    is drained from then on. The caller terminates it."""
    return wait_ready(spawn_in(namespace, *command, log_path=log_path, cgroup=cgroup), log_path)


def spawn_in(namespace: str, *command: str, log_path, env: dict | None = None,
             cgroup: Path | None = None) -> subprocess.Popen:
    """`command` in `namespace` (and `cgroup`, as start_in), not waited for (stderr to
    `log_path`; `wait_ready` reads its stdout)."""
    argv = ["ip", "netns", "exec", namespace, *command]
    if cgroup is not None:
        argv = ["sh", "-c", f'echo $$ > {cgroup} && exec "$@"', "sh", *argv]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=open(log_path, "w"), text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def wait_ready(process: subprocess.Popen, log_path) -> subprocess.Popen:
    """`process` once it prints a line with "ready"; its stdout is drained from then on."""
    for line in process.stdout:
        if "ready" in line:
            threading.Thread(target=process.stdout.read, daemon=True).start()
            return process
    raise AssertionError(f"{' '.join(process.args)} exited with {process.wait()}; see {log_path}")


def run_beside(stage: tuple[str, list[str]], client: tuple[str, list[str]], *, log_path,
               cgroup: Path | None = None, timeout: float = 900) -> dict:
    """A bench's round: `stage` = (namespace, command) started (start_in), then `client`
    = (namespace, command) run to its end; the JSON of the client's last stdout line. The
    stage is stopped afterwards."""
    process = start_in(stage[0], *stage[1], log_path=log_path, cgroup=cgroup)
    try:
        asked = run_in(client[0], *client[1], timeout=timeout)
        if asked.returncode != 0:
            raise RuntimeError(f"the client in {client[0]} failed:\n{asked.stderr[-4000:]}")
        return json.loads(asked.stdout.strip().splitlines()[-1])
    finally:
        process.terminate()
        process.wait(timeout=60)

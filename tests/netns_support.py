"""Hosts made on one machine, for tests/test_multihost_netns.py and bench/wan.py --tbf: network
namespaces on a bridge, each with its own address on a veth link, and the kernel's `tc tbf` to
cap what a host sends. Needs root and `ip`/`tc` (iproute2); this kernel has no netem, so delay
and jitter come from skippy's own knob (stage/link.py), not from here.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


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


def run_in(namespace: str, *command: str, **options) -> subprocess.CompletedProcess:
    options.setdefault("timeout", 300)
    return subprocess.run(["ip", "netns", "exec", namespace, *command], capture_output=True, text=True, **options)


def start_in(namespace: str, *command: str, log_path) -> subprocess.Popen:
    """`command` in `namespace`, once it prints a line with "ready" (stderr to `log_path`);
    its stdout is drained from then on. The caller terminates it."""
    return wait_ready(spawn_in(namespace, *command, log_path=log_path), log_path)


def spawn_in(namespace: str, *command: str, log_path, env: dict | None = None) -> subprocess.Popen:
    """`command` in `namespace`, not waited for (stderr to `log_path`; `wait_ready` reads its stdout)."""
    return subprocess.Popen(["ip", "netns", "exec", namespace, *command], stdout=subprocess.PIPE,
                            stderr=open(log_path, "w"), text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def wait_ready(process: subprocess.Popen, log_path) -> subprocess.Popen:
    """`process` once it prints a line with "ready"; its stdout is drained from then on."""
    for line in process.stdout:
        if "ready" in line:
            threading.Thread(target=process.stdout.read, daemon=True).start()
            return process
    raise AssertionError(f"{' '.join(process.args)} exited with {process.wait()}; see {log_path}")

"""A Ray cluster of network-namespace hosts on this machine, for tests/test_ray_chain.py and
bench/ray_recovery.py. Each node is `ray start` in its own namespace with its own address
(netns_support.py), so Ray sees several machines: it would replace a loopback node address
with the machine's own. Nodes are stopped by the pids in their namespace, never with
`ray stop` (which stops every Ray process on the machine). Needs root, iproute2 and Ray.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from netns_support import Host, namespace_hosts

RAY = str(Path(sys.executable).parent / "ray")
GCS_PORT = 6379
STOP_GRACE_S = 3.0  # a stopped node's processes get this long after SIGTERM, then SIGKILL
# the head notices a lost node within ~2 s instead of Ray's default ~15 s (docs/operations.md)
FAST_HEALTH_CHECKS = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "3",
                      "RAY_health_check_timeout_ms": "500"}


@dataclass
class RayCluster:
    hosts: list[Host]          # hosts[0] is the head
    temp: Path                 # each node's Ray session under temp/<index> (short: Ray's socket paths)
    token: str | None          # the cluster's auth token; None: no token authentication
    # a directory the worker nodes do not see (an empty tmpfs over it in their mount namespace):
    # a model file there is on the head only, as on machines that do not share a disk
    hidden_on_workers: Path | None = None
    # each worker node's own skippy cache (SKIPPY_CACHE_DIR=<this>/<node index>), as on separate
    # machines: a stage that fetches its layers finds only what its node fetched
    worker_caches: Path | None = None
    started: list[Host] = field(default_factory=list)

    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def address(self) -> str:
        return f"{self.head.address}:{GCS_PORT}"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a process that uses this cluster (a node, a driver)."""
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1", **extra}
        for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
            env.pop(name, None)
        if self.token is not None:
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token)
        return env

    def start_node(self, index: int, num_cpus: int = 1) -> None:
        """`ray start` on host `index` (the head when 0); returns once the node has joined."""
        host = self.hosts[index]
        command = ["ip", "netns", "exec", host.namespace, RAY, "start", "--node-ip-address", host.address,
                   "--temp-dir", str(self.temp / str(index)), "--disable-usage-stats", "--num-cpus", str(num_cpus)]
        if index == 0:
            command += ["--head", "--port", str(GCS_PORT), "--include-dashboard=false"]
        else:
            command += ["--address", self.address]
        if index > 0 and self.hidden_on_workers is not None:
            # `ip netns exec` gives the command its own mount namespace; the node's raylet and
            # everything it starts (actors, stages) inherit it
            command[4:4] = ["sh", "-c", 'mount -t tmpfs -o size=64k,mode=0755 skippy-hidden "$1" && shift && '
                            'exec "$@"', "sh", str(self.hidden_on_workers)]
        env = self.env(**FAST_HEALTH_CHECKS) if index == 0 else self.env()
        if index > 0 and self.worker_caches is not None:  # the raylet's environment is its workers'
            env["SKIPPY_CACHE_DIR"] = str(self.node_cache(index))
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise AssertionError(f"ray start on {host.address} failed:\n{done.stdout}\n{done.stderr}")
        self.started.append(host)

    def node_cache(self, index: int) -> Path:
        """Worker node `index`'s skippy cache (with `worker_caches`)."""
        return self.worker_caches / str(index)

    def kill_host(self, host: Host, sig: int = signal.SIGKILL) -> list[int]:
        """Signal every process in `host`'s namespace (a lost machine: raylet, agents, actors)."""
        pids = namespace_pids(host)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    def stop(self) -> None:
        """SIGTERM every node's processes, SIGKILL what is left after STOP_GRACE_S (some of
        Ray's helpers outlive a SIGTERM: with 15 s of grace, two clusters' teardown took 30.5 s)."""
        for host in self.started:
            self.kill_host(host, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while any(namespace_pids(host) for host in self.started) and time.monotonic() < deadline:
            time.sleep(0.2)
        for host in self.started:
            self.kill_host(host)


def namespace_pids(host: Host) -> list[int]:
    listed = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True, text=True)
    return [int(pid) for pid in listed.stdout.split()]


def process_in(host: Host, marker: str) -> int | None:
    """The pid of the process in `host`'s namespace whose name (/proc/PID/comm: a stage is
    "skippy-stage", a standby "skippy-standby", warm_stage.py) is `marker`, or whose command line
    contains it."""
    for pid in namespace_pids(host):
        with contextlib.suppress(OSError):
            if marker == Path(f"/proc/{pid}/comm").read_text().strip() or \
                    marker in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                return pid
    return None


@contextlib.contextmanager
def ray_cluster(num_hosts: int, num_nodes: int, *, token: str | None, head_cpus: int = 0,
                hidden_on_workers: Path | None = None, worker_caches: Path | None = None) -> Iterator[RayCluster]:
    """`num_hosts` namespaces; Ray on the first `num_nodes` (the head first, with `head_cpus`
    CPUs; 1 CPU per worker); the rest are for nodes started later (`start_node`). Every Ray
    process is stopped and the namespaces removed afterwards. `hidden_on_workers`: a directory
    only the head sees; `worker_caches`: where each worker node keeps its own skippy cache."""
    temp = Path(tempfile.mkdtemp(prefix="skr"))
    with namespace_hosts(num_hosts) as hosts:
        cluster = RayCluster(hosts, temp, token, hidden_on_workers, worker_caches)
        try:
            cluster.start_node(0, num_cpus=head_cpus)
            for index in range(1, num_nodes):
                cluster.start_node(index)
            yield cluster
        finally:
            cluster.stop()
            shutil.rmtree(temp, ignore_errors=True)


DRIVER_CHECK = """
import json, ray
from ray.util.placement_group import placement_group_table
ray.init(address=__import__("sys").argv[1], namespace="skippy", logging_level="ERROR")
actors = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
groups = [g["name"] for g in placement_group_table().values() if g["state"] != "REMOVED"]
print(json.dumps({"actors": actors, "groups": groups}))
"""


def skippy_left_on(cluster: RayCluster) -> dict:
    """Named actors alive and placement groups not removed, as a new driver on the head sees them."""
    done = subprocess.run(["ip", "netns", "exec", cluster.head.namespace, sys.executable, "-c", DRIVER_CHECK,
                           cluster.address], env=cluster.env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


# A client inside a namespace host (the API listens on that host's loopback): one JSON line per
# streamed piece, with its arrival time on the machine-wide monotonic clock the test shares.
STREAM = r"""
import httpx, json, sys, time
body = {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": sys.argv[2], "max_tokens": int(sys.argv[3]),
        "temperature": 0, "logit_bias": {"0": -100, "2": -100}, "stream": True}
with httpx.stream("POST", sys.argv[1] + "/v1/completions", json=body, timeout=300) as response:
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[6:])
            text = "".join(choice["text"] for choice in event.get("choices", []))
            print(json.dumps({"t": time.monotonic(), "text": text, "error": event.get("error")}), flush=True)
"""
GET = """
import httpx, json, sys
print(json.dumps(httpx.get(sys.argv[1] + sys.argv[2], timeout=60).json()))
"""
STORY = "Once upon a time, in a village by the sea,"


class ServedOnRay:
    """`skippy serve --ray` in `host`'s namespace, on this cluster; the API on that host's loopback."""

    def __init__(self, cluster: RayCluster, host: Host, args: list[str], log_path, port: int = 9337):
        self.cluster, self.host, self.url = cluster, host, f"http://127.0.0.1:{port}"
        self.log_path = log_path
        command = ["ip", "netns", "exec", host.namespace, sys.executable, "-m", "skippy.cli", "--log-level", "INFO",
                   "serve", "--ray", cluster.address, "--port", str(port), *args]
        started = time.monotonic()
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=open(log_path, "w"), text=True,
                                        env=cluster.env())
        self.output = ""  # its stdout up to the ready line
        for line in self.process.stdout:
            self.output += line
            if line.startswith("skippy: ready:"):
                self.ready_s = time.monotonic() - started
                self.ready_line = line
                threading.Thread(target=self.process.stdout.read, daemon=True).start()
                return
        raise AssertionError(f"skippy serve --ray exited with {self.process.wait()}:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def get(self, path: str):
        done = subprocess.run(["ip", "netns", "exec", self.host.namespace, sys.executable, "-c", GET, self.url, path],
                              capture_output=True, text=True, timeout=120, env=self.cluster.env())
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def stages(self) -> list[dict]:
        return self.get("/v1/stages")["data"]

    def host_of(self, stage_index: int) -> Host:
        node_ip = self.stages()[stage_index]["node_ip"]
        return next(host for host in self.cluster.hosts if host.address == node_ip)

    def stream(self, action=None, at: int = 15, prompt: str = STORY, max_tokens: int = 120) -> tuple[str, float | None]:
        """The streamed text, with `action` run once `at` pieces have arrived; and the time from
        the action to the piece that ends the pause it caused (None without an action): the
        piece after the longest wait, since a piece already past a killed stage may arrive first."""
        client = subprocess.Popen(["ip", "netns", "exec", self.host.namespace, sys.executable, "-c", STREAM,
                                   self.url, prompt, str(max_tokens)],
                                  stdout=subprocess.PIPE, text=True, env=self.cluster.env())
        pieces, times, acted_at = [], [], None
        for line in client.stdout:
            event = json.loads(line)
            assert event["error"] is None, event  # a pause, never an error event
            pieces.append(event["text"])
            times.append(event["t"])
            if action is not None and len(pieces) == at:
                acted_at = time.monotonic()
                action()
        assert client.wait(timeout=300) == 0
        if acted_at is None:
            return "".join(pieces), None
        after = [t for t in times if t > acted_at]
        waits = [t - before for before, t in zip([acted_at, *after], after)]
        return "".join(pieces), after[waits.index(max(waits))] - acted_at

    def stop(self, sig: int = signal.SIGINT) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

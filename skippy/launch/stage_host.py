"""The Ray actor that hosts one stage on its node (`skippy serve --ray`, ray_chain.py).

It runs `skippy stage` as its child, so a stage is the same process wherever it runs. Its
life is the stage's: when the child dies the actor exits, and Ray starts the actor again
(`max_restarts`), on the same node, or on another when the node was lost. Each start makes
a fresh TLS key here; only its public half leaves the node, for the driver to sign for the
address the actor landed on. Nothing secret is a constructor argument (Ray keeps those to
replay restarts, and shows them to anyone who can list actors): the config, its chain token
and the certificate arrive by `start`, which the driver calls again after every restart.

It imports no torch, nor even the protocol's models (the config stays JSON here): Ray starts
this process again when a stage dies, and that start is part of the stream's pause.
"""

from __future__ import annotations

import collections
import ctypes
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import json
from pathlib import Path

from ..stage.certificates import new_key_pair, write_private
from ..stage.lifecycle import READY_PREFIX
from .placement import STARTUP_TIMEOUT_S, describe_exit, stage_command

PR_SET_PDEATHSIG = 1
ERROR_LINES = 20  # of the child's stderr, in a start's error


class StageHost:
    """One stage's actor; the driver calls `describe`, then `start`, then waits on `wait`."""

    def __init__(self, stage_index: int, chain_id: str, port: int, log_level: str):
        import ray

        self.stage_index, self.port, self.log_level = stage_index, port, log_level
        self.node_ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.directory = Path(tempfile.gettempdir()) / f"skippy-{chain_id}-stage-{stage_index}"
        shutil.rmtree(self.directory, ignore_errors=True)  # an earlier run's files on this node
        self.directory.mkdir(mode=0o700, parents=True)
        self._key_pem, self._public_pem = new_key_pair()  # never leaves this node
        self._child: subprocess.Popen | None = None
        self._stopping = False
        self._down = threading.Event()
        self._down_reason = ""
        self._stderr: collections.deque[str] = collections.deque(maxlen=ERROR_LINES)

    def describe(self) -> dict:
        """Where this actor runs, and the public key its certificate must name. `down`: its
        stage has exited and the actor is about to (a restart must wait for the next one)."""
        return {"node_ip": self.node_ip, "node_id": self.node_id, "endpoint": self.endpoint,
                "public_key": self._public_pem, "pid": os.getpid(), "down": self._down.is_set(),
                "stage_pid": self._child.pid if self._child else None}

    @property
    def endpoint(self) -> str:
        return f"[{self.node_ip}]:{self.port}" if ":" in self.node_ip else f"{self.node_ip}:{self.port}"

    def start(self, config_json: str, topology_json: str, cert_pem: bytes, ca_pem: bytes,
              threads: int) -> dict:
        """Write the stage's files (owner-only), start `skippy stage`, return once it is ready."""
        if self._child is not None and self._child.poll() is None:
            raise RuntimeError(f"stage {self.stage_index} is already running on {self.node_ip}")
        config = json.loads(config_json)  # a StageConfig, validated by the stage itself
        if not Path(config["model_path"]).is_file():
            raise FileNotFoundError(f"stage {self.stage_index}: the model {config['model_path']} is not on node "
                                    f"{self.node_ip}. Fix: give every node the file at that path")
        tls = self.directory / "tls"
        tls.mkdir(mode=0o700, exist_ok=True)
        write_private(tls / "ca.pem", ca_pem)
        write_private(tls / "stage.pem", cert_pem)
        write_private(tls / "stage.key", self._key_pem)
        config["tls"] = {"ca_file": "tls/ca.pem", "cert_file": "tls/stage.pem", "key_file": "tls/stage.key"}
        write_private(self.config_path, json.dumps(config).encode())
        write_private(self.directory / "topology.json", topology_json.encode())
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)}
        command = [*stage_command(self.config_path, self.directory / "topology.json", self.log_level),
                   "--threads", str(threads)]
        started, ready = time.monotonic(), queue.Queue()
        threading.Thread(target=self._keep, args=(command, env, ready), daemon=True,
                         name=f"skippy-stage-{self.stage_index}").start()
        try:
            code = ready.get(timeout=STARTUP_TIMEOUT_S)
        except queue.Empty:
            self._child.kill()
            raise RuntimeError(f"stage {self.stage_index} on {self.node_ip}: not ready within "
                               f"{STARTUP_TIMEOUT_S:g} s") from None
        if code is not None:
            raise RuntimeError(f"stage {self.stage_index} on {self.node_ip} exited with {describe_exit(code)} "
                               f"before it was ready:\n" + "".join(self._stderr))
        return {"stage_pid": self._child.pid, "ready_s": time.monotonic() - started}

    @property
    def config_path(self) -> Path:
        return self.directory / "stage.json"

    def _keep(self, command: list[str], env: dict, ready: queue.Queue) -> None:
        """Start the stage and see it through: its thread lives as long as the child, which
        is what PR_SET_PDEATHSIG ties the child to (the forking thread, not the process)."""
        child = self._child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                               env=env, text=True, preexec_fn=_die_with_parent)
        threading.Thread(target=self._relay_stderr, args=(child.stderr,), daemon=True).start()
        is_ready = False
        for line in child.stdout:
            if not is_ready and line.startswith(READY_PREFIX):
                is_ready = True
                ready.put(None)
        code = child.wait()
        if not is_ready:
            ready.put(code)
            return
        if self._stopping:
            return
        # A dead stage makes a dead actor, which Ray restarts. `wait` answers first, with why.
        self._down_reason = f"its stage process exited with {describe_exit(code)}"
        self._down.set()
        time.sleep(0.05)
        os._exit(1)

    def _relay_stderr(self, stream) -> None:
        for line in stream:  # the stage's log, to this actor's (which Ray can show on the driver)
            self._stderr.append(line)
            sys.stderr.write(line)
            sys.stderr.flush()

    def wait(self) -> str:
        """Return when the stage process is down (why). The actor exits right after: the
        driver holds this call as the stage's liveness sentinel."""
        self._down.wait()
        return self._down_reason

    def repoint(self, downstream_json: str | None) -> None:
        """The next stage moved: rewrite this stage's config and tell it (SIGHUP)."""
        config = json.loads(self.config_path.read_text())
        config["downstream"] = None if downstream_json is None else json.loads(downstream_json)
        write_private(self.config_path, json.dumps(config).encode())
        if self._child is not None and self._child.poll() is None:
            self._child.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        """End the stage (SIGTERM, then SIGKILL after 10 s) without taking the actor down."""
        self._stopping = True
        if self._child is None or self._child.poll() is not None:
            return
        self._child.terminate()
        try:
            self._child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the thread that started it dies (an actor
    killed by Ray, or its node's raylet gone, must not leave a stage serving)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

"""The Ray actor that hosts one stage on its node (`skippy serve --ray`, ray_chain.py).

It runs `skippy stage` (handed to a standby: warm_stage.py), so a stage is the same process
wherever it runs. Its life is the stage's: when the stage dies the actor exits and Ray starts
it again, on this node (it finds the stage's files and starts the stage at once) or on
another (the driver starts it as the first time). docs/architecture.md (On Ray) tells the rest.

Nothing secret is a constructor argument: Ray keeps those to replay restarts, and lists them
to anyone who can list actors; the key is made here and only its public half leaves the node.
It imports no torch, nor even the protocol's models (the config stays JSON here): Ray starts
this process again when a stage dies, and that start is part of the stream's pause.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..stage.certificates import new_key_pair, public_key_of, write_private
from ..stage.lifecycle import READY_PREFIX
from .placement import STARTUP_TIMEOUT_S, describe_exit, stage_command
from .warm_stage import StageProcess, hand_over, spawn_standby

ERROR_LINES = 20  # of the child's stderr, in a start's error
# a standby is started this long after its stage is ready: its imports (~2 s of a core) would
# slow the stage's own measurement of itself and its link, which the chain plans by
# (measured_split.py, --activation-dtype auto), and which runs once the new stage is quiet
STANDBY_DELAY_S = 5.0


class StageHost:
    """One stage's actor; the driver calls `describe`, then `start` (or `wait_ready` when the
    actor restarted its stage itself), then waits on `wait`."""

    def __init__(self, stage_index: int, chain_id: str, port: int, log_level: str, standby: bool = True):
        import ray

        self.stage_index, self.port, self.log_level = stage_index, port, log_level
        self.keeps_standby = standby  # a warm process for the next start (warm_stage.py)
        self.node_ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.directory = Path(tempfile.gettempdir()) / f"skippy-{chain_id}-stage-{stage_index}"
        self._child: StageProcess | None = None
        self._standby: subprocess.Popen | None = None  # this actor's standby (warm_stage.py), if not taken
        self._standby_lock = threading.Lock()  # the ready stage's timer starts one; a start takes it
        self._threads = 1
        self._stopping = False
        self._settled = threading.Event()  # the current start ended: ready, or exited before
        self._start_error = ""
        self._started_at = 0.0
        self._down = threading.Event()     # the stage exited after it was ready
        self._down_reason = ""
        self._stderr: collections.deque[str] = collections.deque(maxlen=ERROR_LINES)
        self._forker = _Forker()
        self._ready_timeout_s = STARTUP_TIMEOUT_S
        threads = self._kept_start()
        if threads is None:
            shutil.rmtree(self.directory, ignore_errors=True)  # another node's, or an earlier chain's
            self.directory.mkdir(mode=0o700, parents=True)
            self._key_pem, self._public_pem = new_key_pair()  # never leaves this node
        else:  # Ray restarted this actor where its stage ran: the same stage, at once
            self._key_pem = (self.directory / "tls" / "stage.key").read_bytes()
            self._public_pem = public_key_of(self._key_pem)
            self._launch(threads)

    def _kept_start(self) -> int | None:
        """The threads of the stage this node last ran for this actor, if its files are here
        and name this node's address (a shared /tmp across hosts holds other nodes' too)."""
        try:
            kept = json.loads((self.directory / "start.json").read_text())
            config = json.loads(self.config_path.read_text())
        except (OSError, ValueError):
            return None
        if config["bind_addr"] != self.endpoint:
            return None
        self._ready_timeout_s = kept.get("ready_timeout_s", STARTUP_TIMEOUT_S)
        return kept["threads"]

    def describe(self) -> dict:
        """Where this actor runs, and the public key its certificate must name. `starting`:
        it restarted its stage from the files it kept (`wait_ready` for it); `down`: its stage
        has exited and the actor is about to (a restart must wait for the next one)."""
        failed = self._settled.is_set() and self._start_error  # then the driver starts it anew
        return {"node_ip": self.node_ip, "node_id": self.node_id, "endpoint": self.endpoint,
                "public_key": self._public_pem, "pid": os.getpid(),
                "starting": self._child is not None and not failed, "down": self._down.is_set()}

    @property
    def endpoint(self) -> str:
        return f"[{self.node_ip}]:{self.port}" if ":" in self.node_ip else f"{self.node_ip}:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.directory / "stage.json"

    def start(self, config_json: str, topology_json: str, cert_pem: bytes, ca_pem: bytes,
              threads: int, ready_timeout_s: float = STARTUP_TIMEOUT_S) -> dict:
        """Write the stage's files (owner-only), start `skippy stage`, return once it is ready
        (within `ready_timeout_s`: a start may include fetching its layers)."""
        if self._child is not None and self._child.running():
            raise RuntimeError(f"stage {self.stage_index} is already running on {self.node_ip}")
        # A StageConfig, validated by the stage itself. A node without the file at its
        # `model_path` is fine: the stage fetches its slice from stage 0 (the topology's first
        # endpoint, a holder) into this node's cache (stage/fetch.py), where a restart on this
        # node finds it.
        config = json.loads(config_json)
        self._stopping = False  # a start after `stop_stage` (new configs: a measured split)
        tls = self.directory / "tls"
        tls.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_private(tls / "ca.pem", ca_pem)
        write_private(tls / "stage.pem", cert_pem)
        write_private(tls / "stage.key", self._key_pem)
        config["tls"] = {"ca_file": "tls/ca.pem", "cert_file": "tls/stage.pem", "key_file": "tls/stage.key"}
        write_private(self.config_path, json.dumps(config).encode())
        write_private(self.directory / "topology.json", topology_json.encode())
        write_private(self.directory / "start.json",
                      json.dumps({"threads": threads, "ready_timeout_s": ready_timeout_s}).encode())
        self._ready_timeout_s = ready_timeout_s
        self._launch(threads)
        return self.wait_ready()

    @property
    def standby_socket(self) -> Path:
        return self.directory / "standby.sock"

    def _launch(self, threads: int) -> None:
        """Hand the stage to the standby waiting on this node (this actor's, or the one the
        actor before it left: its imports are done), else start one and hand it over at once."""
        self._settled.clear()
        self._start_error, self._started_at, self._threads = "", time.monotonic(), threads
        argv = [*stage_command(self.config_path, self.directory / "topology.json", self.log_level)[3:],
                "--threads", str(threads)]  # `skippy`'s arguments
        with self._standby_lock:
            try:
                self._child = hand_over(self.standby_socket, argv, self._ready_timeout_s, self._standby)
            except (OSError, ValueError):  # none waiting (or it failed): a cold start
                if self._standby is not None:
                    self._standby.kill()
                self._standby = spawn_standby(self.standby_socket, self._stage_env(threads), self._forker.popen)
                self._child = hand_over(self.standby_socket, argv, self._ready_timeout_s, self._standby)
            self._standby = None
        threading.Thread(target=self._relay_stderr, args=(self._child.stderr,), daemon=True).start()
        threading.Thread(target=self._keep, args=(self._child,), daemon=True,
                         name=f"skippy-stage-{self.stage_index}").start()

    def wait_ready(self) -> dict:
        """Return once the stage started last is ready; raise if it exited before."""
        if not self._settled.wait(self._ready_timeout_s):
            self._child.signal(signal.SIGKILL)  # its last lines say where it was: loading, or fetching (and from whom)
            raise RuntimeError(f"stage {self.stage_index} on {self.node_ip}: not ready within "
                               f"{self._ready_timeout_s:g} s (--stage-wait); its last lines:\n" + "".join(self._stderr))
        if self._start_error:
            raise RuntimeError(self._start_error)
        return {"stage_pid": self._child.pid, "ready_s": self._ready_s}

    def _keep(self, child: subprocess.Popen) -> None:
        """See the stage through: ready, then its exit."""
        is_ready = False
        for line in child.stdout:
            if not is_ready and line.startswith(READY_PREFIX):
                is_ready, self._ready_s = True, time.monotonic() - self._started_at
                self._settled.set()
                standby = threading.Timer(STANDBY_DELAY_S, self._prepare_standby, args=(child,))
                standby.daemon = True
                standby.start()
        code = child.wait()
        if not is_ready and self._child in (child, None):  # not a stage that a later start replaced
            self._start_error = (f"stage {self.stage_index} on {self.node_ip} {_exited(code)} "
                                 f"before it was ready:\n" + "".join(self._stderr))
            self._settled.set()
            return
        if self._stopping or child is not self._child:  # stopped: `stop_stage` (and maybe a start since)
            return
        # A dead stage makes a dead actor, which Ray restarts. `wait` answers first, with why.
        self._down_reason = f"its stage process {_exited(code)}"
        self._down.set()
        time.sleep(0.05)
        os._exit(1)

    def _stage_env(self, threads: int) -> dict[str, str]:
        return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)}

    def _prepare_standby(self, stage: StageProcess) -> None:
        """The next start's process, importing while `stage` serves."""
        with self._standby_lock:
            if self.keeps_standby and self._standby is None and not self._stopping and stage is self._child \
                    and stage.running():
                self._standby = spawn_standby(self.standby_socket, self._stage_env(self._threads),
                                              self._forker.popen)

    def _relay_stderr(self, stream) -> None:
        for line in stream:  # the stage's log, to this actor's (which Ray can show on the driver)
            self._stderr.append(line)
            sys.stderr.write(line)
            sys.stderr.flush()

    def wait(self) -> str:
        """Return when the stage process is down (why). The actor exits right after: the
        driver holds this call as the stage's liveness sentinel."""
        down = self._down
        down.wait()
        return self._down_reason

    def repoint(self, downstream_json: str | None) -> None:
        """The next stage moved: rewrite this stage's config and tell it (SIGHUP)."""
        config = json.loads(self.config_path.read_text())
        downstream = None if downstream_json is None else json.loads(downstream_json)
        if config["downstream"] == downstream:
            return
        config["downstream"] = downstream
        write_private(self.config_path, json.dumps(config).encode())
        if self._child is not None:
            self._child.signal(signal.SIGHUP)

    def stop_stage(self) -> None:
        """End the stage (SIGTERM, then SIGKILL after 10 s), without taking the actor down;
        its files and key stay for a `start` with new configs. A `wait` under way returns."""
        self._stopping = True
        child, self._child = self._child, None
        if child is not None and child.running():
            child.signal(signal.SIGTERM)
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.signal(signal.SIGKILL)
                child.wait()
        self._down_reason = "stopped by skippy"
        self._down.set()              # the driver's sentinel on this stage returns ...
        self._down = threading.Event()  # ... and the next start gets its own

    def stop(self) -> None:
        """End the stage and its standby and remove their files, without taking the actor down."""
        self.stop_stage()
        if self._standby is not None:
            self._standby.kill()
            self._standby.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


class _Forker:
    """Starts children from one thread that lives as long as this process: Linux sends
    PR_SET_PDEATHSIG (which a standby sets once handed its stage: warm_stage.py) when the
    *thread* that forked the child ends, not its process."""

    def __init__(self):
        self._requests: queue.Queue = queue.Queue()
        threading.Thread(target=self._serve, daemon=True, name="skippy-forker").start()

    def _serve(self) -> None:
        while True:
            args, options, reply = self._requests.get()
            try:
                reply.put(subprocess.Popen(args, **options))
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                reply.put(error)

    def popen(self, args: list[str], **options) -> subprocess.Popen:
        reply: queue.Queue = queue.Queue(maxsize=1)
        self._requests.put((args, options, reply))
        if isinstance(result := reply.get(), BaseException):
            raise result
        return result


def _exited(code: int | None) -> str:
    if code is None:  # a standby an earlier actor here started: its exit code went to its parent
        return "exited (its code unseen: an earlier actor on this node started it)"
    return f"exited with {describe_exit(code)}"

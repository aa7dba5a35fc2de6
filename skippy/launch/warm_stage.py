"""A `skippy stage` process started before it is needed: a standby (`skippy serve --ray`).

A Ray stage that dies is restarted by a new actor on its node (stage_host.py), and most of
that start, the stream's pause, is Python importing torch and skippy. So each actor keeps one
of these waiting on its node, imports done (docs/decisions.md, 2026-12-06).

    python -m skippy.launch.warm_stage SOCKET

It listens on SOCKET first (so a caller may connect while it still imports), imports, then
waits for one caller: a JSON line {"argv": `skippy` arguments, "owner_pid": the actor's pid}
with the caller's stdout and stderr pipes as passed file descriptors. It answers {"pid": its
pid}, takes those pipes as its own, and runs `python -m skippy.cli <argv>` in this process.
It survives the actor that started it (that actor's successor adopts it) but dies with the
actor that adopted it; one that nobody adopts within ADOPT_GRACE_S of its parent's death exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ADOPT_GRACE_S = 30.0  # an orphaned standby waits this long for its actor's successor
PR_SET_NAME, PR_SET_PDEATHSIG = 15, 1
STANDBY_NAME, STAGE_NAME = b"skippy-standby", b"skippy-stage"  # its process name (ps, /proc/PID/comm)
MAX_REQUEST = 1 << 16


def main(socket_path: str) -> int:
    parent = os.getppid()
    _prctl(PR_SET_NAME, STANDBY_NAME)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)
    listener.bind(socket_path)
    listener.listen(1)
    # what a stage's start spends most of its time on, done ahead
    import torch  # noqa: F401

    from ..stage import process  # noqa: F401 - the stage's server, runtime and model loader

    caller = _wait_for_caller(listener, parent)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)  # taken: the next standby binds the path afresh
    listener.close()
    if caller is None:
        return 0
    with caller:
        message, fds, _, _ = socket.recv_fds(caller, MAX_REQUEST, 2)
        request = json.loads(message)
        for fd, target in zip(fds, (1, 2)):
            os.dup2(fd, target)
            os.close(fd)
        _die_with(request["owner_pid"])
        _prctl(PR_SET_NAME, STAGE_NAME)
        caller.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
    sys.argv = ["skippy", *request["argv"]]
    runpy.run_module("skippy.cli", run_name="__main__", alter_sys=True)  # exits with the stage's code
    return 0


def _wait_for_caller(listener: socket.socket, parent: int) -> socket.socket | None:
    """The caller that adopts this standby; None if its parent died and nobody came in time."""
    orphaned_at = None
    while True:
        readable, _, _ = select.select([listener], [], [], 0.2)
        if readable:
            return listener.accept()[0]
        if orphaned_at is None and os.getppid() != parent:
            orphaned_at = time.monotonic()
        if orphaned_at is not None and time.monotonic() - orphaned_at > ADOPT_GRACE_S:
            return None


def _die_with(owner: int) -> None:
    """SIGKILL this process when `owner` dies: a stage must not serve without its actor."""
    if os.getppid() == owner:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == owner:  # not died in between
            return
    try:
        pidfd = os.pidfd_open(owner)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        select.select([pidfd], [], [])  # readable once the owner has exited
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="skippy-owner-watch").start()


def _prctl(option: int, value) -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value, 0, 0, 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))


# The actor's side (stage_host.py): start a standby, hand one the stage.

def spawn_standby(socket_path: Path, env: dict[str, str], popen) -> subprocess.Popen:
    """A standby for the stage whose directory holds `socket_path`, through `popen` (the
    actor's forking thread). Not tied to the actor's life: an actor that dies leaves it to
    its successor (or to ADOPT_GRACE_S)."""
    # its own session: Ray kills a dead worker's process group (its children) with it
    return popen([sys.executable, "-m", "skippy.launch.warm_stage", str(socket_path)], stdin=subprocess.DEVNULL,
                 stdout=subprocess.DEVNULL, env=env, start_new_session=True)  # stderr: the actor's, until handed its own


def hand_over(socket_path: Path, argv: list[str], timeout_s: float,
              standby: subprocess.Popen | None = None) -> StageProcess:
    """Give the standby listening on `socket_path` the stage (`skippy <argv>`), with new pipes
    for its stdout and stderr; OSError when none is there (or it died before it took it).
    `standby`: the one this actor started, if any (waited for while it starts listening)."""
    deadline = time.monotonic() + timeout_s
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            while True:
                try:
                    sock.connect(str(socket_path))
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    if standby is None or standby.poll() is not None or time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)  # ours is starting Python: it listens before it imports
            sock.settimeout(max(0.1, deadline - time.monotonic()))  # its imports, if not done yet
            request = json.dumps({"argv": argv, "owner_pid": os.getpid()}).encode()
            socket.send_fds(sock, [request], [out_write, err_write])
            answer = sock.makefile("rb").readline()
        if not answer:
            raise ConnectionError(f"the standby at {socket_path} exited before it took the stage")
    except BaseException:
        os.close(out_read)
        os.close(err_read)
        raise
    finally:
        os.close(out_write)
        os.close(err_write)
    pid = json.loads(answer)["pid"]
    child = standby if standby is not None and standby.pid == pid else None
    return StageProcess(pid, open(out_read, errors="replace"), open(err_read, errors="replace"), child)


class StageProcess:
    """A stage's process as its actor sees it: the actor's child (its exit code known), or a
    standby an earlier actor on this node started (only its exit is seen, by pidfd)."""

    def __init__(self, pid: int, stdout, stderr, child: subprocess.Popen | None):
        self.pid, self.stdout, self.stderr, self._child = pid, stdout, stderr, child
        self._pidfd = None if child is not None else os.pidfd_open(pid)

    def running(self) -> bool:
        if self._child is not None:
            return self._child.poll() is None
        return not select.select([self._pidfd], [], [], 0)[0]

    def wait(self, timeout: float | None = None) -> int | None:
        """Its exit code (None: not this actor's child, so only its parent saw it); raises
        subprocess.TimeoutExpired past `timeout`."""
        if self._child is not None:
            return self._child.wait(timeout)
        if not select.select([self._pidfd], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        return None

    def signal(self, sig: int) -> None:
        if self.running():  # a pidfd names its process only: no other that took its pid
            signal.pidfd_send_signal(self._pidfd, sig) if self._pidfd is not None else self._child.send_signal(sig)

"""`skippy stage`: one stage process, from its config to serving until a signal."""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import sys
from collections.abc import Callable

from ..protocol import StageConfig, Topology
from . import tls
from .build import StageSpec, build_stage
from .fetch import provide_model
from .lifecycle import EXIT_ADDRESS_IN_USE, READY_PREFIX
from .server import StageServer
from .transport import bound_socket

log = logging.getLogger("skippy.stage")


def bind_listener(config: StageConfig) -> socket.socket:
    """Bind the stage's address before the (slow) model load, so a taken port fails fast."""
    try:
        return bound_socket(config.bind_host, config.bind_port)
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            print(f"skippy: error: stage {config.stage_index} cannot listen on "
                  f"{config.bind_addr}: the address is in use", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_ADDRESS_IN_USE) from error
        raise


async def serve_stage(config: StageConfig, topology: Topology | None = None,
                      reload: Callable[[], StageConfig] | None = None) -> None:
    """Load this stage's layers, listen, print the ready line, serve until SIGINT/SIGTERM.
    SIGHUP: read the config again (`reload`) and dial its downstream from now on (the next
    stage moved to another host; whoever moved it rewrote the file)."""
    tls.check_exposure(f"stage {config.stage_index}", config.bind_host, auth_token=config.auth_token,
                       tls=config.tls, insecure=config.insecure)
    model = await provide_model(config, topology)  # its file, or its slice: cached or fetched (fetch.py)
    config = model.config
    sock = bind_listener(config)
    server = build_stage(StageSpec(config, topology))
    await model.checked()  # a cached slice's tensors, hashed while it loaded: a corrupt one stops it here
    server.runtime.log_settings(config.stage_index)
    endpoint = await server.start(sock)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if reload is not None:
        loop.add_signal_handler(signal.SIGHUP, lambda: _repoint(server, reload))
    print(f"{READY_PREFIX} {config.stage_id} index {config.stage_index} layers "
          f"[{config.layer_start}, {config.layer_end}) on {endpoint}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.close()
        server.telemetry.shutdown()


def _repoint(server: StageServer, reload: Callable[[], StageConfig]) -> None:
    try:
        server.repoint(reload().downstream)
    except (OSError, ValueError) as error:  # a bad file: keep serving as before, and say why
        log.error("stage %d: SIGHUP: config not reloaded: %s", server.config.stage_index, error)

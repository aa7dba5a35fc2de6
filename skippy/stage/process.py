"""`skippy stage`: one stage process, from its config to serving until a signal."""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import sys

from ..model.fingerprint import check_model
from ..protocol import StageConfig, Topology
from . import tls
from .build import StageSpec, build_stage

log = logging.getLogger("skippy.stage")

READY_PREFIX = "skippy: stage ready:"   # launchers wait for this line on stdout
EXIT_ADDRESS_IN_USE = 98                 # exit status when the bind address is taken


def bind_listener(config: StageConfig) -> socket.socket:
    """Bind the stage's address before the (slow) model load, so a taken port fails fast."""
    family = socket.AF_INET6 if ":" in config.bind_host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.bind_host, config.bind_port))
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            print(f"skippy: error: stage {config.stage_index} cannot listen on "
                  f"{config.bind_addr}: the address is in use", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_ADDRESS_IN_USE) from error
        raise
    sock.listen(128)
    return sock


async def serve_stage(config: StageConfig, topology: Topology | None = None) -> None:
    """Load this stage's layers, listen, print the ready line, serve until SIGINT/SIGTERM."""
    tls.check_exposure(f"stage {config.stage_index}", config.bind_host, auth_token=config.auth_token,
                       tls=config.tls, insecure=config.insecure)
    check_model(config.model_path, config.model_fingerprint, f"stage {config.stage_index}")
    sock = bind_listener(config)
    driver = topology.driver_endpoint if topology is not None and len(topology.stages) > 1 else None
    server = build_stage(StageSpec(config, driver))
    server.runtime.log_settings(config.stage_index)
    endpoint = await server.start(sock)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"{READY_PREFIX} {config.stage_id} index {config.stage_index} layers "
          f"[{config.layer_start}, {config.layer_end}) on {endpoint}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.close()
        server.telemetry.shutdown()

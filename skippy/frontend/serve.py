"""`skippy serve`: load the model (one process or a chain of stages), then run the API until a signal.

Shutdown order on Ctrl-C or SIGTERM: stop accepting, end open streams (after a
short grace period), close the backend (which stops every stage process it
started), then exit. SIGTERM during loading takes the same path.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from .api import DEFAULT_MAX_BODY_BYTES, ApiSettings, create_app
from .backend import GenerationBackend, StageStatus

GRACEFUL_SHUTDOWN_S = 5


@dataclass(frozen=True, slots=True)
class ServeConfig:
    model: Path
    num_stages: int = 2
    host: str = "127.0.0.1"
    port: int = 9337
    topology: Path | None = None
    ctx_size: int | None = None
    concurrency: int | None = None
    queue_size: int | None = None
    auth_token: str | None = None
    dtype: str = "float32"
    device: str = "auto"
    admission_timeout_s: float = 60.0
    backend_timeout_s: float = 600.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ValueError(f"Expected --stages >= 1, got {self.num_stages}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"Expected a port in [0, 65535], got {self.port}")


def model_id_for(path: Path) -> str:
    """The id clients send as `model`: the GGUF's file stem, or the HF directory's name."""
    path = Path(path)
    return path.name if path.is_dir() else path.stem


def load_local_backend(config: ServeConfig):
    """(tokenizer, LocalBackend) with the whole model in this process."""
    from ..model.gguf_loader import open_gguf
    from ..model.loader import load_stage
    from ..model.tokenizer import Tokenizer
    from .local_backend import LocalBackend

    path = Path(config.model)
    model = load_stage(path, dtype=config.dtype, device=config.device)
    tokenizer = Tokenizer.from_hf_dir(path) if path.is_dir() else Tokenizer.from_gguf(open_gguf(path))
    lanes = config.concurrency or 8
    return tokenizer, LocalBackend(model, num_lanes=lanes, ctx_size=config.ctx_size)


def build_backend(config: ServeConfig) -> tuple[object, GenerationBackend]:
    if config.num_stages == 1 and config.topology is None:
        return load_local_backend(config)
    raise ValueError(
        "Expected --stages 1: the stage chain backend is not available in this build yet. Fix: pass --stages 1."
    )


def describe_split(stages: list[StageStatus]) -> str:
    parts = [f"{s.stage_id} layers [{s.layer_start}, {s.layer_end}) @ {s.endpoint}" for s in stages]
    return f"{len(stages)} stage{'s' * (len(stages) != 1)}: " + "; ".join(parts)


class _Server(uvicorn.Server):
    """uvicorn, minus its re-raising of the signal after shutdown: we still have stages to stop."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def serve(config: ServeConfig) -> int:
    previous_term = signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM while loading: clean up too
    backend = None
    try:
        tokenizer, backend = build_backend(config)
        settings = ApiSettings(
            model_id=model_id_for(config.model),
            concurrency=config.concurrency,
            queue_size=config.queue_size,
            admission_timeout_s=config.admission_timeout_s,
            backend_timeout_s=config.backend_timeout_s,
            max_body_bytes=config.max_body_bytes,
            auth_token=config.auth_token,
        )
        app = create_app(backend, tokenizer, settings)
        server = _Server(uvicorn.Config(
            app, host=config.host, port=config.port, log_level="warning", access_log=False,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="off",
        ))  # fmt: skip
        asyncio.run(_serve_until_signal(server, backend, settings.model_id))
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        if backend is not None:
            asyncio.run(backend.close())
        signal.signal(signal.SIGTERM, previous_term)


async def _serve_until_signal(server: uvicorn.Server, backend: GenerationBackend, model_id: str) -> None:
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        split = describe_split(await backend.status())
        print(f"skippy: ready: http://{host}:{port}/v1 serving {model_id} ({split})", flush=True)
    await task
    if not server.started and not server.should_exit:
        sys.exit(f"skippy: error: could not start the API on {server.config.host}:{server.config.port}")

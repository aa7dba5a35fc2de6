"""`skippy serve`: load the model (one process, or a chain of stages), then run the API until a signal.

    --stages 1          stage 0 holds the whole model, in this process (a chain of one)
    --stages N (N>1)    LocalChain: stages 1..N-1 as child processes on loopback, stage 0 here
    --topology FILE     stage 0 here, stages 1..N-1 already running where the file says
    --ray ADDRESS       RayChain: stages 1..N-1 placed, started and restarted on a Ray cluster's
                        nodes (ray_chain.py), stage 0 here

Every case is the same stage-0 engine (`ChainClient` behind `ChainBackend`), so the
prefix cache, speculation and batching work alike on one stage and on N.

Ctrl-C or SIGTERM: stop accepting, end open streams after a short grace period,
close the backend (which stops every stage process it started), exit. A signal
while loading takes the same path, so no stage process is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Literal

import uvicorn
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..api.app import DEFAULT_MAX_BODY_BYTES, ApiSettings, create_app
from ..console import progress_bar, say
from ..driver.backend import GenerationBackend, StageStatus
from ..tasks import to_the_end
from .ray_chain import RaySettings

GRACEFUL_SHUTDOWN_S = 5
DEFAULT_LANES = 8


class ServeConfig(BaseModel):
    """`skippy serve`'s whole configuration, validated once (the CLI builds it); stage 0 and
    every local stage get their settings from it (LocalChain writes each stage's StageConfig)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: Path
    num_stages: int = Field(2, ge=1)
    host: str = "127.0.0.1"
    port: int = Field(9337, ge=0, le=65535)
    topology: Path | None = None
    ray: RaySettings | None = None  # --ray: the stages on a Ray cluster
    weights: list[float] | None = Field(None, min_length=1)  # --ray: each stage's share of the layers
    ctx_size: int | None = Field(None, ge=1)  # default: the model's
    concurrency: int | None = Field(None, ge=1)  # generation lanes; default 8
    queue_size: int | None = Field(None, ge=0)
    auth_token: str | None = Field(None, repr=False)  # API bearer token
    chain_auth_token: str | None = Field(None, repr=False)  # the stages' transport token (with --topology)
    # --topology: listen off loopback without a chain token or TLS; --ray: use a cluster without
    # token authentication (warned)
    insecure: bool = False
    # with --topology or --ray: wait this long for stages still fetching or loading
    stage_wait_s: float = Field(3600.0, ge=0)
    dtype: str = "auto"
    device: str = "auto"
    repack: bool = True  # a batch-friendly copy of float32 CPU weights (see StageModel.repack_for_batches)
    prefill_precision: Literal["exact", "bf16"] = "exact"  # prompts' matmuls in every stage (StageModel's)
    # what stage rows cross links as; auto: per link and frame, from the measured bandwidth (f32, f16 or q8)
    activation_dtype: Literal["f32", "f16", "bf16", "q8", "auto"] = "auto"
    split: Literal["equal", "auto"] = "equal"  # --stages N: layers by weight bytes, or by measured time
    threads: int | None = Field(None, ge=1)  # torch threads in every stage process, this one included
    max_restarts: int = Field(5, ge=0)  # restarts in a row of a local stage that dies or hangs (0: none)
    recovery_timeout_s: float = Field(30.0, ge=0)  # a request waits this long for a broken chain (0: none)
    otlp_endpoint: str | None = None  # every stage's span export (OTLP); None = no spans
    otlp_protocol: Literal["http", "grpc"] = "http"  # OTLP over HTTP (port 4318) or gRPC (4317)
    admission_timeout_s: float = Field(60.0, ge=0)
    backend_timeout_s: float = Field(600.0, ge=0)
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1)
    log_level: str = "WARNING"
    served_model_name: list[str] = []  # the names clients send as `model` (default: the file's stem)
    allowed_origins: list[str] = []  # CORS origins (e.g. http://localhost:3000, or *); none by default
    kv_cache_bytes: int = Field(1 << 30, ge=0)  # prefix-cache memory, all stages together; 0 = no prefix cache
    kv_disk_dir: Path | None = None  # prefix-cache disk tier: one subdirectory per stage
    kv_disk_budget: int = Field(4 << 30, ge=0)  # disk bytes, all stages together
    speculative: str = "off"  # the default proposer: ngram-suffix, ngram-simple, draft or off
    draft_model: Path | None = None  # GGUF or HF directory of the "draft" proposer's model
    speculative_min_window: int = 1
    speculative_max_window: int = 8
    speculative_pipeline_depth: int = 1

    @model_validator(mode="after")
    def _consistent(self) -> ServeConfig:
        if self.speculative == "draft" and self.draft_model is None:
            raise ValueError("Expected --draft-model PATH with --speculative draft")
        if self.ray is not None and (self.topology is not None or self.num_stages < 2):
            raise ValueError("Expected --ray with --stages N (N >= 2) and no --topology")
        if self.ray is not None and len(self.ray.stage_resources) not in (1, self.num_stages):
            raise ValueError(f"Expected one --ray-stage-resources bundle or {self.num_stages}, "
                             f"got {len(self.ray.stage_resources)}")
        if self.ray is not None and self.stage_wait_s <= 0:  # every stage's start (and its fetch) is bounded by it
            raise ValueError(f"Expected --stage-wait > 0 with --ray, got {self.stage_wait_s:g}")
        if self.weights is not None and len(self.weights) != self.num_stages:
            raise ValueError(f"Expected {self.num_stages} --weights, one per stage, got {len(self.weights)}")
        self.speculative_settings()  # validates the mode, the window and the depth
        return self

    def speculative_settings(self):
        """The server's default SpeculativeSettings (a request may override them)."""
        from ..runtime.speculation import SpeculativeSettings

        return SpeculativeSettings(self.speculative, self.speculative_min_window, self.speculative_max_window,
                                   self.speculative_pipeline_depth)  # fmt: skip

    @property
    def timeouts(self):
        """Every wait of the chain and the API, the three set on the command line among them."""
        from ..protocol import Timeouts

        return Timeouts(recovery_s=self.recovery_timeout_s, admission_s=self.admission_timeout_s,
                        backend_s=self.backend_timeout_s)

    @property
    def num_lanes(self) -> int:
        return self.concurrency or DEFAULT_LANES

    def kv_cache(self, num_local_stages: int):
        """Each local stage's prefix-cache settings: an even share of the memory and disk
        budgets (None when the cache is off)."""
        from ..protocol import KvCacheConfig

        if self.kv_cache_bytes <= 0:
            return None
        disk_dir = None if self.kv_disk_dir is None else str(Path(self.kv_disk_dir).resolve())
        return KvCacheConfig(max_bytes=max(1, self.kv_cache_bytes // num_local_stages), disk_dir=disk_dir,
                             disk_budget_bytes=self.kv_disk_budget // num_local_stages)  # fmt: skip


def model_id_for(path: Path) -> str:
    """The id clients send as `model`: the GGUF's file stem, or the HF directory's name."""
    path = Path(path)
    return path.name if path.is_dir() else path.stem


def set_one_process_threads(config: ServeConfig) -> None:
    """torch threads when the whole model shares this process with the HTTP server:
    --threads, else every core. Sharing cores with the event loop costs little once the
    model loads on a thread of its own (model/threads.py; `bench/serve.py --stages 1`
    compares streamed with direct decoding)."""
    import torch

    torch.set_num_threads(config.threads or os.cpu_count() or 1)


async def build_backend(config: ServeConfig):
    """The ChainBackend: stage 0 here, holding the whole model (--stages 1), the first of
    `num_stages` local processes, or the first stage of a running topology."""
    from ..driver.chain_backend import ChainBackend
    from ..model.loader import model_args
    from ..protocol import StageConfig, Topology, parse_endpoint
    from ..stage import tls
    from .local_chain import LocalChain, connect_topology, start_stage0
    from .ray_chain import RayChain

    ctx_size = config.ctx_size or model_args(config.model).context_length
    every_stage = dict(dtype=config.dtype, device=config.device, repack=config.repack,
                       prefill_precision=config.prefill_precision,
                       otlp_endpoint=config.otlp_endpoint, otlp_protocol=config.otlp_protocol)
    options = dict(concurrency=config.num_lanes, ctx_size=ctx_size, activation_dtype=config.activation_dtype,
                   timeouts=config.timeouts,
                   speculative=config.speculative_settings(), draft_model=await _load_draft_model(config))
    if config.topology is not None:
        topology, token = Topology.load(config.topology), config.chain_auth_token
        plan = config.topology.with_name("stage-0.json")  # `skippy plan` writes stage 0's token and TLS there
        stage0 = StageConfig.load(plan) if plan.is_file() else None
        token = token or (stage0 and stage0.auth_token)
        tls_files = stage0.tls.resolved(plan.parent) if stage0 and stage0.tls else None
        tls.check_exposure("stage 0's return listener", parse_endpoint(topology.driver_endpoint)[0],
                           auth_token=token, tls=tls_files, insecure=config.insecure)
        client = await connect_topology(topology, config.model, auth_token=token, tls=tls_files,
                                        stage_wait_s=config.stage_wait_s,
                                        kv_cache=config.kv_cache(1), **every_stage, **options)
        return ChainBackend(client, topology, auth_token=token, advise=_advisor(config, ctx_size, False))
    if config.num_stages == 1:
        set_one_process_threads(config)
        client = await start_stage0(config.model, kv_cache=config.kv_cache(1), **every_stage, **options)
        return ChainBackend(client, None)
    # --split auto follows the measurements: a restart after a stage's death applies the split advice
    common = dict(threads=config.threads, lane_count=config.num_lanes, log_level=config.log_level,
                  kv_cache=config.kv_cache(config.num_stages), max_restarts=config.max_restarts,
                  apply_split_advice=config.split == "auto")
    if config.ray is not None:
        chain = RayChain(config.model, config.num_stages, config.ray, weights=config.weights,
                         insecure=config.insecure, stage_wait_s=config.stage_wait_s, split=config.split,
                         on_placed=say,
                         **common, **every_stage, **options)
    else:
        chain = LocalChain(config.model, config.num_stages, split=config.split, **common, **every_stage, **options)
    description = f"Starting {config.num_stages} stages of {Path(config.model).name}"
    started = time.monotonic()
    with progress_bar(description, config.num_stages) as advance:
        client = await chain.start(on_stage_ready=advance)
        advance()  # stage 0, here, loads last
    if config.ray is not None:
        say(f"{config.num_stages} stages ready on Ray in {time.monotonic() - started:.1f} s")
    if chain.plan is not None:
        names = [f"stage {i}" for i in range(config.num_stages)]
        first = "equal bytes" if config.ray is None else "the first split"
        print(f"skippy: measured split ({first} predicted {chain.first_plan.tok_s:.1f} tok/s):\n"
              + chain.plan.describe(names), flush=True)
    chain.backend = ChainBackend(client, chain.topology, auth_token=chain.auth_token, on_close=chain.close,
                                 health=chain.supervisor.health,
                                 advise=_advisor(config, ctx_size, use_all_hosts=config.ray is None
                                                 or config.split == "auto"))  # fmt: skip
    return chain.backend


def _advisor(config: ServeConfig, ctx_size: int, use_all_hosts: bool):
    """The split the stages' measured times give, for `/v1/stages` when they drift (measured_split.py).
    `use_all_hosts`: over every stage (a local chain, or one under --split auto, whose restart
    applies it and keeps every stage), its `fewer_hosts` saying when fewer would be faster."""
    from .measured_split import advisor, model_cost

    model = model_cost(config.model, ctx_size=ctx_size, lane_count=config.num_lanes,
                       activation_dtype=config.activation_dtype)
    return advisor(model, use_all_hosts=use_all_hosts)


async def generate_once(config: ServeConfig, prompt_ids, **options):
    """`skippy generate`: start the chain `config` describes, run one `ChainClient.generate`
    (its `options`), stop the chain; returns its GenerationResult."""
    backend = await build_backend(config)
    try:
        return await backend.client.generate(prompt_ids, **options)
    finally:
        await backend.close()


async def _load_draft_model(config: ServeConfig):
    """The whole draft model, in this process (stage 0 runs the "draft" proposer)."""
    if config.draft_model is None:
        return None
    from ..model.loader import load_stage

    return await asyncio.to_thread(load_stage, config.draft_model, dtype=config.dtype, device=config.device,
                                   progress=False)  # fmt: skip


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


def serve(config: ServeConfig) -> int:
    try:
        asyncio.run(_main(config))
    except (KeyboardInterrupt, asyncio.CancelledError):  # a signal while loading
        return 130
    return 0


async def _main(config: ServeConfig) -> None:
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)  # while loading
    backend: GenerationBackend | None = None
    try:
        from ..model.loader import model_args
        from ..model.tokenizer import Tokenizer

        architecture = model_args(config.model).architecture  # first: an unsupported one fails before any stage starts
        tokenizer = Tokenizer.from_model(config.model)  # it shares the GGUF reader that loading releases
        backend = await build_backend(config)
        loop.remove_signal_handler(signal.SIGTERM)  # uvicorn takes over SIGINT and SIGTERM
        timeouts = config.timeouts
        model_id, *aliases = config.served_model_name or [model_id_for(config.model)]
        settings = ApiSettings(model_id, tuple(aliases), tuple(config.allowed_origins), concurrency=config.concurrency,
                               queue_size=config.queue_size, admission_timeout_s=timeouts.admission_s,
                               backend_timeout_s=timeouts.backend_s, abandon_timeout_s=timeouts.abandon_s,
                               max_body_bytes=config.max_body_bytes, auth_token=config.auth_token)
        app = create_app(backend, tokenizer, settings)
        server = _Server(uvicorn.Config(
            app, host=config.host, port=config.port, log_level="warning", access_log=False,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="off",
        ))  # fmt: skip
        await _serve_until_signal(server, backend, settings.model_id, architecture)
    finally:
        if backend is not None:
            await to_the_end(backend.close())


async def _serve_until_signal(server: uvicorn.Server, backend: GenerationBackend, model_id: str,
                              architecture: str) -> None:
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        split = describe_split(await backend.status())
        print(f"skippy: ready: http://{host}:{port}/v1 serving {model_id} ({architecture}, {split})", flush=True)
    await task
    if not server.started:
        sys.exit(f"skippy: error: could not start the API on {server.config.host}:{server.config.port}")

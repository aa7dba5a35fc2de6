"""Chains for `skippy serve`, `generate` and `plan`: plan the split, start or reach the stages.

* `plan_chain` splits the layers and builds every stage's config plus the topology.
* `LocalChain` starts stages 1..N-1 as separate processes on free loopback ports
  and holds stage 0 in this process as a `ChainClient`.
* `connect_topology` builds stage 0 for stages that are already running anywhere.
* `start_stage0` is stage 0 in every case: for those two, or holding the whole model.
* `LocalChain(max_restarts=...)` keeps its stage processes alive (supervisor.py over
  placement.py's `LocalProcesses`).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import secrets
import socket
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from ..driver.client import ChainClient
from ..model.args import ModelArgs
from ..model.fingerprint import check_model, model_fingerprint
from ..model.grammar import GrammarCompiler
from ..model.loader import load_stage, model_args
from ..model.threads import co_located_spin_count
from ..protocol import (
    KvCacheConfig, LinkConditioning, PeerEndpoint, StageConfig, Topology, TopologyStage, parse_endpoint,
    plan_layer_split,
)
from ..runtime.batch_policy import ONE_WAVE_PEER_WAIT_FORWARDS, BatchSettings
from ..runtime.stage_cache import StagePrefixCache
from ..stage.build import WEIGHT_DTYPES
from ..stage.certificates import issue_certificates
from ..stage.holder import TensorHolder
from ..stage.transport import Transport
from ..telemetry import Telemetry
from .measured_split import model_cost, plan_from_measurements
from .placement import LocalProcesses, PortTaken
from .split_restart import restart_on_advice
from .stage_wait import wait_for_stages
from .supervisor import Supervisor

log = logging.getLogger("skippy.launch")
START_ATTEMPTS = 3   # a free port can be taken by someone else before its stage binds it


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Ports the OS says are free now (held together, so they are distinct)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def plan_chain(model_path: str | Path, endpoints: list[str], *, weights: list[float] | None = None,
               ranges: list[tuple[int, int]] | None = None, args: ModelArgs | None = None,
               standbys: dict[int, list[str]] | None = None, topology_id: str | None = None,
               **stage_options) -> tuple[Topology, list[StageConfig]]:
    """Topology and stage configs for one stage per endpoint; endpoint 0 is the driver's
    return listener, the others are where stages 1..N-1 listen (their bind address).
    The split counts the output head's weights as layers of the last stage, so every
    stage reads about as many bytes per token (with equal `weights`); `ranges` gives it
    instead (a measured plan: planner.py). `standbys`: stage index (1..N-1) -> endpoints
    of standby stages for its layers (see `standby_configs`)."""
    args = args or model_args(model_path)
    standbys = standbys or {}
    if not set(standbys) <= set(range(1, len(endpoints))):
        raise ValueError(f"Expected standbys for stages 1..{len(endpoints) - 1}, got stage(s) "
                         f"{sorted(set(standbys) - set(range(1, len(endpoints))))}")
    if ranges is None:
        ranges = plan_layer_split(args.num_layers, len(endpoints), weights, args.head_cost_in_layers)
    elif len(ranges) != len(endpoints):
        raise ValueError(f"Expected {len(endpoints)} layer ranges, got {len(ranges)}")
    stages = [TopologyStage(stage_id=f"stage-{i}", stage_index=i, endpoint=endpoint,
                            layer_start=start, layer_end=end, host=parse_endpoint(endpoint)[0],
                            standby_endpoints=standbys.get(i, []))
              for i, (endpoint, (start, end)) in enumerate(zip(endpoints, ranges))]
    fingerprint = model_fingerprint(model_path)
    topology = Topology(topology_id=topology_id or f"chain-{secrets.token_hex(4)}", model_id=Path(model_path).stem, stages=stages,
                        model_fingerprint=fingerprint)

    def peer(i: int) -> PeerEndpoint | None:
        if not 0 <= i < len(stages):
            return None
        return PeerEndpoint(stage_id=stages[i].stage_id, stage_index=i, endpoint=stages[i].endpoint,
                            standby_endpoints=stages[i].standby_endpoints)

    configs = [StageConfig(stage_id=s.stage_id, stage_index=s.stage_index,
                           layer_start=s.layer_start, layer_end=s.layer_end,
                           model_path=str(model_path), model_fingerprint=fingerprint, bind_addr=s.endpoint,
                           upstream=peer(s.stage_index - 1), downstream=peer(s.stage_index + 1),
                           **stage_options)
               for s in stages]
    return topology, configs


def standby_configs(topology: Topology, configs: list[StageConfig]) -> dict[str, StageConfig]:
    """File name -> config of every standby stage: its stage's config on its own address."""
    return {f"stage-{stage.stage_index}-standby-{j}.json":
            configs[stage.stage_index].model_copy(update={"bind_addr": endpoint})
            for stage in topology.stages for j, endpoint in enumerate(stage.standby_endpoints, start=1)}


def write_plan(topology: Topology, configs: list[StageConfig], out_dir: str | Path, *,
               tls: bool = False) -> list[Path]:
    """topology.json, then stage-N.json per stage, then stage-N-standby-J.json per standby,
    owner-only (they hold the chain token). `tls`: a chain CA and a certificate per stage for
    its host under tls/ (stage/tls.py), named in each config."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "topology.json"]
    topology.save(paths[0])
    named = {f"stage-{c.stage_index}.json": c for c in configs} | standby_configs(topology, configs)
    if tls:
        issued = issue_certificates(out / "tls", {name.removesuffix(".json"): c.bind_host for name, c in named.items()})
        named = {name: c.model_copy(update={"tls": issued[name.removesuffix(".json")]}) for name, c in named.items()}
    for name, config in named.items():
        paths.append(out / name)
        paths[-1].touch(mode=0o600)
        config.save(paths[-1])
    return paths


def stage_kv_cache(kv_cache: KvCacheConfig, stage_index: int) -> KvCacheConfig:
    """One stage's share of a chain's cache settings: its own disk subdirectory."""
    if kv_cache.disk_dir is None:
        return kv_cache
    disk_dir = str(Path(kv_cache.disk_dir).resolve() / f"stage-{stage_index}")
    return kv_cache.model_copy(update={"disk_dir": disk_dir})


async def connect_topology(topology: Topology, model_path: str | Path, *,
                           auth_token: str | None = None, stage_wait_s: float = 0.0,
                           wait_for_chain: Callable[[Transport], Awaitable] | None = None, **options) -> ChainClient:
    """Stage 0 for a running chain: load layers [0, k), listen on the topology's stage-0
    endpoint for the direct return (and serve the model's tensors to stages that have no
    copy: stage/holder.py), wait up to `stage_wait_s` for the other stages to be up
    (stage_wait.py; or await `wait_for_chain`, a launcher that knows when they are),
    connect the lanes to stage 1."""
    check_model(model_path, topology.model_fingerprint, "stage 0")
    first = topology.stages[0]
    downstream = topology.stages[1].endpoints if len(topology.stages) > 1 else None
    holder = TensorHolder(model_path, topology, where="stage 0")
    if wait_for_chain is None and stage_wait_s > 0:
        wait_for_chain = functools.partial(wait_for_stages, topology, stage_wait_s)
    return await start_stage0(model_path, (first.layer_start, first.layer_end), downstream=downstream,
                              auth_token=auth_token, return_bind=first.endpoint, holder=holder,
                              wait_for_chain=wait_for_chain, **options)


async def start_stage0(model_path: str | Path, layers: tuple[int, int] | None = None, *,
                       dtype: str = "auto", device: str = "auto", repack: bool = True,
                       prefill_precision: str = "exact",
                       kv_cache: KvCacheConfig | None = None, otlp_endpoint: str | None = None,
                       otlp_protocol: str = "http", peer_wait_forwards: float | None = None,
                       decode_waves: int = 1, **client_options) -> ChainClient:
    """Stage 0 holding layers [0, k) (None: the whole model, a chain of one stage), started.
    `kv_cache`: its prefix cache (the disk tier under `disk_dir`/stage-0); None: none.
    `otlp_endpoint`: where its spans go (OTLP over `otlp_protocol`, http or grpc); None: nowhere."""
    model = load_stage(model_path, layers, dtype=dtype, device=device, progress=False, repack=repack,
                       prefill_precision=prefill_precision)
    prefix_cache = None
    if kv_cache is not None:
        prefix_cache = StagePrefixCache.build(
            stage_kv_cache(kv_cache, 0), model_path=str(model_path), layer_start=model.layers.start,
            layer_end=model.layers.end, kv_dtype=model.kv_dtype, weights=model.weight_format,
            ctx_size=min(client_options.get("ctx_size") or model.args.context_length,
                         model.args.context_length))
    client_options.setdefault("grammars", GrammarCompiler.for_model(model_path))
    batch = BatchSettings(waves=decode_waves) if peer_wait_forwards is None else BatchSettings(
        peer_wait_forwards=peer_wait_forwards, waves=decode_waves)
    client = ChainClient(model, prefix_cache=prefix_cache, batch=batch,
                         telemetry=Telemetry("skippy-stage0", otlp_endpoint, otlp_protocol=otlp_protocol),
                         **client_options)
    try:
        await client.start()
    except BaseException:
        await client.close()  # its runtime worker and any lane already dialed
        raise
    client.runtime.log_settings(0)
    return client


class Chain:
    """What a chain of stage processes and stage 0 here is, however its stages are placed
    (LocalChain, ray_chain.RayChain): every stage's options, supervision, and the measured
    split at start; split_restart.py reads `backend`, `retiring` and calls `restart_on`, `supervise`."""

    backoff_s: float | None = None  # the supervisor's between restarts (None: its default)

    def __init__(self, model_path: str | Path, num_stages: int, *, activation_dtype: str = "f32",
                 ctx_size: int = 2048, lane_count: int = 4, dtype: str = "auto", device: str = "auto",
                 repack: bool = True, prefill_precision: str = "exact", concurrency: int = 1,
                 log_level: str = "WARNING",
                 otlp_endpoint: str | None = None, otlp_protocol: str = "http",
                 kv_cache: KvCacheConfig | None = None, max_restarts: int | None = None,
                 split: str = "equal", apply_split_advice: bool = False, **client_options):
        """`kv_cache`: every stage's prefix-cache settings (disk tier: one subdirectory per
        stage under `disk_dir`); None: no prefix cache anywhere. `max_restarts`: supervise the
        stages (supervisor.py), restarting each at most this often; None: no supervision.
        `split`: "equal" or "auto": start so, wait for every stage's measurements, and start
        every stage again on the split they give (planner.py) if it differs.
        `apply_split_advice`: a stage's restart applies the split advice of `backend` (set by
        serve.py) when it names other ranges, starting every stage again on them (split_restart.py)."""
        if num_stages < 2:
            raise ValueError(f"Expected at least 2 stages for a chain, got {num_stages}")
        if split not in ("equal", "auto"):
            raise ValueError(f"Expected a split of 'equal' or 'auto', got {split!r}")
        self.model_path, self.num_stages, self.log_level = Path(model_path), num_stages, log_level
        self.kv_cache, self.max_restarts = kv_cache, max_restarts
        self.device = device  # every stage's, stage 0's included ("auto": CUDA where present)
        self.split, self.plan, self.first_plan = split, None, None  # the measured plan and the split's before it
        self.apply_split_advice, self.backend = apply_split_advice, None
        self.retiring: set = set()  # stage 0s replaced by a re-split, closing (split_restart.py)
        self.auth_token = secrets.token_urlsafe(32)
        self._model_args: ModelArgs | None = None
        self.client: ChainClient | None = None
        self.supervisor: Supervisor | None = None
        self.placement = None  # where stages 1..N-1 run (placement.py)
        self.topology: Topology | None = None
        both = dict(device=device, ctx_size=ctx_size, activation_dtype=activation_dtype,
                    prefill_precision=prefill_precision,
                    otlp_endpoint=otlp_endpoint, otlp_protocol=otlp_protocol,
                    peer_wait_forwards=ONE_WAVE_PEER_WAIT_FORWARDS, decode_waves=num_stages)
        self._stage_options = dict(both, auth_token=self.auth_token, lane_count=lane_count,
                                   weight_dtype=WEIGHT_NAMES[dtype], repack_weights=repack)
        self._stage0_options = dict(both, dtype=dtype, repack=repack, concurrency=concurrency,
                                    kv_cache=kv_cache, **client_options)

    async def start(self, on_stage_ready: Callable[[], None] = lambda: None) -> ChainClient:
        """Start every stage and stage 0 (`on_stage_ready` as each stage is up), then, with
        split "auto", the measured split; supervise them when `max_restarts` is set."""
        try:
            await self._start(on_stage_ready)
            if self.split == "auto":
                await self._measured_split(on_stage_ready)
        except BaseException:
            await self.close()
            raise
        if self.max_restarts is not None:
            self.supervise()
        return self.client

    def _stage_configs(self, configs: list[StageConfig]) -> list[StageConfig]:
        """`configs` with each stage's share of the chain's cache settings."""
        stage_kv = self.kv_cache or KvCacheConfig(mode="disabled")
        return [c.model_copy(update={"kv_cache": stage_kv_cache(stage_kv, c.stage_index)}) for c in configs]

    def supervise(self) -> None:
        backoff = {} if self.backoff_s is None else {"backoff_s": self.backoff_s}
        self.supervisor = Supervisor(self.placement, self.num_stages, self.client.transport,
                                     max_restarts=self.max_restarts, on_back=self.client.chain_changed,
                                     on_down=functools.partial(restart_on_advice, self), **backoff)
        self.supervisor.start()
        self.client.can_recover = self.supervisor.can_heal

    async def _measured_split(self, on_stage_ready: Callable[[], None]) -> None:
        """Plan from what the stages measured of themselves (and their links); start every
        stage again on that split if it is not this one. Every stage is used, as --stages
        asked: the plan says when fewer would be faster (`fewer_hosts`)."""
        model = model_cost(self.model_path, ctx_size=self._stage_options["ctx_size"],
                           lane_count=self._stage_options["lane_count"],
                           activation_dtype=self._stage_options["activation_dtype"], args=self._model_args)
        self.first_plan, self.plan = await plan_from_measurements(self.client, self.topology, model,
                                                                  use_all_hosts=True)
        current = [(s.layer_start, s.layer_end) for s in self.topology.stages]
        log.info("measured split: %s", self.plan.describe([f"stage {i}" for i in range(self.num_stages)]))
        if list(self.plan.ranges) == current:
            return
        await self.client.close()
        self.client = None
        await self.restart_on(list(self.plan.ranges), on_ready=on_stage_ready)

    async def close(self) -> None:
        """Stop the chain in the order that keeps it quiet: the supervisor first (a stage stopped
        below is not a failure), stage 0's lanes, the stages, then any replaced stage 0 still open."""
        if self.supervisor is not None:
            await self.supervisor.close()
        if self.client is not None:
            await self.client.close()
        if self.placement is not None:
            await self.placement.stop()
        retiring = list(self.retiring)
        for task in retiring:
            task.cancel()
        await asyncio.gather(*retiring, return_exceptions=True)
        self.client = None
        self._dir.cleanup()

    async def __aenter__(self) -> ChainClient:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()


class LocalChain(Chain):
    """Stages 1..N-1 as child processes on loopback, stage 0 in this process."""

    def __init__(self, model_path: str | Path, num_stages: int, *, threads: int | None = None,
                 dtype: str = "auto", link_conditioning: LinkConditioning | None = None, **options):
        """`threads`: torch threads in every stage; by default every core: a stream visits the
        stages in turn, so each may use them all while the others wait, provided a waiting
        stage's OpenMP workers stop spinning soon (model/threads.py: co_located_spin_count,
        given to the stage processes here). Enough sessions decoding form one wave per stage
        instead, each wave's forward on its share of the threads (runtime/batch_policy.py:
        waves). `link_conditioning`: a test knob on every link of the chain, stage 0's lanes
        included (stage/link.py). `split`'s "equal" is by bytes (plan_chain). The rest: Chain's."""
        super().__init__(model_path, num_stages, dtype=dtype, link_conditioning=link_conditioning, **options)
        self.threads = threads or os.cpu_count() or 1
        self._stage_options.update(threads=self.threads, link_conditioning=link_conditioning,
                                   omp_spin_count=int(co_located_spin_count(model_path, dtype)))
        self._model_args = model_args(model_path)
        self._ranges: list[tuple[int, int]] | None = None  # None: equal bytes
        self._dir = tempfile.TemporaryDirectory(prefix="skippy-chain-")
        self._plan()

    @property
    def processes(self):
        """The stage processes, stage 1 first (bench scripts read their pids)."""
        return self.placement.processes

    def _plan(self) -> None:
        """Pick free loopback ports and build the topology and every stage's config."""
        endpoints = [f"127.0.0.1:{port}" for port in free_ports(self.num_stages)]
        self.topology, configs = plan_chain(self.model_path, endpoints, ranges=self._ranges,
                                            args=self._model_args, **self._stage_options)
        self.configs = self._stage_configs(configs)
        self.placement = LocalProcesses(Path(self._dir.name), self.configs, log_level=self.log_level)

    async def _start(self, on_stage_ready: Callable[[], None]) -> None:
        """Start every stage, then stage 0, on other free ports when one was taken meanwhile."""
        import torch

        torch.set_num_threads(self.threads)
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                await self._start_stages(on_stage_ready)
                self.client = await self._connect()
                return
            except PortTaken as error:
                await self.placement.stop()
                if attempt == START_ATTEMPTS:
                    raise RuntimeError(f"{error} ({START_ATTEMPTS} attempts)") from None
                log.warning("%s; retrying on other ports", error)
                self._plan()

    async def restart_on(self, ranges: list[tuple[int, int]], *, lost: int | None = None,
                         on_ready: Callable[[], None] = lambda: None) -> None:
        """Every stage again on `ranges`, on fresh ports, stage 0 as a new `client` (the one
        before it is left to the caller): a measured split at start, or a restart that applies
        the split advice (split_restart.py; `lost`: the stage that died, here nothing to wait for)."""
        await self.placement.stop()
        self._ranges = list(ranges)
        self._plan()
        await self._start_stages(on_ready)
        self.client = await self._connect()

    async def _connect(self) -> ChainClient:
        try:
            return await connect_topology(self.topology, self.model_path, auth_token=self.auth_token,
                                          **self._stage0_options)
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                raise
            raise PortTaken(f"stage 0's port {self.configs[0].bind_port} was taken") from error

    async def _start_stages(self, on_ready: Callable[[], None]) -> None:
        write_plan(self.topology, self.configs, self._dir.name)
        await self.placement.start(on_ready)



WEIGHT_NAMES = {name: short for short, name in WEIGHT_DTYPES.items()}  # --dtype -> StageConfig.weight_dtype

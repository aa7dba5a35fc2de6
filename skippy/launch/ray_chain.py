"""`skippy serve --ray`: a chain whose stages a Ray cluster places, starts and restarts.

Ray does what a cluster engine is good at: which nodes, reserving their resources, starting
a process there and starting it again when it dies. skippy keeps the data: its protocol,
mutual TLS, the chain token, mid-stream recovery. One placement group (a bundle per stage,
stage 0's pinned to this node), a StageHost actor (stage_host.py) per stage 1..N-1 in its
bundle, stage 0 here; the supervisor watches every stage through `RayActors`, the Placement.
How a start, a restart and a lost node go: docs/architecture.md (On Ray).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..driver.client import ChainClient
from ..protocol import PeerEndpoint, StageConfig, TlsConfig, Topology, is_loopback, parse_endpoint
from ..stage import certificates
from .local_chain import Chain, connect_topology, plan_chain
from .placement import STARTUP_TIMEOUT_S

log = logging.getLogger("skippy.launch")
NAMESPACE = "skippy"  # the Ray namespace of every actor and placement group skippy makes
RETRY_S = 0.05        # between calls to an actor about to exit (Ray then restarts it)


class RaySettings(BaseModel):
    """`skippy serve --ray`'s own options (the rest are serve's)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    address: str = "auto"  # `ray.init`'s: "auto" (the cluster this node belongs to) or HOST:PORT
    placement: Literal["spread", "pack"] = "spread"  # one stage per node, or several allowed on one
    # each stage's bundle: one for every stage, or one per stage (the split follows their CPUs)
    stage_resources: list[dict[str, float]] = [{"CPU": 1.0}]
    port: int = Field(7200, ge=1, le=65535 - 64)  # stage i listens on port + i (0: stage 0's return listener)
    placement_timeout_s: float = Field(120.0, gt=0)  # waiting for the cluster to have room
    standby: bool = True  # a warm standby process beside each stage for its restarts (warm_stage.py)

    @field_validator("stage_resources")
    @classmethod
    def _resources(cls, value: list[dict[str, float]]) -> list[dict[str, float]]:
        if not value or any(not bundle or min(bundle.values()) < 0 for bundle in value):
            raise ValueError(f"Expected stage resources like {{\"CPU\": 4}} (one, or one per stage), got {value}")
        return value

    def bundles(self, num_stages: int, driver_ip: str) -> list[dict[str, float]]:
        """One bundle per stage; stage 0's must be on this node (vLLM's trick: a sliver of the
        node's own resource, `node:<ip>`)."""
        bundles = [dict(bundle) for bundle in self.stage_resources * (num_stages // len(self.stage_resources))]
        bundles[0][f"node:{driver_ip}"] = 0.001
        return bundles

    @property
    def strategy(self) -> str:
        return {"spread": "STRICT_SPREAD", "pack": "PACK"}[self.placement]


def split_weights(bundles: list[dict[str, float]]) -> list[float] | None:
    """The layer split follows the bundles' CPUs; None (even) when they are all alike."""
    cpus = [bundle.get("CPU", 1.0) or 1.0 for bundle in bundles]
    return None if len(set(cpus)) == 1 else cpus


def check_cluster_security(node_ips: list[str], token_enforced: Callable[[], bool], *, insecure: bool,
                           address: str) -> None:
    """Refuse a cluster off loopback that anyone on its network may use, unless `insecure`:
    whoever can submit work to it runs code on every node, skippy's stages included."""
    if all(is_loopback(ip) for ip in node_ips) or token_enforced():
        return
    where = f"the Ray cluster at {address} (nodes {', '.join(sorted(node_ips))})"
    if not insecure:
        raise ValueError(f"{where} runs without token authentication: anyone who can reach it can run code "
                         "on every node, and read or drive the stages skippy would start there. Fix: start "
                         "every node and this server with RAY_AUTH_MODE=token and the same RAY_AUTH_TOKEN "
                         "(`ray get-auth-token --generate` makes one), or pass --insecure to use it anyway.")
    log.warning("%s runs without token authentication (--insecure): anyone on its network can use it", where)


def address_towards(ray_address: str) -> str | None:
    """This machine's address on the way to a cluster at HOST:PORT (None for "auto"): the node
    this driver joins. Ray itself picks any raylet it finds on the machine, the head first,
    which is another node where one machine runs several (network namespaces, tests)."""
    if ray_address == "auto":
        return None
    host, port = parse_endpoint(ray_address)
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # UDP: no packet is sent, the kernel only picks the route
        return probe.getsockname()[0]


def gcs_requires_token(gcs_address: str) -> bool:
    """Whether the cluster's control service refuses a call that carries no token: the
    cluster's own setting, which the driver's environment does not tell."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(gcs_address) as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=10)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNAUTHENTICATED:
                return True
            raise RuntimeError(f"Could not ask Ray's control service at {gcs_address} about its "
                               f"authentication: {error.code().name} {error.details()}") from None
    return False


class RayChain(Chain):
    """Stages 1..N-1 as actors on a Ray cluster, stage 0 in this process."""

    backoff_s = 0.0  # Ray restarts an actor at once and that takes a second or more: no backoff on top

    def __init__(self, model_path: str | Path, num_stages: int, settings: RaySettings, *,
                 threads: int | None = None, weights: list[float] | None = None, max_restarts: int = 5,
                 insecure: bool = False, stage_wait_s: float = 3600.0,
                 on_placed: Callable[[str], None] = lambda line: None, **options):
        """`threads`: torch threads of every stage (default: its bundle's CPUs). `insecure`: use
        a cluster without token authentication off loopback anyway. `stage_wait_s`: how long a
        stage's start may take, fetching its layers from stage 0 included. `split`'s "equal" is
        by the bundles' CPUs (or `weights`); "auto" starts again on the same nodes.
        `on_placed`: told, in words, where the stages went once Ray placed them. The rest: Chain's."""
        super().__init__(model_path, num_stages, max_restarts=max_restarts, **options)
        self.settings, self.threads, self.weights = settings, threads, weights
        self.insecure, self.stage_wait_s, self.on_placed = insecure, stage_wait_s, on_placed
        self.chain_id = f"chain-{secrets.token_hex(4)}"
        self._dir = tempfile.TemporaryDirectory(prefix=f"skippy-{self.chain_id}-")  # owner-only: the CA key
        self.group = None
        self._tls: TlsConfig | None = None  # stage 0's identity, issued once placed
        self._connected = False

    async def _start(self, on_stage_ready: Callable[[], None]) -> None:
        """Place and start every stage, then stage 0."""
        import torch

        driver_ip = self._connect()
        bundles = self.settings.bundles(self.num_stages, driver_ip)
        self.group = await self._place(bundles)
        node_ips = self._bundle_ips()
        if node_ips[0] != driver_ip:  # the node:<ip> resource pins it; a cluster that disagrees is broken
            raise RuntimeError(f"Ray placed stage 0's bundle on {node_ips[0]}, not on this node ({driver_ip})")
        endpoints = [_endpoint(ip, self.settings.port + i) for i, ip in enumerate(node_ips)]
        self.on_placed(f"Ray placed {self.num_stages} stages ({self.settings.strategy}): "
                       + ", ".join(f"stage-{i} on {ip}" for i, ip in enumerate(node_ips)))
        configs = self._plan(endpoints, weights=self.weights or split_weights(bundles))
        ca_dir = Path(self._dir.name) / "tls"
        stage0_tls = certificates.issue_certificates(ca_dir, {"stage-0": driver_ip})["stage-0"]
        threads = [self.threads or max(1, int(bundle.get("CPU", 1))) for bundle in bundles]
        torch.set_num_threads(threads[0])  # stage 0, here
        self.placement = RayActors(self.group, bundles, configs, self.topology, ca_dir, threads,
                                   chain_id=self.chain_id, log_level=self.log_level,
                                   ready_timeout_s=self.stage_wait_s, standby=self.settings.standby)
        self._tls = stage0_tls.resolved(Path(self._dir.name))
        await self._start_stages(self.placement.start(on_stage_ready))

    def _plan(self, endpoints: list[str], *, weights: list[float] | None = None,
              ranges: list[tuple[int, int]] | None = None) -> list[StageConfig]:
        """The topology (kept) and every stage's config for the placed endpoints."""
        self.topology, configs = plan_chain(self.model_path, endpoints, weights=weights, ranges=ranges,
                                            topology_id=self.chain_id, **self._stage_options)
        return self._stage_configs(configs)

    async def _start_stages(self, actors_started) -> None:
        """The actors' stages (`actors_started`, a coroutine) and stage 0 at once: stage 0 loads
        and listens (holding the model for the stages that fetch their layers), waits until
        every actor reports its stage ready, then dials. A failure on either side ends the other."""
        stages = asyncio.ensure_future(actors_started)
        try:
            await asyncio.sleep(0)  # the actors are asked for first: stage 0's load below holds the loop
            self.client = await connect_topology(self.topology, self.model_path, auth_token=self.auth_token,
                                                 tls=self._tls,
                                                 wait_for_chain=lambda _: stages, **self._stage0_options)
        finally:
            stages.cancel()  # stage 0 failed before it waited for them (nothing, once they are done)
            await asyncio.gather(stages, return_exceptions=True)
        self.placement.client = self.client

    async def restart_on(self, ranges: list[tuple[int, int]], *, lost: int | None = None,
                         on_ready: Callable[[], None] = lambda: None) -> None:
        """Every stage again on `ranges`, on the same actors and ports, stage 0 as a new
        `client` (the one before it stops listening: stage 0's port is the chain's; the caller
        closes it): a measured split at start, or a restart that applies the split advice
        (split_restart.py). `lost`: the stage that died; its actor is waited for first (Ray
        restarts it, on another node if its node was lost) and plans where it is now."""
        if lost is not None:
            await self.placement.locate(lost)
        if self.client is not None and self.client.listener is not None:
            await self.client.listener.close()
        configs = self._plan(list(self.placement.endpoints), ranges=list(ranges))
        await self.placement.stop_stages()
        self.placement.configs, self.placement.topology = configs, self.topology
        await self._start_stages(self.placement.start_stages(on_ready))

    def _connect(self) -> str:
        """Join the cluster and check it is safe to use; this node's address."""
        try:
            import ray
        except ImportError:
            raise RuntimeError("skippy serve --ray needs Ray on this node and every other: "
                               "pip install 'skippy[ray]'") from None

        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # never report to Ray's servers
        sigterm = signal.getsignal(signal.SIGTERM)
        try:
            ray.init(address=self.settings.address, namespace=NAMESPACE, logging_level=logging.WARNING,
                     configure_logging=False, _node_ip_address=address_towards(self.settings.address))
        except Exception as error:  # noqa: BLE001 - Ray raises many kinds; each says what failed
            raise RuntimeError(f"could not join the Ray cluster at {self.settings.address}: {error}") from error
        finally:
            signal.signal(signal.SIGTERM, sigterm)  # ray.init's own exits the process at once: ours stops stages
        self._connected = True
        alive = [node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]]
        gcs = ray.get_runtime_context().gcs_address
        check_cluster_security(alive, lambda: gcs_requires_token(gcs), insecure=self.insecure,
                               address=self.settings.address)
        # the node this driver joined (get_node_ip_address guesses by a route, which a host without a
        # default route has not)
        this_node = ray.get_runtime_context().get_node_id()
        return next(node["NodeManagerAddress"] for node in ray.nodes() if node["NodeID"] == this_node)

    async def _place(self, bundles: list[dict[str, float]]):
        from ray.util.placement_group import placement_group, remove_placement_group

        group = placement_group(bundles, strategy=self.settings.strategy, name=f"skippy-{self.chain_id}")
        ready = asyncio.wrap_future(group.ready().future())
        ready.add_done_callback(lambda done: done.cancelled() or done.exception())  # a removed group's, unread
        started, next_note = time.monotonic(), 2.0
        while True:
            waited = time.monotonic() - started
            done, _ = await asyncio.wait({ready}, timeout=min(next_note, self.settings.placement_timeout_s) - waited)
            if done:
                return group
            waited = time.monotonic() - started
            if waited >= self.settings.placement_timeout_s:
                message = unplaced(group, bundles, self.settings, waited)
                remove_placement_group(group)
                raise RuntimeError(message)
            log.warning("waiting for Ray to place %d stage bundles (%s, %s): %.0f s so far", len(bundles),
                        self.settings.strategy, _describe_bundle(bundles[-1]), waited)
            next_note *= 2

    def _bundle_ips(self) -> list[str]:
        import ray
        from ray.util.placement_group import placement_group_table

        by_node = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        placed = placement_group_table(self.group)["bundles_to_node_id"]
        return [by_node[placed[i]] for i in range(self.num_stages)]

    async def close(self) -> None:
        await super().close()  # the placement: actors, group
        if self.placement is None and self.group is not None:  # placed, no actor yet
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
        self.placement = self.group = None
        if self._connected:
            import ray

            ray.shutdown()
            self._connected = False


class RayActors:
    """The Placement (placement.py) of a Ray chain: one StageHost actor per stage 1..N-1.

    Every start, the first and each after Ray restarted an actor, is the same: ask the actor
    where it runs and for its public key, sign it a certificate for that address, start the
    stage with its config. An actor that landed on another node is a stage that moved: the
    stage before it (or stage 0's lanes) is re-pointed to it."""

    def __init__(self, group, bundles: list[dict[str, float]], configs: list[StageConfig], topology: Topology,
                 ca_dir: Path, threads: list[int], *, chain_id: str, log_level: str,
                 ready_timeout_s: float = STARTUP_TIMEOUT_S, standby: bool = True):
        self.group, self.bundles, self.configs, self.topology = group, bundles, configs, topology
        self.standby = standby  # each actor keeps a warm standby for its stage's restarts
        self.ca_dir, self.threads, self.chain_id, self.log_level = ca_dir, threads, chain_id, log_level
        self.ready_timeout_s = ready_timeout_s  # a stage's start, a fetch of its layers included
        self.endpoints = [stage.endpoint for stage in topology.stages]
        self.node_ips = [stage.host for stage in topology.stages]
        self.actors: list = [None] * len(configs)     # index 0: stage 0 is this process
        self._sentinels: list = [None] * len(configs)  # each running stage's `wait` call
        self._failures = [""] * len(configs)           # why a stage that failed to start is down
        self.client: ChainClient | None = None         # stage 0's, re-pointed when stage 1 moves

    def endpoint(self, index: int) -> str:
        return self.endpoints[index]

    def node_ip(self, index: int) -> str:
        return self.node_ips[index]

    async def start(self, on_ready: Callable[[], None]) -> None:
        """An actor per stage, then every stage at once; each counted as it is ready."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .stage_host import StageHost

        host = ray.remote(StageHost)
        for index in range(1, len(self.configs)):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.group,
                                                        placement_group_bundle_index=index)
            # the bundle holds the stage's CPUs; the actor itself asks for none of them
            self.actors[index] = host.options(
                name=f"skippy-{self.chain_id}-stage-{index}", namespace=NAMESPACE, max_restarts=-1,
                max_task_retries=0, max_concurrency=4, num_cpus=0, num_gpus=self.bundles[index].get("GPU", 0),
                scheduling_strategy=strategy,
            ).remote(index, self.chain_id, self._port(index), self.log_level, self.standby)  # fmt: skip
        await self.start_stages(on_ready)

    async def start_stages(self, on_ready: Callable[[], None]) -> None:
        """Every actor's stage from `configs`, at once; each counted as it is ready."""
        async def start_one(index: int) -> None:
            await self._start(index)
            on_ready()

        await asyncio.gather(*(start_one(index) for index in range(1, len(self.configs))))

    async def stop_stages(self) -> None:
        """End every stage but keep its actor (on its node, with its key), for a start on new
        configs (a measured split). With no supervisor watching: nothing restarts them."""
        await asyncio.gather(*(actor.stop_stage.remote() for actor in self.actors if actor is not None))
        self._sentinels = [None] * len(self.configs)

    async def locate(self, index: int) -> None:
        """Wait for stage `index`'s actor to run (again: Ray restarts a dead one, elsewhere if its
        node was lost), and take where it runs now as the stage's address."""
        info = await self._describe(index)
        self.endpoints[index], self.node_ips[index] = info["endpoint"], info["node_ip"]

    def _port(self, index: int) -> int:
        return parse_endpoint(self.topology.stages[index].endpoint)[1]

    async def _start(self, index: int) -> str:
        asked = time.monotonic()
        info = await self._describe(index)
        back = time.monotonic()
        moved = info["endpoint"] != self.endpoints[index]
        self.endpoints[index], self.node_ips[index] = info["endpoint"], info["node_ip"]
        try:
            if info["starting"]:  # restarted on its node, it restarted the stage from its own files
                started = await self.actors[index].wait_ready.remote()
            else:
                cert = certificates.sign_certificate(self.ca_dir, f"stage-{index}", info["node_ip"],
                                                     info["public_key"])
                started = await self.actors[index].start.remote(
                    self._config(index).model_dump_json(), self.topology.model_dump_json(), cert,
                    (self.ca_dir / "ca.pem").read_bytes(), self.threads[index], self.ready_timeout_s)
        except Exception as error:
            self._sentinels[index], self._failures[index] = None, f"could not start: {_cause(error)}"
            raise RuntimeError(f"stage {index} on {info['node_ip']}: {_cause(error)}") from None
        self._sentinels[index] = self.actors[index].wait.remote()
        log.info("stage %d ready on %s (its actor answered in %.2f s, the stage was ready %.2f s later; "
                 "stage pid %d)", index, info["endpoint"], back - asked, time.monotonic() - back, started["stage_pid"])
        if info["starting"] and index + 1 < len(self.configs):
            await self._repoint(index)  # its kept config may predate a move of the next stage
        if moved:
            await self._repoint(index - 1)
        return info["endpoint"]

    async def _describe(self, index: int) -> dict:
        """The actor's answer, once Ray has it running (again); a node that is gone delays it
        until Ray has placed its bundle elsewhere."""
        from ray.exceptions import RayActorError

        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            try:
                info = await self.actors[index].describe.remote()
                if not info["down"]:
                    return info
            except RayActorError as error:
                if _is_gone_for_good(error):
                    raise RuntimeError(f"stage {index}'s Ray actor is gone: {_cause(error)}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"stage {index}'s Ray actor did not come back within {STARTUP_TIMEOUT_S:g} s")
            await asyncio.sleep(RETRY_S)

    def _config(self, index: int) -> StageConfig:
        """Stage `index`'s config for where every stage is now."""
        def peer(i: int) -> PeerEndpoint | None:
            if not 0 <= i < len(self.configs):
                return None
            return PeerEndpoint(stage_id=f"stage-{i}", stage_index=i, endpoint=self.endpoints[i])

        return self.configs[index].model_copy(update={"bind_addr": self.endpoints[index],
                                                      "upstream": peer(index - 1), "downstream": peer(index + 1)})

    async def _repoint(self, index: int) -> None:
        """Stage `index` dials its next stage where that is now."""
        downstream = self._config(index).downstream
        if index == 0:
            self.client.downstream = downstream.endpoint  # the next lane dialed goes there
            return
        try:
            await self.actors[index].repoint.remote(downstream.model_dump_json())
        except Exception as error:  # noqa: BLE001 - it restarts with the new address anyway
            log.warning("stage %d could not be re-pointed to %s: %s", index, downstream.endpoint, _cause(error))

    async def wait_down(self, index: int) -> str:
        from ray.exceptions import RayActorError

        if self._sentinels[index] is None:
            return self._failures[index]
        try:
            return await self._sentinels[index]
        except RayActorError as error:
            return f"its Ray actor died ({_actor_death(error)})"

    async def kill(self, index: int) -> None:
        import ray

        ray.kill(self.actors[index], no_restart=False)  # Ray starts it again

    async def restart(self, index: int) -> str:
        return await self._start(index)  # Ray has restarted the actor, or is at it

    async def give_up(self, index: int) -> None:
        import ray

        ray.kill(self.actors[index], no_restart=True)

    async def stop(self) -> None:
        """End every stage, then its actor, then the placement group: nothing of the chain stays."""
        import ray
        from ray.util.placement_group import remove_placement_group

        actors = [actor for actor in self.actors if actor is not None]
        stops = [asyncio.wrap_future(actor.stop.remote().future()) for actor in actors]
        if stops:
            await asyncio.wait(stops, timeout=15)
        for actor in actors:
            ray.kill(actor, no_restart=True)
        remove_placement_group(self.group)


def unplaced(group, bundles: list[dict[str, float]], settings: RaySettings, waited_s: float) -> str:
    """What Ray could not place, and what the cluster has, in words."""
    import ray
    from ray.util.placement_group import placement_group_table

    state = placement_group_table(group)
    scheduling = state.get("stats", {}).get("scheduling_state", "")
    names = sorted({name for bundle in bundles for name in bundle if not name.startswith("node:")})
    nodes = "; ".join(f"{node['NodeManagerAddress']} {_describe_bundle({n: node['Resources'].get(n, 0) for n in names})}"
                      for node in ray.nodes() if node["Alive"])
    need = (f"{len(bundles)} nodes" if settings.strategy == "STRICT_SPREAD" else "room for") + \
        f" with {_describe_bundle(bundles[-1])} each"
    return (f"Ray could not place the chain's {len(bundles)} stages within {waited_s:.0f} s "
            f"({settings.strategy}: {need}; placement {state.get('state', '?')}"
            f"{', ' + scheduling if scheduling else ''}). The cluster's nodes: {nodes}. Fix: add nodes, ask for "
            f"fewer --stages or smaller --ray-stage-resources, or --ray-placement pack")


def _describe_bundle(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{name}: {value:g}" for name, value in bundle.items() if not name.startswith("node:")) + "}"


def _endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _cause(error: BaseException) -> str:
    """A Ray error's first line, or the exception an actor method raised."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        return str(cause)
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _actor_death(error: BaseException) -> str:
    """Why Ray says an actor is gone, in one line."""
    from ray.exceptions import ActorUnavailableError

    if isinstance(error, ActorUnavailableError):
        return "its process or node stopped answering"
    lines = [line.strip() for line in str(error).splitlines() if line.strip() and not line.startswith("\t")]
    return lines[-1] if lines else type(error).__name__


def _is_gone_for_good(error: BaseException) -> bool:
    """An actor whose constructor raised (skippy missing on its node, say): Ray does not
    restart those. Any other death of an actor with max_restarts=-1 is a restart under way."""
    from ray.exceptions import ActorDiedError

    return isinstance(error, ActorDiedError) and error.actor_init_failed


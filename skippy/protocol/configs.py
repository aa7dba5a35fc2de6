"""Configs that cross a process or a file: `StageConfig` and `Topology` (spec §9.1, §9.2).

pydantic models, frozen and strict about unknown keys, validated once on load.
`plan_layer_split` is the pure layer planner behind `skippy plan`.
"""

from __future__ import annotations

import ipaddress
import math
from pathlib import Path
from typing import Literal, Self, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .constants import MAX_AUTH_TOKEN_BYTES, MIN_AUTH_TOKEN_BYTES


def parse_endpoint(endpoint: str, *, allow_port_zero: bool = False) -> tuple[str, int]:
    """Split "host:port" (IPv6 as "[::1]:port") into (host, port); ValueError if malformed."""
    host, sep, port_text = endpoint.rpartition(":")
    if not sep or not host:
        raise ValueError(f"Expected an endpoint 'host:port', got {endpoint!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"Expected an IPv6 host in brackets ('[::1]:port'), got {endpoint!r}")
    if not host or any(c.isspace() for c in host):
        raise ValueError(f"Expected a host name or address in {endpoint!r}, got {host!r}")
    if not port_text.isdigit():
        raise ValueError(f"Expected a numeric port in {endpoint!r}, got {port_text!r}")
    port = int(port_text)
    lowest = 0 if allow_port_zero else 1
    if not lowest <= port <= 65535:
        raise ValueError(f"Expected a port in {lowest}..65535 in {endpoint!r}, got {port}")
    return host, port


def is_loopback(host: str) -> bool:
    """A host only this machine can reach: localhost, 127.0.0.0/8, ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it resolves to whatever the network says


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    @classmethod
    def load(cls, path: str | Path) -> Self:
        """Read and validate a JSON file (pydantic.ValidationError names the bad field)."""
        return cls.model_validate_json(Path(path).read_text(encoding="utf-8"))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=2) + "\n", encoding="utf-8")


def _endpoints_parse(values: list[str]) -> list[str]:
    for value in values:
        parse_endpoint(value)
    if len(set(values)) != len(values):
        raise ValueError(f"Expected distinct endpoints, got {values}")
    return values


class PeerEndpoint(_Frozen):
    """A stage and where it is reached: its endpoint, then the standbys serving its layers."""

    stage_id: str
    stage_index: int = Field(ge=0)
    endpoint: str
    standby_endpoints: list[str] = []  # dialed in turn when `endpoint` does not answer

    @field_validator("endpoint")
    @classmethod
    def _endpoint_parses(cls, value: str) -> str:
        parse_endpoint(value)
        return value

    _standbys_parse = field_validator("standby_endpoints")(_endpoints_parse)

    @property
    def endpoints(self) -> list[str]:
        return [self.endpoint, *self.standby_endpoints]


class KvCacheConfig(_Frozen):
    """Prefix KV cache settings (spec §4, §9.1 `kv_cache`)."""

    mode: Literal["disabled", "auto", "record", "lookup-record"] = "auto"
    max_entries: int = Field(64, ge=0)
    max_bytes: int = Field(0, ge=0)            # 0 = no byte budget
    min_tokens: int = Field(64, ge=1)          # shortest prefix worth recording
    stride_tokens: int = Field(128, ge=1)      # shared-prefix candidate grid
    disk_dir: str | None = None                # L3 tier; None = memory only
    disk_budget_bytes: int = Field(0, ge=0)    # 0 = no disk budget
    # "evict": memory evictions (and what memory holds at shutdown) go to disk;
    # "record": every recorded entry is written through at once (survives a crash)
    disk_policy: Literal["evict", "record"] = "evict"


class TlsConfig(_Frozen):
    """Mutual TLS for a stage's links off loopback (`skippy plan` writes the files): the chain's
    CA, and this stage's certificate (its host in the subject alternative names) and key.
    Relative paths are relative to the config file that holds them."""

    ca_file: str
    cert_file: str
    key_file: str

    def resolved(self, base: Path) -> TlsConfig:
        return TlsConfig(**{name: str(base / value) for name, value in self.model_dump().items()})


class LinkConditioning(_Frozen):
    """A test knob (the original's --downstream-wire-* flags): what a WAN link would do to the
    frames this process sends: a fixed delay, jitter, a bandwidth cap and random stalls,
    from a seeded generator so a run repeats. Off unless a config sets it."""

    delay_ms: float = Field(0.0, ge=0)    # one way, every frame
    jitter_ms: float = Field(0.0, ge=0)   # plus uniform [0, jitter) per frame (order is kept)
    mbps: float = Field(0.0, ge=0)        # the link's rate in Mbit/s; 0 = unlimited
    stall_ms: float = Field(0.0, ge=0)    # a stall this long ...
    stall_p: float = Field(0.0, ge=0, le=1)  # ... before a frame, with this probability
    seed: int = 0


class Timeouts(_Frozen):
    """Every wait of a chain that may end without an answer, named in one place (seconds).
    A stage's come from its config; stage 0's from `skippy serve`'s (ServeConfig.timeouts)."""

    connect_s: float = Field(2.0, gt=0)         # a dial to a stage or to stage 0's return listener (§2.7)
    handshake_s: float = Field(20.0, gt=0)      # auth preamble and READY; a return stream's first frame
    tls_handshake_s: float = Field(30.0, gt=0)  # a TLS handshake a listener waits for
    probe_s: float = Field(1.0, gt=0)           # a status query: its dial, handshake and answer, each
    reply_s: float = Field(30.0, gt=0)          # any reply of the chain: an ACK, a prediction
    stop_s: float = Field(5.0, gt=0)            # an early Stop; past it the lane is closed instead
    recovery_s: float = Field(30.0, ge=0)       # a request waits this long for a broken chain (0: fails at once)
    admission_s: float = Field(60.0, ge=0)      # a request waits this long for a lane (0: no limit)
    backend_s: float = Field(600.0, ge=0)       # the API waits this long for the next token (0: no limit)
    abandon_s: float = Field(5.0, gt=0)         # a generation the client left, until its next event
    startup_s: float = Field(600.0, gt=0)       # a local stage process, until it is ready
    shutdown_s: float = Field(10.0, gt=0)       # a stage's engine thread, until it ends at shutdown


class StageConfig(_Frozen):
    """One stage process: its identity, layer range, peers and runtime settings (spec §9.1)."""

    stage_id: str
    stage_index: int = Field(ge=0)
    layer_start: int = Field(ge=0)
    layer_end: int = Field(ge=1)               # half-open
    model_path: str
    model_fingerprint: str | None = None       # the planned model's (model/fingerprint.py); checked at start
    # with no file at model_path: where this stage's slice is cached (None: cache_root()/models/<fingerprint>),
    # and the holders it fetches it from (none named: stage 0's endpoint in the topology)
    model_cache: str | None = None
    model_sources: list[str] = []
    ctx_size: int = Field(2048, ge=1)
    lane_count: int = Field(4, ge=1)
    bind_addr: str = "127.0.0.1:0"             # loopback by default; port 0 = OS-chosen
    upstream: PeerEndpoint | None = None
    downstream: PeerEndpoint | None = None     # None = the final stage
    auth_token: str | None = Field(None, repr=False)
    activation_dtype: Literal["f32", "f16", "bf16", "q8", "auto"] = "f32"  # auto: per frame, from the measured link
    weight_dtype: Literal["auto", "f32", "f16", "bf16", "int4", "int8"] = "auto"
    repack_weights: bool = True                # a batch-friendly copy of float32 CPU weights
    # prompts' matmuls on AMX-BF16 tiles (bf16) or the integer kernels (exact: a prompt's rows
    # are the bits of the decode steps that would replay it); StageModel's prefill_precision
    prefill_precision: Literal["exact", "bf16"] = "exact"
    device: str = "auto"
    max_inflight: int = Field(4, ge=1)
    reply_credit_limit: int | None = Field(None, ge=0)   # None = max_inflight - 1 (§2.6)
    kv_cache: KvCacheConfig = KvCacheConfig()
    # batch a decoding peer due back within this many forwards (runtime/batch_policy.py)
    peer_wait_forwards: float = Field(0.25, ge=0.0)
    # the waves decoding sessions form when stages share one machine's cores (one per
    # stage, each wave's forward on its share of them); 1: however they arrive
    decode_waves: int = Field(1, ge=1)
    threads: int | None = Field(None, ge=1)    # torch threads; None = torch's default
    # libgomp's idle spin (GOMP_SPINCOUNT), set as the process starts (model/threads.py
    # set_spin_count); stages sharing one machine's cores spin less. None: libgomp's default
    omp_spin_count: int | None = Field(None, ge=0)
    otlp_endpoint: str | None = None           # export spans over OTLP; None = no spans
    otlp_protocol: Literal["http", "grpc"] = "http"  # OTLP over HTTP (port 4318) or gRPC (4317)
    tls: TlsConfig | None = None               # required (with auth_token) to listen off loopback
    insecure: bool = False                     # listen off loopback without them anyway (warned)
    link_conditioning: LinkConditioning | None = None  # a test knob on the links this stage dials
    timeouts: Timeouts = Timeouts()

    @field_validator("bind_addr")
    @classmethod
    def _bind_addr_parses(cls, value: str) -> str:
        parse_endpoint(value, allow_port_zero=True)
        return value

    _sources_parse = field_validator("model_sources")(_endpoints_parse)

    @field_validator("auth_token")
    @classmethod
    def _token_length(cls, value: str | None) -> str | None:
        if value is not None:
            nbytes = len(value.encode("utf-8"))
            if not MIN_AUTH_TOKEN_BYTES <= nbytes <= MAX_AUTH_TOKEN_BYTES:
                raise ValueError(f"Expected an auth token of {MIN_AUTH_TOKEN_BYTES}.."
                                 f"{MAX_AUTH_TOKEN_BYTES} UTF-8 bytes, got {nbytes}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> StageConfig:
        if self.layer_end <= self.layer_start:
            raise ValueError(f"Expected layer_end > layer_start, got [{self.layer_start}, "
                             f"{self.layer_end})")
        if self.upstream is not None and self.upstream.stage_index != self.stage_index - 1:
            raise ValueError(f"Expected upstream.stage_index {self.stage_index - 1}, got "
                             f"{self.upstream.stage_index}")
        if self.downstream is not None and self.downstream.stage_index != self.stage_index + 1:
            raise ValueError(f"Expected downstream.stage_index {self.stage_index + 1}, got "
                             f"{self.downstream.stage_index}")
        return self

    @property
    def bind_host(self) -> str:
        return parse_endpoint(self.bind_addr, allow_port_zero=True)[0]

    @property
    def bind_port(self) -> int:
        return parse_endpoint(self.bind_addr, allow_port_zero=True)[1]

    @property
    def max_deferred_replies(self) -> int:
        """Deferred downstream ACKs allowed before a credit wait (spec §2.6)."""
        return self.max_inflight - 1 if self.reply_credit_limit is None else self.reply_credit_limit


class TopologyStage(PeerEndpoint):
    """A stage of the chain; its standbys start from its config with their own bind address."""

    layer_start: int = Field(ge=0)
    layer_end: int = Field(ge=1)
    host: str | None = None


class Topology(_Frozen):
    """The whole chain (spec §9.2): stages 0..N-1 whose layer ranges tile [0, num_layers)."""

    topology_id: str
    model_id: str
    stages: list[TopologyStage] = Field(min_length=1)
    model_fingerprint: str | None = None  # of the file the chain was planned for: every stage's must match

    @model_validator(mode="after")
    def _chain(self) -> Topology:
        seen_ids: set[str] = set()
        expected_start = 0
        for position, stage in enumerate(self.stages):
            if stage.stage_index != position:
                raise ValueError(f"stages[{position}].stage_index: expected {position} "
                                 f"(indices 0..N-1 in order), got {stage.stage_index}")
            if stage.stage_id in seen_ids:
                raise ValueError(f"stages[{position}].stage_id: duplicate {stage.stage_id!r}")
            seen_ids.add(stage.stage_id)
            if stage.layer_end <= stage.layer_start:
                raise ValueError(f"stages[{position}]: expected layer_end > layer_start, got "
                                 f"[{stage.layer_start}, {stage.layer_end})")
            if stage.layer_start < expected_start:
                raise ValueError(f"stages[{position}].layer_start: {stage.layer_start} overlaps "
                                 f"the previous stage, which ends at {expected_start}")
            if stage.layer_start > expected_start:
                raise ValueError(f"stages[{position}].layer_start: expected {expected_start}, got "
                                 f"{stage.layer_start} (layers {expected_start}.."
                                 f"{stage.layer_start - 1} belong to no stage)")
            expected_start = stage.layer_end
        return self

    @property
    def num_layers(self) -> int:
        return self.stages[-1].layer_end

    @property
    def driver_endpoint(self) -> str:
        """Stage 0's endpoint: where the final stage dials the direct prediction return (§2.7)."""
        return self.stages[0].endpoint


def plan_layer_split(n_layers: int, n_stages: int, weights: Sequence[float] | None = None,
                     head_layers: float = 0.0) -> list[tuple[int, int]]:
    """Split [0, n_layers) into `n_stages` contiguous half-open ranges of >= 1 layer each.

    Without weights the split is even (earlier stages take the remainder); with weights each
    stage's share is proportional, by largest remainder, ties to the earlier stage.
    `head_layers`: the output head's work in layers, which the last stage does on top of its
    layers, so it takes that many fewer.
    """
    if n_stages < 1:
        raise ValueError(f"Expected n_stages >= 1, got {n_stages}")
    if n_layers < n_stages:
        raise ValueError(f"Expected n_layers >= n_stages ({n_stages}) so every stage gets a "
                         f"layer, got {n_layers}")
    weights = [1.0] * n_stages if weights is None else [float(w) for w in weights]
    if len(weights) != n_stages:
        raise ValueError(f"Expected {n_stages} weights, got {len(weights)}")
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"Expected finite positive weights, got {weights}")
    if not (math.isfinite(head_layers) and head_layers >= 0):
        raise ValueError(f"Expected a finite head_layers >= 0, got {head_layers}")
    total = sum(weights)
    ideal = [(n_layers + head_layers) * w / total for w in weights]
    ideal[-1] -= head_layers
    counts = [max(1, math.floor(share)) for share in ideal]
    # Largest remainder: hand out missing layers where the share was most rounded down,
    # and take surplus ones (from the max(1, .) floor) where it was least.
    by_remainder = sorted(range(n_stages), key=lambda i: (-(ideal[i] - counts[i]), i))
    while sum(counts) < n_layers:
        for i in by_remainder:
            if sum(counts) == n_layers:
                break
            counts[i] += 1
    while sum(counts) > n_layers:
        i = min((i for i in range(n_stages) if counts[i] > 1),
                key=lambda i: (ideal[i] - counts[i], -i))
        counts[i] -= 1
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges

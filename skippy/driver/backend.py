"""The seam between the HTTP layer and whatever runs the model.

The API only ever calls a `GenerationBackend` (`ChainBackend`: stage 0 of a chain). A
generation is an async iterator of events, PrefillDone -> Token* -> Finished; a consumer
that stops early closes it, and the backend then frees the session on every stage.
Failures raise `BackendError` subclasses, which the API maps to HTTP statuses (errors.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from ..protocol.logprobs import TokenLogprob
from ..protocol.sampling_config import GrammarSpec, SamplingConfig
from ..protocol.stage_metrics import StageMetricValues
from ..protocol.stage_probe import StageProbe
from ..protocol.stats import StageReplyStats
from ..runtime.speculation import SpeculativeSettings

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int  # already bounded by the context
    sampling: SamplingConfig
    stop_ids: frozenset[int]  # end-of-generation ids: never emitted, finish with "stop"
    prompt_cache_key: str | None = None  # the prefix-cache namespace; None = shared default
    speculative: SpeculativeSettings | None = None  # None: the server's default

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("Expected a non-empty prompt")
        if self.max_tokens < 0:  # 0: the prompt alone (its logprobs, with echo), no completion
            raise ValueError(f"Expected max_tokens >= 0, got {self.max_tokens}")


@dataclass(frozen=True, slots=True)
class PrefillDone:
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens restored from a prefix cache, not computed
    prefill_ms: float
    restore_decision: str = ""  # the prefix restore's outcome ("" when none was tried)
    hit_stage_mask: int = 0     # the stages whose prefix cache hit (bit i: stage i)
    # sampling.prompt_logprobs: every prompt token's logprob after the first (which has none)
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True, slots=True)
class Token:
    token_id: int
    logprob: TokenLogprob | None = None  # when the request asked for logprobs


@dataclass(frozen=True, slots=True)
class Finished:
    reason: FinishReason
    num_completion_tokens: int
    decode_ms: float  # first token to last
    extra: dict[str, float] = field(default_factory=dict)  # backend-specific counters for `timings`
    ended_by: str = ""  # why decoding ended: "stop", "length" or "context" (the context is full)
    stats: StageReplyStats = field(default_factory=StageReplyStats)  # merged over the chain's replies
    timings: Any = None  # the session's SessionTimings (driver/session.py)
    speculation: dict = field(default_factory=dict)  # the decoder's figures; {} without speculation


GenerationEvent = PrefillDone | Token | Finished


@dataclass(frozen=True, slots=True)
class StandbyStatus:
    endpoint: str
    state: str  # "ready" or "down"
    active_sessions: int


@dataclass(frozen=True, slots=True)
class StageStatus:
    stage_id: str
    layer_start: int
    layer_end: int
    endpoint: str
    state: str  # "ready", "down", "restarting" or "failed" (its restarts are spent)
    active_sessions: int
    restarts: int = 0       # times a supervisor started it again
    last_failure: str = ""  # why it last went down
    standbys: tuple[StandbyStatus, ...] = ()  # the same layers elsewhere (topology standby_endpoints)
    node_ip: str = ""       # the cluster node it runs on ("" when not on a cluster)
    moves: int = 0          # restarts that came back on another host
    metrics: StageMetricValues | None = None  # the stage's own counters and histograms (None: no answer)
    figures: dict[str, float] = field(default_factory=dict)  # rates and means for a live view (stage_figures)
    probe: StageProbe | None = None  # what it measured of its forward and its link (None: no answer)
    # its decode forward, predicted from its probe against measured (split_check.py); None: too few yet
    predicted_vs_measured: dict[str, float] | None = None

    @property
    def is_serving(self) -> bool:
        """It, or one of its standbys, answers: a request can pass this stage."""
        return self.state == "ready" or any(standby.state == "ready" for standby in self.standbys)


@dataclass(frozen=True, slots=True)
class Readiness:
    is_ready: bool
    failed_stage: str | None = None
    detail: str = ""


class BackendError(RuntimeError):
    """A generation the backend could not run."""


class StageUnavailable(BackendError):
    """A stage is down or unreachable (HTTP 503)."""

    def __init__(self, stage_id: str, detail: str):
        super().__init__(f"Stage {stage_id} is unavailable: {detail}")
        self.stage_id = stage_id


class BackendTimeout(BackendError):
    """The backend produced nothing for longer than the backend timeout (HTTP 504)."""


@runtime_checkable
class GenerationBackend(Protocol):
    """What the API needs from the model side; see the module docstring for the event order."""

    @property
    def num_lanes(self) -> int:
        """How many generations may run at once (the admission limit's ceiling)."""

    @property
    def ctx_size(self) -> int:
        """Context tokens per session: prompt + completion must fit."""

    @property
    def speculative(self) -> SpeculativeSettings:
        """The server's default speculative decoding (a request may ask for other settings)."""

    def check_speculative(self, settings: SpeculativeSettings) -> None:
        """ValueError, saying why and what to change, when `settings` cannot run here."""

    def check_grammar(self, grammar: GrammarSpec) -> None:
        """ValueError, saying why, when `grammar` cannot constrain a request here. It may take
        milliseconds (it compiles): call it off the event loop."""

    def cache_stats(self) -> list[tuple[str, dict[str, int]]]:
        """(stage id, prefix-cache counters) per stage, for /metrics."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]: ...

    async def status(self) -> list[StageStatus]: ...

    async def ready(self) -> Readiness: ...

    async def close(self) -> None: ...

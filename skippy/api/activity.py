"""What the chain page shows live: tokens per second now, and the last requests' figures.

A scrape interval blurs "what is it doing this second", so the API keeps, beside its
metrics, a few seconds of token counts and the last finished requests (numbers only).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass

RATE_WINDOW_S = 5.0  # tokens per second: over the last this many seconds
RECENT_REQUESTS = 20


@dataclass(frozen=True, slots=True)
class RequestFigures:
    finished_at: float  # unix time
    outcome: str  # stop, length, error, cancelled
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_ms: float | None  # None: no token came
    decode_tok_s: float | None  # first token to last; None: fewer than two tokens


class Activity:
    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._token_times: deque[float] = deque()
        self._recent: deque[RequestFigures] = deque(maxlen=RECENT_REQUESTS)

    def token(self) -> None:
        now = self._clock()
        self._token_times.append(now)
        self._forget_before(now - RATE_WINDOW_S)

    def finished(self, figures: RequestFigures) -> None:
        self._recent.appendleft(figures)

    def tokens_per_s(self) -> float:
        now = self._clock()
        self._forget_before(now - RATE_WINDOW_S)
        return len(self._token_times) / RATE_WINDOW_S

    def recent(self) -> list[dict]:
        return [asdict(figures) for figures in self._recent]

    def _forget_before(self, horizon: float) -> None:
        while self._token_times and self._token_times[0] < horizon:
            self._token_times.popleft()

"""What one session asks of the model in one forward, and what it gets back. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from ..protocol.constants import ActivationDtype
from ..protocol.logprobs import TokenLogprob
from .session import Session


class SampleMode(Enum):
    NONE = "none"   # no sampling (not the final stage, or a prefill chunk that needs none)
    LAST = "last"   # sample the last row: PrefillFinalEmbd, DecodeEmbd
    ALL = "all"     # sample every row: VerifyWindow


@dataclass(slots=True)
class Step:
    """Rows [start, start + num_rows) of one session.

    `tokens` are the rows' token ids (the input on the first stage, the ledger
    everywhere). `rows` is the input activation on later stages: a (num_rows, width)
    array in `rows_dtype` (bf16 as raw uint16 bits). `start` is authoritative: a
    session holding more positions is cut back first (auto-align, spec §3.4).
    """

    session: Session
    start: int
    num_rows: int
    tokens: list[int] = field(default_factory=list)
    rows: np.ndarray | None = None
    rows_dtype: ActivationDtype = ActivationDtype.f32
    sample: SampleMode = SampleMode.NONE
    out_dtype: ActivationDtype | None = None   # None: no activation leaves this stage
    window_id: int | None = None               # a VerifyWindow: keep a checkpoint at `start`


@dataclass(frozen=True, slots=True)
class StepResult:
    rows: np.ndarray | None = None      # output activation in `out_dtype`
    tokens: list[int] | None = None     # sampled token(s): one for LAST, one per row for ALL
    auto_aligned_from: int | None = None  # the session length before an auto-align trim
    logprobs: list[TokenLogprob] | None = None  # one per sampled token, when the request asked
    # the prompt's tokens after the first (a request with prompt logprobs, on its last prompt chunk)
    prompt_logprobs: list[TokenLogprob] | None = None

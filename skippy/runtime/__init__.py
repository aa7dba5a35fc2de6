"""Runtime: sessions, the batch policy, the runner, and the stage runtime that holds them.

Only `runner` imports torch; `session`, `step` and `batch_policy` are bookkeeping, and
importing this package does not load torch (`stage_runtime` does).
"""

from .batch_policy import BatchPolicy, BatchSettings
from .session import LaneLimitError, Session, SessionError, SessionKey, SessionTable
from .step import SampleMode, Step, StepResult

__all__ = [
    "BatchPolicy", "BatchSettings", "LaneLimitError", "SampleMode", "Session", "SessionError", "SessionKey",
    "SessionTable", "Step", "StepResult",
]

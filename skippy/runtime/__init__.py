"""Runtime: sessions, the batch policy, the runner, and the stage runtime that holds them.

Only `runner` imports torch; `session`, `step` and `batch_policy` are bookkeeping, and
importing this package does not load torch until `StageRuntime` is asked for.
"""

from .batch_policy import BatchPolicy, BatchSettings
from .session import LaneLimitError, Session, SessionError, SessionKey, SessionTable
from .step import SampleMode, Step, StepResult

__all__ = [
    "BatchPolicy", "BatchSettings", "LaneLimitError", "SampleMode", "Session", "SessionError", "SessionKey",
    "SessionTable", "StageRuntime", "Step", "StepResult", "Timed",
]


def __getattr__(name: str):
    if name in ("StageRuntime", "Timed"):  # lazy: it pulls in torch through the runner
        from . import stage_runtime

        return getattr(stage_runtime, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

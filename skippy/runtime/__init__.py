"""Runtime: sessions, the iteration scheduler (one worker owns the model), the runner.

Only `runner` imports torch; `session`, `step` and `scheduler` are bookkeeping, and
importing this package does not load torch until `StageRuntime` is asked for.
"""

from .scheduler import IterationScheduler, SchedulerBusyError, Timed
from .session import LaneLimitError, Session, SessionError, SessionKey, SessionTable
from .step import SampleMode, Step, StepResult

__all__ = [
    "IterationScheduler", "LaneLimitError", "SampleMode", "SchedulerBusyError", "Session",
    "SessionError", "SessionKey", "SessionTable", "StageRuntime", "Step", "StepResult", "Timed",
]


def __getattr__(name: str):
    if name == "StageRuntime":  # lazy: it pulls in torch through the runner
        from .engine import StageRuntime

        return StageRuntime
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

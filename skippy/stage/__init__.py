"""A stage process: TCP server, message handlers, downstream link, prediction return."""

from .downstream import DownstreamLink, LinkBroken
from .handlers import HANDLERS, StageError
from .prediction_return import PredictionHub, ReturnListener, ReturnStreams
from .server import StageServer

__all__ = [
    "DownstreamLink", "HANDLERS", "LinkBroken", "PredictionHub", "ReturnListener",
    "ReturnStreams", "StageError", "StageServer",
]

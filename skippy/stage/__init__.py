"""A stage process: its engine (model + data sockets), lanes, control handlers, server, transport."""

from .engine import Engine, EngineClosed
from .lane import StageError
from .server import StageServer
from .transport import LinkBroken, Transport

__all__ = ["Engine", "EngineClosed", "LinkBroken", "StageError", "StageServer", "Transport"]

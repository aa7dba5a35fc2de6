"""Every failure, as the OpenAI error envelope: the one exception-to-envelope mapper.

`to_api_error` is used by the API's exception handlers and by streams that fail
after their first byte (they end with an error event, then [DONE]), so a given
failure reads the same either way.
"""

from __future__ import annotations

import json
import logging

from pydantic import ValidationError
from starlette.exceptions import HTTPException

from ..driver.backend import BackendError, BackendTimeout, StageUnavailable
from ..model.chat_template import ChatTemplateError
from ..model.errors import ContextOverflowError
from .admission import AdmissionError, ContextTooLong
from .schemas import ErrorDetail, ErrorEnvelope

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "unavailable_error",
    504: "timeout_error",
}


UNION_BRANCHES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})  # pydantic loc noise


class ApiError(Exception):
    """An HTTP error with everything the envelope needs."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def envelope(self) -> dict:
        detail = ErrorDetail(
            message=self.message, type=ERROR_TYPES.get(self.status, "server_error"), param=self.param, code=self.code
        )
        return ErrorEnvelope(error=detail).model_dump()


def to_api_error(exc: BaseException) -> ApiError:
    """Map any exception to the status and envelope a client should see."""
    match exc:
        case ApiError():
            return exc
        case ValidationError():
            return _validation_error(exc)
        case json.JSONDecodeError():
            return ApiError(400, f"Expected a JSON body, got invalid JSON: {exc}", code="invalid_json")
        case HTTPException():
            message = {404: "No such route", 405: "Method not allowed on this route"}.get(exc.status_code, exc.detail)
            return ApiError(exc.status_code, message, code=str(exc.status_code), headers=dict(exc.headers or {}))
        case ChatTemplateError():
            return ApiError(400, str(exc), param="messages", code="invalid_messages")
        case ContextTooLong() | ContextOverflowError():
            return ApiError(400, str(exc), param="max_tokens", code="context_length_exceeded")
        case AdmissionError():
            code = type(exc).__name__.lower()
            return ApiError(429, str(exc), code=code, headers={"Retry-After": str(exc.retry_after_s)})
        case StageUnavailable():
            return ApiError(503, str(exc), code="stage_unavailable")
        case BackendTimeout():
            return ApiError(504, str(exc), code="backend_timeout")
        case BackendError():
            return ApiError(503, str(exc), code="backend_error")
    log.error("unhandled error", exc_info=exc)
    return ApiError(500, f"Internal server error ({type(exc).__name__}); see the server log.", code="internal_error")


def _validation_error(exc: ValidationError) -> ApiError:
    first = exc.errors(include_url=False)[0]
    # ("messages", 0, "role") -> "messages[0].role"; the union branch names pydantic adds are dropped.
    param = ""
    for part in first["loc"]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif not any(c in part for c in "[]()-,") and part not in UNION_BRANCHES:
            param += f".{part}" if param else part
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        message = f"Missing required field {param!r}"
    elif param:
        message = f"Invalid {param}: {message}"
    return ApiError(400, message, param=param or None, code=first["type"])

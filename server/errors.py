"""Error objects in each API's shape, and the one place that turns exceptions into error responses.

    OpenAI (chat, completions, responses): {"error": {"message", "type", "param", "code"}}
    Anthropic (/v1/messages):              {"type": "error", "error": {"type", "message"}}
"""

from __future__ import annotations

import logging
import math
import uuid
from contextlib import contextmanager
from typing import Any, Dict, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from mtp_serve.engine.engine_loop import ConstraintFailed, EngineError, EngineStopped, QueueFull

log = logging.getLogger("mtp_serve.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
ANTHROPIC_PATHS = ("/v1/messages",)


class ClientGone(Exception):
    """The client disconnected before a non-streamed response was ready (answered 499)."""


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: Optional[str] = None,
        code: Optional[str] = None,
        type: Optional[str] = None,
        headers: Optional[Dict[str, str]] = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")
        self.headers = headers


def error_body(message: str, type: str, param: Optional[str] = None, code: Optional[str] = None, **extra) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code, **extra}}


def failure_status(e: BaseException) -> int:
    """An engine failure's status: 503 when the engine stopped under the request (the
    server is shutting down, or a rank of a server across machines was lost), else 500."""
    return 503 if isinstance(e, EngineStopped) else 500


def failure_body(e: BaseException) -> dict:
    """An engine failure mid-stream, as an OpenAI error object."""
    status = failure_status(e)
    return error_body(str(e), _TYPES.get(status, "server_error"), code="engine_stopped" if status == 503 else None)


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


def error_response_body(path: str, exc: APIError) -> dict:
    """`exc` in the shape of the API that `path` belongs to."""
    if path.startswith(ANTHROPIC_PATHS):
        return anthropic_error_body(exc.status, exc.message)
    return error_body(exc.message, exc.type, exc.param, exc.code)


def json_safe(value: Any) -> Any:
    """Validation details as JSON: non-finite floats and other objects as strings."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _loc(loc) -> Optional[str]:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def install_error_handlers(app: FastAPI, on_error=None) -> None:
    """`on_error(request, status)` is called for every error response (metrics)."""

    def respond(request: Request, status: int, message: str, type: str, param=None, code=None, headers=None, **extra) -> JSONResponse:
        if on_error is not None:
            on_error(request, status)
        if request.url.path.startswith(ANTHROPIC_PATHS):
            body = anthropic_error_body(status, message)
        else:
            body = error_body(message, type, param, code, **extra)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return respond(request, exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            first = next(e for e in errors if e.get("type") == "json_invalid")
            msg = f"invalid JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
            param = None
        else:
            first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
            param = _loc(first.get("loc", ()))
            msg = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
            msg = msg if first.get("type") != "recursion_loop" else "the request is nested too deeply"
            if len(errors) > 1:
                msg += f" (and {len(errors) - 1} more error(s))"
        # 422-style details without the offending input (it can be the whole request, or NaN)
        detail = [json_safe({k: v for k, v in e.items() if k not in ("input", "url")}) for e in errors[:DETAILS]]
        return respond(request, 400, msg, "invalid_request_error", param, "invalid_value", detail=detail)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return respond(request, exc.status_code, str(exc.detail), _TYPES.get(exc.status_code, "server_error"),
                       headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone):
        if on_error is not None:
            on_error(request, 499)
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(EngineStopped)
    async def _stopped(request: Request, exc: EngineStopped):
        return respond(request, 503, str(exc), "service_unavailable", headers={"Retry-After": "5"})

    @app.exception_handler(ConstraintFailed)
    async def _constraint(request: Request, exc: ConstraintFailed):
        return respond(request, 400, str(exc), "invalid_request_error", code="invalid_constraint")

    @app.exception_handler(EngineError)
    async def _engine(request: Request, exc: EngineError):
        return respond(request, 500, internal_error(exc, request.url.path), "server_error")

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return respond(request, 500, internal_error(exc, request.url.path), "server_error")


DETAILS = 20  # validation errors listed in `detail`


def internal_error(exc: BaseException, where: str) -> str:
    """A server-side failure: logged with its traceback under an id; the client gets the id only."""
    ref = uuid.uuid4().hex[:12]
    log.error("internal error %s on %s: %s: %s", ref, where, type(exc).__name__, exc, exc_info=exc)
    return f"The server failed to process the request (internal error {ref}; see the server log)"


@contextmanager
def engine_refusals():
    """The engine's refusals as HTTP errors: a full queue is a 429, a stopped engine a 503."""
    try:
        yield
    except QueueFull as e:
        raise APIError(429, f"{e}; retry shortly", code="queue_full", headers={"Retry-After": "1"}) from e
    except EngineStopped as e:
        raise APIError(503, str(e), code="engine_stopped", headers={"Retry-After": "5"}) from e

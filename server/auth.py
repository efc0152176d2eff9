"""The API key: checked on every route but /health (and /metrics with --metrics-without-key),
before the request body is read.

    app.add_middleware(APIKeyMiddleware, key="sekrit", open_paths={"/health"}, on_reject=count)

Clients send `Authorization: Bearer KEY` (OpenAI SDKs) or `x-api-key: KEY`
(Anthropic SDKs). The comparison is constant-time (both sides hashed first, so
not even the key's length leaks); a 401 carries `WWW-Authenticate` and the
API's own error shape.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Callable, Collection, Optional

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from mtp_serve.server.errors import APIError, error_response_body


def _digest(s: str) -> bytes:
    return hashlib.sha256(s.encode("utf-8", "surrogatepass")).digest()


def presented_key(headers: Headers) -> str:
    header = headers.get("authorization", "")
    if header[:7].lower() == "bearer ":
        return header[7:].strip()
    return headers.get("x-api-key", "")


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, key: str, open_paths: Collection[str] = ("/health",),
                 on_reject: Optional[Callable[[Scope, int], None]] = None):
        self.app = app
        self.key = _digest(key)
        self.open_paths = frozenset(open_paths)
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        token = presented_key(Headers(scope=scope))
        if hmac.compare_digest(_digest(token), self.key):
            return await self.app(scope, receive, send)
        hint = "" if token else ": send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
        err = APIError(401, "Invalid or missing API key" + hint, code="invalid_api_key", type="invalid_request_error",
                       headers={"WWW-Authenticate": 'Bearer realm="mtp-serve"'})
        if self.on_reject is not None:
            self.on_reject(scope, 401)
        await JSONResponse(error_response_body(scope["path"], err), status_code=401, headers=err.headers)(scope, receive, send)

"""Request limits, checked on the parsed JSON before validation and before any expensive work.

    app.add_middleware(BodyLimitMiddleware, max_bytes=limits.max_request_bytes)  # 413, never reading past it
    router = APIRouter(dependencies=[Depends(check_request)])                    # the rest, per request

One walk over the body (iterative: no recursion however deep the input)
rejects what JSON or the model cannot take: nesting deeper than
`max_json_depth` (chat templates recurse into tool schemas and template
arguments), NaN / Infinity (not JSON; Python's parser lets them through), lone
UTF-16 surrogates (not text; the tokenizer cannot encode them); and counts the
request's messages, tools and stop strings. The text it finds (tool definitions
included) and the images it counts bound the prompt from below, so a prompt that
cannot fit the routed model's context is refused before it is rendered and
tokenized (`check_prompt_bytes`, called by `models_registry.service_for` once the
model is known); the walk stops as soon as the prompt cannot fit the default
model's context (what it measured is still a lower bound). What it finds also
puts the request on a preparation lane (lanes.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from fastapi import Request
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mtp_serve.server.errors import APIError, bad_request, error_response_body
from mtp_serve.server.images import IMAGE_PARTS
from mtp_serve.server.lanes import set_heavy

MESSAGE_KEYS = ("messages", "input")  # chat and Anthropic messages; Responses input items
STOP_KEYS = ("stop", "stop_sequences")
PROMPT_KEYS = ("messages", "input", "prompt", "system", "instructions", "tools", "functions")  # text the prompt holds
# What makes preparing a prompt expensive whatever its size: an output constraint to compile
CONSTRAINT_KEYS = ("response_format", "text", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                   "guided_grammar")
LIGHT_BYTES = 64 << 10  # bodies up to this size, without images or constraints, prepare on the light lane
COUNT_ONLY = ("/v1/messages/count_tokens",)


@dataclass(frozen=True)
class Limits:
    max_request_bytes: int = 8 << 20
    max_messages: int = 4096
    max_tools: int = 1024
    max_json_depth: int = 64
    max_stop: int = 16
    max_stop_chars: int = 1024


@dataclass
class Scan:
    """What the walk found: the UTF-8 size of the prompt's text (tool definitions included, keys
    and all), its image parts, and whether preparing it is heavy work (service.py's lanes)."""

    prompt_bytes: int = 0
    images: int = 0
    heavy: bool = False


Path = Optional[Tuple["Path", Any]]  # (parent, key): built per node, rendered only for an error


def _param(path: Path, top_only: bool = False) -> str:
    keys = []
    while path is not None:
        path, key = path
        keys.append(str(key))
    return keys[-1] if top_only and keys else ".".join(reversed(keys))


def scan_body(body: Any, limits: Limits, enough_bytes: Optional[int] = None) -> Scan:
    """Raises a 400 (APIError) naming the first offending field. The walk stops early once the
    prompt's text passes `enough_bytes` (a prompt that cannot fit: refused whatever the rest holds)."""
    scan = Scan()
    stack = [(body, 1, None, False)]  # (value, depth, path, in the prompt)
    while stack:
        if enough_bytes is not None and scan.prompt_bytes >= enough_bytes:
            return scan
        value, depth, path, prompt = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > limits.max_json_depth:
                where = _param(path, top_only=True) or "body"
                raise bad_request(f"{where}: JSON nested deeper than {limits.max_json_depth} levels (--max-json-depth)", where)
            items = value.items() if isinstance(value, dict) else enumerate(value)
            if prompt and isinstance(value, dict) and value.get("type") in IMAGE_PARTS:
                prompt = False  # an image's data is not prompt text (its tokens are counted apart)
                scan.images += 1
            for key, item in items:
                if isinstance(key, str):
                    _check_text(key, path)
                    if prompt:
                        scan.prompt_bytes += len(key)
                stack.append((item, depth + 1, (path, key), prompt or (depth == 1 and key in PROMPT_KEYS)))
        elif isinstance(value, str):
            if not value.isascii():
                _check_text(value, path)
            if prompt:
                scan.prompt_bytes += len(value) if value.isascii() else len(value.encode("utf-8"))
        elif isinstance(value, float) and not math.isfinite(value):
            raise bad_request(f"{_param(path)}: {value} is not a number JSON allows", _param(path))
    if isinstance(body, dict):
        _check_counts(body, limits)
        scan.heavy = bool(scan.images) or any(body.get(k) is not None for k in CONSTRAINT_KEYS) or \
            body.get("tool_choice") not in (None, "auto", "none", {"type": "auto"}, {"type": "none"})
    return scan


def _check_text(s: str, path: Path) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"{_param(path) or 'body'}: a lone UTF-16 surrogate ({s[e.start]!a}) is not text",
                          _param(path) or None) from None


def _check_counts(body: dict, limits: Limits) -> None:
    for key in MESSAGE_KEYS:
        if isinstance(body.get(key), list) and len(body[key]) > limits.max_messages:
            raise bad_request(f"{key}: at most {limits.max_messages} items per request (--max-messages)", key)
    if isinstance(body.get("tools"), list) and len(body["tools"]) > limits.max_tools:
        raise bad_request(f"tools: at most {limits.max_tools} tools per request (--max-tools)", "tools")
    for key in STOP_KEYS:
        stops = body.get(key)
        stops = [stops] if isinstance(stops, str) else stops
        if not isinstance(stops, list):
            continue
        if len(stops) > limits.max_stop:
            raise bad_request(f"{key}: at most {limits.max_stop} stop sequences", key)
        if any(isinstance(s, str) and len(s) > limits.max_stop_chars for s in stops):
            raise bad_request(f"{key}: a stop sequence has at most {limits.max_stop_chars} characters", key)


async def check_request(request: Request) -> None:
    """Router dependency: runs after FastAPI parsed the JSON, before it validates it.
    The walk runs on the tokenizer threads (a large body would hold the event loop).
    It also stamps the request's arrival (`request.state.started`: time to first token), and
    picks the lane its preparation runs on (a large body, images or a constraint: the heavy one)."""
    request.state.started = time.perf_counter()
    if request.method != "POST":
        return
    try:
        raw = await request.body()
        body = await request.json()
    except Exception:  # noqa: BLE001 - not JSON: FastAPI's own validation answers it
        return
    svc = request.app.state.service  # the limits are the server's; the context is the routed model's
    set_heavy(len(raw) > LIGHT_BYTES)
    count_only = request.url.path in COUNT_ONLY  # counting a prompt too long for the context still answers its count
    scan = await svc.run_cpu(scan_body, body, svc.config.limits, None if count_only else svc.too_many_prompt_bytes)
    set_heavy(len(raw) > LIGHT_BYTES or scan.heavy)
    if not count_only:
        request.state.prompt_size = (scan.prompt_bytes, scan.images)  # checked by `service_for` against the routed model


def check_prompt_bytes(request: Request, svc) -> None:
    """The routed model's check of the prompt's size (`Service.check_prompt_bytes`), before any
    rendering or tokenizing; a no-op for requests `check_request` did not measure."""
    size = getattr(request.state, "prompt_size", None)
    if size is not None:
        svc.check_prompt_bytes(*size)


class BodyLimitMiddleware:
    """413 in the API's shape for a body over `max_bytes`: at once when Content-Length says
    so (nothing is read), else as soon as the bytes received pass it."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_reject: Optional[Callable[[Scope, int], None]] = None):
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject

    def message(self) -> str:
        return f"The request body is larger than {self.max_bytes} bytes (--max-request-bytes)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            err = APIError(413, self.message(), code="request_too_large")
            if self.on_reject is not None:
                self.on_reject(scope, 413)
            return await JSONResponse(error_response_body(scope["path"], err), status_code=413)(scope, receive, send)
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise HTTPException(413, self.message())  # FastAPI passes HTTPExceptions to errors.py
            return message

        await self.app(scope, limited, send)

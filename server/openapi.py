"""The OpenAPI schema as the server behaves: errors are 400 (never 422) in each API's own
shape, streams are `text/event-stream`, and 200 bodies have their shape.

    install_openapi(app)   # once the routes are in; replaces app.openapi
"""

from __future__ import annotations

from typing import Any, Dict

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from mtp_serve.server.errors import ANTHROPIC_PATHS

NULLABLE_STR = {"type": ["string", "null"]}
OPENAI_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"],
                             "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                            "param": NULLABLE_STR, "code": NULLABLE_STR}}},
}
ANTHROPIC_ERROR = {
    "type": "object", "required": ["type", "error"],
    "properties": {"type": {"const": "error"},
                   "error": {"type": "object", "required": ["type", "message"],
                             "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}},
}
ERRORS = {
    "400": "Invalid request: malformed JSON, a value of the wrong type or out of range, a limit exceeded, "
           "a prompt (plus max_tokens) longer than the context",
    "401": "Missing or wrong API key (with --api-key)",
    "404": "Unknown model or stored response",
    "413": "Request body larger than --max-request-bytes",
    "429": "Queue full (--max-queue); retry after the Retry-After header",
    "500": "Server failure (the body names an id to find in the server log)",
    "503": "Engine not running",
}


def _obj(required: Dict[str, Any], **more) -> dict:
    return {"type": "object", "required": list(required), "properties": {**required, **more}}


INT, STR, ARRAY, OBJ = {"type": "integer"}, {"type": "string"}, {"type": "array"}, {"type": "object"}
BODIES = {  # (path, method) -> the 200 JSON body
    ("/v1/chat/completions", "post"): _obj({
        "id": STR, "object": {"const": "chat.completion"}, "created": INT, "model": STR, "usage": OBJ,
        "choices": {"type": "array", "items": _obj({"index": INT, "finish_reason": STR,
                                                     "message": _obj({"role": {"const": "assistant"}})})}}),
    ("/v1/completions", "post"): _obj({
        "id": STR, "object": {"const": "text_completion"}, "created": INT, "model": STR, "usage": OBJ,
        "choices": {"type": "array", "items": _obj({"index": INT, "text": STR, "finish_reason": STR})}}),
    ("/v1/messages", "post"): _obj({
        "id": STR, "type": {"const": "message"}, "role": {"const": "assistant"}, "model": STR, "content": ARRAY,
        "stop_reason": STR, "usage": _obj({"input_tokens": INT, "output_tokens": INT})}),
    ("/v1/messages/count_tokens", "post"): _obj({"input_tokens": INT}),
    ("/v1/responses", "post"): _obj({"id": STR, "object": {"const": "response"}, "status": STR, "output": ARRAY}),
    ("/v1/models", "get"): _obj({"object": {"const": "list"}, "data": ARRAY}),
    ("/v1/models/{model_id}", "get"): _obj({"id": STR, "object": {"const": "model"}}),
    ("/health", "get"): _obj({"status": STR}),
}
STREAMING = {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"}


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path, ops in schema.get("paths", {}).items():
                for method, op in ops.items():
                    document(path, method, op)
            components = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


# Before OpenAPI 3.2 a text/event-stream `schema` describes one event (its fields as sent).
SSE_EVENT = {"type": "object", "properties": {"event": {"type": "string"}, "data": {"type": "string"},
                                              "id": {"type": "string"}, "retry": {"type": "integer"}}}


def document(path: str, method: str, op: dict) -> None:
    responses = op.setdefault("responses", {})
    responses.pop("422", None)
    ok = responses.setdefault("200", {"description": "Successful Response"})
    if (path, method) in BODIES:
        ok["content"] = {"application/json": {"schema": BODIES[(path, method)]}}
    if path in STREAMING:
        ok["description"] = "The response; with `stream: true`, server-sent events"
        ok["content"]["text/event-stream"] = {"schema": SSE_EVENT}
    if path == "/metrics":
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
    error = ANTHROPIC_ERROR if path.startswith(ANTHROPIC_PATHS) else OPENAI_ERROR
    statuses = ERRORS if path.startswith("/v1/") else {"/metrics": ("401",), "/health": ("503",)}.get(path, ())
    for status in statuses:
        responses[status] = {"description": ERRORS[status], "content": {"application/json": {"schema": error}}}

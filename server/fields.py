"""The reference APIs' request fields that mtp-serve does not implement, and what it does
with each: never ignore silently a field that would change the output.

- refused: set to anything but its neutral value, the request is a 400 naming the field;
- inert: the field cannot change the generated output (billing, storage, caching and
  latency hints, end-user ids): accepted, with no effect;
- not applied: accepted without effect because agents send it on every turn and a 400
  would stop them; docs/api.md lists each one.

Each API's request model takes its table's mixin (`Unsupported*`); its route calls
`refuse_unsupported(req)` before anything else. tests/test_request_fields.py holds every
field of every API (the official clients' and mtp-serve's own) to one of: changes the
output, refused, inert, not applied.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

from pydantic import BaseModel

from mtp_serve.server.errors import bad_request

# field -> (why it is refused, the values that are accepted as neutral)
Refusals = Dict[str, Tuple[str, Callable[[Any], bool]]]


def _never(_v: Any) -> bool:
    return False


def _falsy(v: Any) -> bool:
    return not v


CHAT_REFUSED: Refusals = {
    "audio": ("audio output is not supported", _never),
    "modalities": ("only text output is supported (modalities: [\"text\"])", lambda v: list(v) == ["text"]),
    "functions": ("the deprecated functions are not supported; send tools", _falsy),
    "function_call": ("the deprecated function_call is not supported; send tool_choice", _never),
    "web_search_options": ("web search is not supported", _never),
    "moderation": ("moderation is not supported", _never),
    "verbosity": ("this server has no verbosity control (only \"medium\", the default)", lambda v: v == "medium"),
}
COMPLETIONS_REFUSED: Refusals = {
    "best_of": ("best_of is not supported; use n", lambda v: v == 1),
}
RESPONSES_REFUSED: Refusals = {
    "conversation": ("conversations are not supported; use previous_response_id", _never),
    "prompt": ("prompt templates are not supported; send input and instructions", _never),
    "max_tool_calls": ("max_tool_calls is not supported", _never),
    "moderation": ("moderation is not supported", _never),
    "truncation": ("only truncation \"disabled\" is supported: a prompt past the context is a 400", lambda v: v == "disabled"),
    "context_management": ("context management is not supported", _never),
}
MESSAGES_REFUSED: Refusals = {
    "container": ("code execution containers are not supported", _never),
    "mcp_servers": ("MCP servers are not supported", _falsy),
    "output_config": ("of output_config, only effort is accepted (structured output through format is not supported)",
                      lambda v: isinstance(v, dict) and set(v) <= {"effort"}),
}

# Accepted without effect on the output (see the module doc); the test checks the lists.
INERT = {
    "chat": {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_options",
             "prompt_cache_retention", "prediction"},
    "completions": {"user"},
    "responses": {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                  "prompt_cache_options", "prompt_cache_retention", "stream_options", "background_options", "access_programs",
                  "image"},
    "messages": {"metadata", "service_tier", "cache_control", "inference_geo", "speed", "diagnostics", "user_profile_id",
                 "workspace_id"},
}
NOT_APPLIED = {
    "messages": {"context_management": "Claude Code sends it with its context-editing beta; the conversation is sent whole "
                                      "and kept whole",
                 "output_config.effort": "Claude Code sends it; thinking is switched by `thinking`"},
}


class UnsupportedChat(BaseModel):
    audio: Optional[Any] = None
    modalities: Optional[Any] = None
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    web_search_options: Optional[Any] = None
    moderation: Optional[Any] = None
    verbosity: Optional[Any] = None


class UnsupportedCompletions(BaseModel):
    best_of: Optional[Any] = None


class UnsupportedResponses(BaseModel):
    conversation: Optional[Any] = None
    prompt: Optional[Any] = None
    max_tool_calls: Optional[Any] = None
    moderation: Optional[Any] = None
    truncation: Optional[Any] = None
    context_management: Optional[Any] = None


class UnsupportedMessages(BaseModel):
    container: Optional[Any] = None
    mcp_servers: Optional[Any] = None
    output_config: Optional[Any] = None
    context_management: Optional[Any] = None  # not applied (NOT_APPLIED)


TABLES = {UnsupportedChat: CHAT_REFUSED, UnsupportedCompletions: COMPLETIONS_REFUSED,
          UnsupportedResponses: RESPONSES_REFUSED, UnsupportedMessages: MESSAGES_REFUSED}


def refuse_unsupported(req: BaseModel) -> None:
    """A 400 naming the first unsupported field the request sets to a value that matters."""
    for mixin, table in TABLES.items():
        if not isinstance(req, mixin):
            continue
        for name, (why, neutral) in table.items():
            value = getattr(req, name)
            if value is None:
                continue
            try:
                ok = neutral(value)
            except TypeError:
                ok = False
            if not ok:
                raise bad_request(f"{name}: {why}", name, "unsupported_parameter")

"""OpenAI wire bodies for chat completions and completions: responses, stream chunks,
usage, logprobs. Plain dicts; the routes in `openai_api.py` fill them in."""

from __future__ import annotations

import json
from typing import Callable, Optional

from mtp_serve.server.parsers import ContentDelta, Event, ParsedOutput, ReasoningDelta, ToolCallStart
from mtp_serve.server.run import Usage

def usage(u: Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.output_tokens,
        "total_tokens": u.prompt_tokens + u.output_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "speculative": u.speculative,
        **u.note,
    }


def sse(body: dict) -> dict:
    return {"data": json.dumps(body, ensure_ascii=False)}


# ---------------------------------------------------------------- chat


def chat_message(parsed: ParsedOutput) -> dict:
    message = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = parsed.tool_calls
    return message


def chat_body(rid: str, created: int, model: str, message: dict, logprobs: Optional[dict], finish: str, usage_: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}],
            "usage": usage_}


def chat_chunk(rid: str, created: int, model: str, delta: Optional[dict], *, finish=None, logprobs=None,
               include_usage: bool = False, usage_: Optional[dict] = None, **extra) -> dict:
    """One `chat.completion.chunk`; delta None: the usage-only last chunk; `extra`: top-level
    fields of the last chunk (structured_output)."""
    body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [] if delta is None else [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
    if include_usage:
        body["usage"] = usage_
    return sse({**body, **extra})


def event_delta(ev: Event) -> dict:
    """A parser event as a chat chunk's delta."""
    if isinstance(ev, ReasoningDelta):
        return {"reasoning_content": ev.text}
    if isinstance(ev, ContentDelta):
        return {"content": ev.text}
    if isinstance(ev, ToolCallStart):
        return {"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function", "function": {"name": ev.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]}


def chat_logprobs(lps, token_text: Callable[[int], str]) -> dict:
    def entry(t, lp):
        s = token_text(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(x.token, x.logprob), "top_logprobs": [entry(t, lp) for t, lp in x.top]} for x in lps]}


# ---------------------------------------------------------------- completions


def completion_body(rid: str, created: int, model: str, text: str, finish: str, logprobs: Optional[dict], usage_: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}],
            "usage": usage_}


def completion_chunk(rid: str, created: int, model: str, text: Optional[str], *, finish=None, logprobs=None,
                     include_usage: bool = False, usage_: Optional[dict] = None, **extra) -> dict:
    body = {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [] if text is None else [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
    if include_usage:
        body["usage"] = usage_
    return sse({**body, **extra})


def prompt_logprobs(ids, lps, token_text: Callable[[int], str]) -> dict:
    """The prompt's tokens as `completion_logprobs` reports them (echo): the first has none."""
    tokens, offsets, offset = [], [], 0
    for t in ids:
        s = token_text(t)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [None if x is None else x.logprob for x in lps],
        "top_logprobs": [None if x is None else {token_text(t): lp for t, lp in x.top} for x in lps],
        "text_offset": offsets,
    }


def joined_logprobs(first: Optional[dict], then: Optional[dict]) -> Optional[dict]:
    """Two completion logprobs objects, one after the other (the prompt's, then the output's)."""
    if first is None or then is None:
        return first or then
    return {k: first[k] + then[k] for k in first}


def completion_logprobs(lps, offset: int, token_text: Callable[[int], str]) -> dict:
    tokens, offsets = [], []
    for x in lps:
        s = token_text(x.token)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [x.logprob for x in lps],
        "top_logprobs": [{token_text(t): lp for t, lp in x.top} for x in lps],
        "text_offset": offsets,
    }

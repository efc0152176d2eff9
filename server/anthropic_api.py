"""Anthropic Messages (`POST /v1/messages`, `/v1/messages/count_tokens`): an adapter over
the internal request model, for Claude Code and the `anthropic` SDKs.

In: system, messages (text, tool_use, tool_result and thinking blocks), tools,
tool_choice, stop_sequences, sampling, thinking. Out: content blocks (thinking,
text, tool_use), stop_reason, usage (`input_tokens` excludes the prompt tokens
read from the prompt cache, reported as `cache_read_input_tokens`, as Anthropic
counts them) plus the MTP figures as `usage.speculative`. Streams follow
Anthropic's event sequence with SSE `event:` names. Errors have Anthropic's
shape (see errors.py).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Dict, List, Literal, Optional, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import ServerSentEvent

from mtp_serve.server import structured
from mtp_serve.server.chat import ChatPrompt
from mtp_serve.server.errors import anthropic_error_body, bad_request, failure_status
from mtp_serve.server.schemas import STRICT, RepetitionPenalty, Seed
from mtp_serve.server.generation import complete, finish_reason, parse_output, stream_steps
from mtp_serve.server.openai_format import speculative
from mtp_serve.server.parsers import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallStart, collect
from mtp_serve.server.service import Sampling, Service
from mtp_serve.server.streaming import sse_response

router = APIRouter()

# ---------------------------------------------------------------- request


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", **STRICT)


class AnthropicMessage(_Model):
    role: Literal["user", "assistant", "system"]  # Claude Code sends system messages among the turns
    content: Union[str, List[Dict[str, Any]]]


class AnthropicTool(_Model):
    model_config = ConfigDict(extra="allow", **STRICT)
    type: Optional[str] = None
    name: str = Field(min_length=1, max_length=256)
    description: Optional[str] = None
    input_schema: Optional[Dict[str, Any]] = None


class Thinking(_Model):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = Field(default=None, ge=1)


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: bool = False


class CountTokensRequest(_Model):
    model: Optional[str] = None
    messages: List[AnthropicMessage] = Field(min_length=1)
    system: Optional[Union[str, List[Dict[str, Any]]]] = None
    tools: Optional[List[AnthropicTool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None
    json_schema_mode: Optional[Literal["strict", "relaxed"]] = None  # mtp-serve extra: how tool schemas are served


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[List[str]] = Field(default=None, max_length=16)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=-1)
    stream: bool = False
    metadata: Optional[Dict[str, Any]] = None
    # mtp-serve extras (extra_body), as on /v1/chat/completions
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: Optional[RepetitionPenalty] = None
    seed: Optional[Seed] = None
    mtp_depth: Optional[int] = Field(default=None, ge=0, le=8)
    ignore_eos: bool = False


# ---------------------------------------------------------------- request -> template messages


def _blocks(content) -> List[Dict[str, Any]]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def _unsupported(kind: Any, where: str, param: str):
    if kind in ("image", "document"):
        return bad_request(f"{where}: {kind} blocks are not supported: this model reads text only", param)
    return bad_request(f"{where}: content block type {kind!r} is not supported here", param)


def _text(block: Dict[str, Any], where: str, param: str) -> str:
    if not isinstance(block.get("text"), str):
        raise bad_request(f"{where}: a text block needs a string 'text'", param)
    return block["text"]


def _tool_result_text(block: Dict[str, Any], where: str, param: str) -> str:
    content = block.get("content", "")
    if isinstance(content, str):
        return content
    parts = []
    for k, part in enumerate(content if isinstance(content, list) else []):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise _unsupported(part.get("type") if isinstance(part, dict) else part, f"{where}.content[{k}]", param)
        parts.append(_text(part, where, param))
    return "\n".join(parts)


def system_text(system) -> Optional[str]:
    if system is None or isinstance(system, str):
        return system
    parts = []
    for i, b in enumerate(system):
        if b.get("type") != "text":
            raise _unsupported(b.get("type"), f"system[{i}]", "system")
        parts.append(_text(b, f"system[{i}]", "system"))
    return "\n".join(parts)


def template_messages(req: CountTokensRequest) -> List[dict]:
    """Anthropic messages -> the OpenAI-style messages chat templates read."""
    out: List[dict] = []
    if req.system:
        out.append({"role": "system", "content": system_text(req.system)})
    for i, m in enumerate(req.messages):
        param = f"messages.{i}.content"
        if m.role == "system":  # chat.render merges system messages into the first one
            out.append({"role": "system", "content": system_text(m.content)})
            continue
        if m.role == "user":
            texts = []
            for j, b in enumerate(_blocks(m.content)):
                where, kind = f"messages[{i}].content[{j}]", b.get("type")
                if kind == "text":
                    texts.append(_text(b, where, param))
                elif kind == "tool_result":
                    if not isinstance(b.get("tool_use_id"), str):
                        raise bad_request(f"{where}: a tool_result block needs 'tool_use_id'", param)
                    out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": _tool_result_text(b, where, param)})
                else:
                    raise _unsupported(kind, where, param)
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
            continue
        msg: Dict[str, Any] = {"role": "assistant", "content": ""}
        texts, reasoning, calls = [], [], []
        for j, b in enumerate(_blocks(m.content)):
            where, kind = f"messages[{i}].content[{j}]", b.get("type")
            if kind == "text":
                texts.append(_text(b, where, param))
            elif kind == "thinking":
                reasoning.append(str(b.get("thinking", "")))
            elif kind == "redacted_thinking":
                continue
            elif kind == "tool_use":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise bad_request(f"{where}: a tool_use block needs 'name' and an object 'input'", param)
                calls.append({"id": b.get("id") or "", "type": "function",
                              "function": {"name": b["name"], "arguments": b.get("input", {})}})
            else:
                raise _unsupported(kind, where, param)
        msg["content"] = "".join(texts)
        if reasoning:
            msg["reasoning_content"] = "\n".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def openai_tools(tools: Optional[List[AnthropicTool]]) -> List[dict]:
    out = []
    for i, t in enumerate(tools or ()):
        if t.type not in (None, "custom"):
            raise bad_request(f"tools[{i}]: tool type {t.type!r} is not supported (only custom tools with an input_schema)", f"tools.{i}.type")
        fn = {"name": t.name, "parameters": t.input_schema or {"type": "object", "properties": {}}}
        if t.description:
            fn["description"] = t.description
        out.append({"type": "function", "function": fn})
    return out


def template_kwargs(thinking: Optional[Thinking]) -> dict:
    """Anthropic's semantics: no `thinking` means no thinking (Claude Code sends "adaptive"
    unless MAX_THINKING_TOKENS=0)."""
    return {"enable_thinking": thinking is not None and thinking.type != "disabled"}


def render(svc: Service, req: CountTokensRequest) -> ChatPrompt:
    choice, name = None, None
    if req.tool_choice is not None:
        kind = req.tool_choice.type
        if kind == "tool":
            if not req.tool_choice.name:
                raise bad_request("tool_choice of type 'tool' needs a 'name'", "tool_choice.name")
            name = req.tool_choice.name
        else:
            choice = {"auto": "auto", "any": "required", "none": "none"}[kind]
    parallel = not (req.tool_choice and req.tool_choice.disable_parallel_tool_use)
    return svc.chat.render(template_messages(req), openai_tools(req.tools), choice, name, template_kwargs(req.thinking),
                           parallel_tool_calls=parallel, schema_mode=req.json_schema_mode or svc.config.json_schema_mode)


# ---------------------------------------------------------------- response


STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def stop_reason(svc: Service, finish: str, ids: List[int], text: str, stops: List[str]) -> tuple:
    """(stop_reason, stop_sequence). The engine reports "stop" for EOS and stop strings alike;
    a stop string is what the full decoded output has where the returned text ends."""
    if finish in STOP_REASONS:
        return STOP_REASONS[finish], None
    if stops and (not ids or ids[-1] not in svc.eos_ids):
        rest = svc.tokenizer.decode(ids)[len(text):]
        for s in stops:
            if rest.startswith(s):
                return "stop_sequence", s
    return "end_turn", None


def usage(stats, n_prompt: int) -> dict:
    cached = stats.cached_tokens if stats is not None else 0
    return {"input_tokens": n_prompt - cached, "output_tokens": stats.generated_tokens if stats is not None else 0,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached, "speculative": speculative(stats)}


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def message_body(mid: str, model: str, content: list, stop: tuple, usage_: dict) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage_}


@router.post("/v1/messages")
async def messages(req: MessagesRequest, request: Request):
    started = time.perf_counter()
    svc: Service = request.app.state.service
    svc.check_model(req.model)
    if req.thinking is not None and req.thinking.type == "enabled" and req.thinking.budget_tokens is None:
        raise bad_request("thinking.budget_tokens: required when thinking is enabled", "thinking.budget_tokens")
    prompt = await svc.run_cpu(render, svc, req)
    stops = list(req.stop_sequences or ())
    sampling = Sampling.of(req, stop=tuple(stops))
    parallel = not (req.tool_choice and req.tool_choice.disable_parallel_tool_use)
    budget = req.thinking.budget_tokens if req.thinking is not None and req.thinking.type == "enabled" else None
    gen = svc.generation(prompt, sampling, started=started, prompt_param="messages", parallel_tool_calls=parallel,
                         reasoning_budget=budget)
    handle = svc.submit(gen)
    mid, model = f"msg_{uuid.uuid4().hex[:24]}", svc.config.served_model_name
    if req.stream:
        events = message_stream(svc, gen, handle, request, mid, model, stops)
        return sse_response(svc, events, request.scope, on_error=stream_error, ping=ping)
    done = await complete(svc, gen, handle, request)
    parsed = parse_output(svc, gen, done.text)
    content = []
    if parsed.reasoning is not None:
        content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    if parsed.content is not None:
        content.append({"type": "text", "text": parsed.content})
    for call in parsed.tool_calls:
        content.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"])})
    finish = finish_reason(done.finish_reason, bool(parsed.tool_calls))
    svc.metrics.request(request.scope, 200)
    report = structured.output_report(prompt.constraint, parsed.content, parsed.tool_calls, done.finish_reason)
    return structured.respond(message_body(mid, model, content, stop_reason(svc, finish, done.token_ids, done.text, stops),
                                           {**usage(done.stats, len(prompt.ids)), **gen.budget_note}), report)


@router.post("/v1/messages/count_tokens")
async def count_tokens(req: CountTokensRequest, request: Request):
    svc: Service = request.app.state.service
    svc.check_model(req.model)
    prompt = await svc.run_cpu(render, svc, req)
    return {"input_tokens": len(prompt.ids)}


# ---------------------------------------------------------------- streaming


def event(kind: str, body: dict) -> dict:
    return {"event": kind, "data": json.dumps({"type": kind, **body}, ensure_ascii=False)}


def ping() -> ServerSentEvent:
    return ServerSentEvent(event="ping", data='{"type": "ping"}')


def stream_error(e: Exception) -> List[dict]:
    return [{"event": "error", "data": json.dumps(anthropic_error_body(failure_status(e), str(e)))}]


BLOCK_STARTS = {"thinking": {"type": "thinking", "thinking": "", "signature": ""}, "text": {"type": "text", "text": ""}}
DELTAS = {"thinking": ("thinking_delta", "thinking"), "text": ("text_delta", "text")}


async def message_stream(svc: Service, gen, handle, request, mid: str, model: str, stops: List[str]):
    """message_start, then per block content_block_start / _delta... / _stop, then
    message_delta (stop reason, usage) and message_stop. message_start waits for the
    first tokens, so its usage holds the cached tokens; pings keep the wait alive."""
    n_prompt = len(gen.prompt.ids)
    index, kind = -1, None  # the open content block
    ids, text, started = [], [], False
    events = []  # for the structured_output report
    async for step in stream_steps(svc, gen, handle, request):
        events += step.events
        c = step.chunk
        if c is not None and not started:
            started = True
            yield event("message_start", {"message": message_body(mid, model, [], (None, None), {**usage(c.stats, n_prompt), "output_tokens": 0})})
            yield {"event": "ping", "data": '{"type": "ping"}'}
        if c is not None:
            ids += c.token_ids
            text.append(c.text)
        for ev in step.events:
            if isinstance(ev, (ReasoningDelta, ContentDelta)):
                want = "thinking" if isinstance(ev, ReasoningDelta) else "text"
                if kind != want:
                    if kind is not None:
                        yield event("content_block_stop", {"index": index})
                    index, kind = index + 1, want
                    yield event("content_block_start", {"index": index, "content_block": BLOCK_STARTS[want]})
                name, field = DELTAS[want]
                yield event("content_block_delta", {"index": index, "delta": {"type": name, field: ev.text}})
            elif isinstance(ev, ToolCallStart):
                if kind is not None:
                    yield event("content_block_stop", {"index": index})
                index, kind = index + 1, "tool_use"
                yield event("content_block_start", {"index": index, "content_block": {
                    "type": "tool_use", "id": tool_use_id(ev.id), "name": ev.name, "input": {}}})
            elif isinstance(ev, ToolCallArgsDelta):
                yield event("content_block_delta", {"index": index, "delta": {"type": "input_json_delta", "partial_json": ev.text}})
        if step.finish_reason:
            if kind is not None:
                yield event("content_block_stop", {"index": index})
            reason, seq = stop_reason(svc, step.finish_reason, ids, "".join(text), stops)
            yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq}, "usage": {**usage(c.stats, n_prompt), **gen.budget_note}, **stream_report(gen, events, step.finish_reason)})
            yield event("message_stop", {})


def stream_report(gen, events: list, finish: str) -> dict:
    """{"structured_output": ...} for the stream's message_delta, beside usage; {} without a JSON schema."""
    parsed = collect(events)
    report = structured.output_report(gen.prompt.constraint, parsed.content, parsed.tool_calls,
                                      "length" if finish == "length" else "stop")
    return {} if report is None else {"structured_output": report}

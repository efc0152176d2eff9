"""Anthropic Messages (`POST /v1/messages`, `/v1/messages/count_tokens`): an adapter over
the internal request model, for Claude Code and the `anthropic` SDKs.

In: system, messages (text, image, tool_use, tool_result and thinking blocks; images in user
turns and inside tool_result content), tools,
tool_choice, stop_sequences, sampling, thinking. Out: content blocks (thinking,
text, tool_use), stop_reason, usage (`input_tokens` excludes the prompt tokens
read from the prompt cache, reported as `cache_read_input_tokens`, as Anthropic
counts them) plus the MTP figures as `usage.speculative`. Streams follow
Anthropic's event sequence with SSE `event:` names. Errors have Anthropic's
shape (see errors.py).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Dict, List, Literal, Optional, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import ServerSentEvent

from mtp_serve.server import structured
from mtp_serve.server.chat import ChatPrompt
from mtp_serve.server.errors import anthropic_error_body, bad_request, failure_status
from mtp_serve.server.fields import UnsupportedMessages, refuse_unsupported
from mtp_serve.server.run import Options, Run, Usage
from mtp_serve.server.schemas import STRICT, SamplingFields
from mtp_serve.server.models_registry import service_for
from mtp_serve.server.service import Service
from mtp_serve.server.streaming import sse_response
from mtp_serve.server.images import image_ref
from mtp_serve.server.translate import Block, BlockEvent, Blocks, flatten_text, function_tool, joined, unsupported

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


class MessagesRequest(CountTokensRequest, SamplingFields, UnsupportedMessages):
    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[List[str]] = Field(default=None, max_length=16)
    stream: bool = False
    metadata: Optional[Dict[str, Any]] = None


# ---------------------------------------------------------------- request -> template messages


def _blocks(content) -> List[Dict[str, Any]]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def prefill(messages: List[dict]) -> bool:
    """A final assistant message with text (and no tool calls) starts the reply: the
    output continues it (Anthropic's prefill), without opening a new turn."""
    if not messages or messages[-1]["role"] != "assistant" or messages[-1].get("tool_calls") or not messages[-1]["content"]:
        return False
    if messages[-1]["content"] != messages[-1]["content"].rstrip():
        raise bad_request("final assistant content cannot end with trailing whitespace", f"messages.{len(messages) - 1}.content")
    return True


def _text(block: Dict[str, Any], where: str, param: str) -> str:
    return flatten_text([block], where, param, kinds=("text",))


def system_text(system, param: str = "system") -> Optional[str]:
    return None if system is None else flatten_text(system, param, param, kinds=("text",), sep="\n")


def template_messages(req: CountTokensRequest) -> List[dict]:
    """Anthropic messages -> the OpenAI-style messages chat templates read."""
    out: List[dict] = []
    if req.system:
        out.append({"role": "system", "content": system_text(req.system)})
    last = len(req.messages) - 1
    for i, m in enumerate(req.messages):
        param = f"messages.{i}.content"
        if not m.content and not (i == last and m.role == "assistant"):
            raise bad_request(f"messages.{i}: all messages must have non-empty content except for the optional final "
                              "assistant message", param)
        for j, b in enumerate(_blocks(m.content)):
            if isinstance(b, dict) and b.get("type") == "text" and b.get("text") == "":
                raise bad_request(f"messages.{i}.content.{j}: text content blocks must be non-empty", param)
        if m.role == "system":  # chat.render merges system messages into the first one
            out.append({"role": "system", "content": system_text(m.content, param)})
            continue
        if m.role == "user":
            contents = []  # text and image blocks, in order
            for j, b in enumerate(_blocks(m.content)):
                where, kind = f"messages[{i}].content[{j}]", b.get("type")
                if kind == "text":
                    contents.append(_text(b, where, param))
                elif kind == "image":
                    contents.append([{"type": "image", "image": image_ref(b, where, param)}])
                elif kind == "tool_result":  # text and images (Claude Code's Read of a screenshot)
                    if not isinstance(b.get("tool_use_id"), str):
                        raise bad_request(f"{where}: a tool_result block needs 'tool_use_id'", param)
                    out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                                "content": flatten_text(b.get("content", ""), f"{where}.content", param, kinds=("text",),
                                                        sep="\n", images=True)})
                else:
                    raise unsupported(kind, where, param)
            if contents:
                out.append({"role": "user", "content": joined(contents, "\n")})
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
                raise unsupported(kind, where, param)
        msg["content"] = "".join(texts)
        if reasoning:
            msg["reasoning_content"] = "\n".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def openai_tools(tools: Optional[List[AnthropicTool]]) -> List[dict]:
    for i, t in enumerate(tools or ()):
        if t.type not in (None, "custom"):
            raise bad_request(f"tools[{i}]: tool type {t.type!r} is not supported (only custom tools with an input_schema)", f"tools.{i}.type")
    return [function_tool(t.name, t.input_schema, t.description) for t in tools or ()]


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
    messages = template_messages(req)
    return svc.render(messages, openai_tools(req.tools), choice, name, template_kwargs(req.thinking),
                           parallel_tool_calls=parallel, schema_mode=req.json_schema_mode or svc.config.json_schema_mode,
                           continue_final=prefill(messages))


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


def usage(u: Usage) -> dict:
    """Anthropic counts the prompt tokens read from the cache apart from `input_tokens`."""
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": u.cached_tokens, "speculative": u.speculative, **u.note}


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict:
    """A call's JSON arguments as tool_use `input` (a Hermes model's own text can be malformed: then {})."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message_body(mid: str, model: str, content: list, stop: tuple, usage_: dict) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage_}


@router.post("/v1/messages")
async def messages(req: MessagesRequest, request: Request):
    refuse_unsupported(req)
    svc = await service_for(request, req.model)
    if req.thinking is not None and req.thinking.type == "enabled" and req.thinking.budget_tokens is None:
        raise bad_request("thinking.budget_tokens: required when thinking is enabled", "thinking.budget_tokens")
    prompt = await svc.run_cpu(render, svc, req)
    stops = list(req.stop_sequences or ())
    budget = req.thinking.budget_tokens if req.thinking is not None and req.thinking.type == "enabled" else None
    run = svc.start(request, prompt, req, max_tokens=req.max_tokens, stop=tuple(stops),
                    options=Options(parallel_tool_calls=not (req.tool_choice and req.tool_choice.disable_parallel_tool_use),
                                    reasoning_budget=budget))
    mid, model = f"msg_{uuid.uuid4().hex[:24]}", svc.config.served_model_name
    if req.stream:
        return sse_response(svc, message_stream(svc, run, mid, model, stops), request.scope, on_error=stream_error, ping=ping)
    done = await run.complete()
    content = []
    if done.parsed.reasoning is not None:
        content.append({"type": "thinking", "thinking": done.parsed.reasoning, "signature": ""})
    if done.parsed.content is not None:
        content.append({"type": "text", "text": done.parsed.content})
    for call in done.parsed.tool_calls:
        content.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                        "input": tool_input(call["function"]["arguments"])})
    stop = stop_reason(svc, done.finish_reason, done.token_ids, done.text, stops)
    return run.respond(message_body(mid, model, content, stop, usage(done.usage)), done.report)


@router.post("/v1/messages/count_tokens")
async def count_tokens(req: CountTokensRequest, request: Request):
    svc = await service_for(request, req.model)
    prompt = await svc.run_cpu(render, svc, req)
    return {"input_tokens": len(prompt.ids)}


# ---------------------------------------------------------------- streaming


def event(kind: str, body: dict) -> dict:
    return {"event": kind, "data": json.dumps({"type": kind, **body}, ensure_ascii=False)}


def ping() -> ServerSentEvent:
    return ServerSentEvent(event="ping", data='{"type": "ping"}')


def stream_error(e: Exception) -> List[dict]:
    return [{"event": "error", "data": json.dumps(anthropic_error_body(failure_status(e), str(e)))}]


def block_start(block: Block) -> dict:
    if block.kind == "tool_use":
        return {"type": "tool_use", "id": tool_use_id(block.call.id), "name": block.call.name, "input": {}}
    return {"type": "thinking", "thinking": "", "signature": ""} if block.kind == "thinking" else {"type": "text", "text": ""}


DELTAS = {"thinking": ("thinking_delta", "thinking"), "text": ("text_delta", "text"), "tool_use": ("input_json_delta", "partial_json")}


def block_event(e: BlockEvent) -> dict:
    if e.type == "start":
        return event("content_block_start", {"index": e.block.index, "content_block": block_start(e.block)})
    if e.type == "stop":
        return event("content_block_stop", {"index": e.block.index})
    name, field = DELTAS[e.block.kind]
    return event("content_block_delta", {"index": e.block.index, "delta": {"type": name, field: e.delta}})


async def message_stream(svc: Service, run: Run, mid: str, model: str, stops: List[str]):
    """message_start, then per block content_block_start / _delta... / _stop, then
    message_delta (stop reason, usage) and message_stop. message_start waits for the
    first tokens, so its usage holds the cached tokens; pings keep the wait alive."""
    blocks = Blocks()
    started = False
    async for step in run.steps():
        if step.chunk is not None and not started:
            started = True
            first = {**usage(run.usage(step.chunk.stats)), "output_tokens": 0}
            yield event("message_start", {"message": message_body(mid, model, [], (None, None), first)})
            yield {"event": "ping", "data": '{"type": "ping"}'}
        for e in blocks.feed(step.events):
            yield block_event(e)
        if step.finish_reason:
            for e in blocks.close():
                yield block_event(e)
            reason, seq = stop_reason(svc, step.finish_reason, run.token_ids, run.text, stops)
            report = structured.field(step.report)
            yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq}, "usage": usage(step.usage), **report})
            yield event("message_stop", {})

"""OpenAI Responses (`POST /v1/responses`): an adapter over the internal request model,
for Codex CLI and `client.responses.create`.

In: input (a string or items: messages, function_call, function_call_output,
reasoning; input_image parts in user messages and function call outputs), instructions, function tools, tool_choice, max_output_tokens,
sampling, reasoning effort (the template's thinking switch), previous_response_id.
Out: output items (reasoning, message with output_text, function_call), usage
with `input_tokens_details.cached_tokens` (and `image_tokens`) and the MTP figures as
`usage.speculative`. Streams send the documented events, each with its
`sequence_number`; an engine failure ends a stream with `response.failed`.

Stored responses (`store`, default true) live in a bounded in-memory store
(`responses_store.py`: retrieve, delete, cancel, background runs), so a request
can continue one with `previous_response_id`; clients that resend the whole
conversation (Codex) need no store. `include: ["message.output_text.logprobs"]`
(or `top_logprobs`) adds each output_text part's token logprobs.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Dict, List, Literal, Optional, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mtp_serve.server import constraints, structured
from mtp_serve.engine.engine_loop import EngineError, EngineStopped
from mtp_serve.server.chat import thinking_switch
from mtp_serve.server.errors import APIError, bad_request, internal_error
from mtp_serve.server.fields import UnsupportedResponses, refuse_unsupported
from mtp_serve.server.parsers import ParsedOutput
from mtp_serve.server.run import Options, Run, Usage
from mtp_serve.server.schemas import STRICT, SamplingFields
from mtp_serve.server.models_registry import service_for
from mtp_serve.server.openai_api import chat_logprobs
from mtp_serve.server.responses_store import ResponseStore, run_in_background
from mtp_serve.server.service import Service
from mtp_serve.server.streaming import sse_response
from mtp_serve.server.translate import Block, BlockEvent, Blocks, flatten_text, function_tool

router = APIRouter()
OUTPUT_LOGPROBS = "message.output_text.logprobs"
# `include` values: the logprobs are given; the others name output this server never makes
# (encrypted reasoning, hosted tools' results, input images echoed back), so they add nothing.
INCLUDABLE = (OUTPUT_LOGPROBS, "reasoning.encrypted_content", "message.input_image.image_url",
              "computer_call_output.output.image_url", "file_search_call.results", "web_search_call.results",
              "web_search_call.action.sources", "code_interpreter_call.outputs")


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", **STRICT)


class TextConfig(_Model):
    format: Optional[Dict[str, Any]] = None  # {"type": "text" | "json_object" | "json_schema", ...}


class ReasoningConfig(_Model):
    effort: Optional[str] = None  # none / minimal: the template's thinking off
    summary: Optional[str] = None


class ResponsesRequest(SamplingFields, UnsupportedResponses):
    model: Optional[str] = None
    input: Union[str, List[Dict[str, Any]]]  # items: validated one by one by type (ITEMS)
    instructions: Optional[str] = None
    tools: Optional[List[Dict[str, Any]]] = None  # validated by type (TOOLS); hosted tools are left out
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    parallel_tool_calls: bool = True
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    stream: bool = False
    store: bool = True
    background: bool = False
    include: Optional[List[str]] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    previous_response_id: Optional[str] = None
    metadata: Optional[Dict[str, Any]] = None


# Input items, by type. Content parts are checked by translate.flatten_text.


class MessageItem(_Model):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, List[Dict[str, Any]]]


class FunctionCallItem(_Model):
    type: Literal["function_call"]
    call_id: str
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(_Model):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, List[Dict[str, Any]]]


class ReasoningText(_Model):
    type: Optional[str] = None
    text: str


class ReasoningItem(_Model):
    type: Literal["reasoning"]
    content: Optional[List[ReasoningText]] = None
    summary: List[ReasoningText] = []


ITEMS = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
         "reasoning": ReasoningItem}


class FunctionTool(_Model):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None


class NamespaceTool(_Model):
    type: Literal["namespace"]
    name: Optional[str] = None
    tools: List[FunctionTool]


def validated(model, value: Any, param: str):
    """`value` as `model`, or a 400 naming the first wrong field."""
    try:
        return model.model_validate(value)
    except ValidationError as e:
        errors = e.errors()
        loc = errors[0]["loc"]
        if len(errors) > 1:  # a union's members each failed: the field is their common prefix
            n = 0
            while all(len(x["loc"]) > n and x["loc"][n] == loc[n] for x in errors):
                n += 1
            loc = loc[:n]
        where = ".".join([param, *(str(p) for p in loc)])
        msgs = list(dict.fromkeys(x["msg"] for x in errors))
        raise bad_request(f"{where}: {' or '.join(msgs)}"[:500], where) from e


# ---------------------------------------------------------------- request -> template messages


def _assistant(out: List[dict]) -> dict:
    """The assistant message that output items of the current turn add to."""
    if not out or out[-1]["role"] != "assistant":
        out.append({"role": "assistant", "content": ""})
    return out[-1]


def call_ids(messages: List[dict]) -> set:
    return {c.get("id") for m in messages for c in m.get("tool_calls") or ()}


def input_messages(items: Union[str, List[Dict[str, Any]]], history: List[dict] = ()) -> List[dict]:
    """Responses input -> the OpenAI-style messages chat templates read. A
    function_call_output must answer a function_call of the conversation (`history` or `items`)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: List[dict] = []
    calls = call_ids(list(history))
    for i, raw in enumerate(items):
        param = f"input.{i}"
        kind = raw.get("type", "message" if "role" in raw else None) if isinstance(raw, dict) else None
        if kind not in ITEMS:
            raise bad_request(f"input[{i}]: input item type {kind!r} is not supported (message, function_call, "
                              "function_call_output, reasoning)", f"{param}.type")
        item = validated(ITEMS[kind], raw, param)
        if kind == "message":
            content = flatten_text(item.content, f"input[{i}].content", f"{param}.content", images=item.role == "user")
            if item.role == "assistant":
                _assistant(out)["content"] += content
            else:
                out.append({"role": "system" if item.role == "developer" else item.role, "content": content})
        elif kind == "function_call":
            try:
                args = json.loads(item.arguments or "{}")
            except json.JSONDecodeError as e:
                raise bad_request(f"input[{i}]: arguments are not valid JSON: {e}", f"{param}.arguments") from e
            _assistant(out).setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": args}})
            calls.add(item.call_id)
        elif kind == "function_call_output":
            if item.call_id not in calls:
                raise bad_request(f"input[{i}]: no tool call found for function call output with call_id {item.call_id!r}",
                                  f"{param}.call_id")
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": flatten_text(item.output, f"input[{i}].output", f"{param}.output", images=True)})
        else:
            texts = [c.text for c in item.content or ()] or [s.text for s in item.summary]
            a = _assistant(out)
            a["reasoning_content"] = a.get("reasoning_content", "") + "".join(texts)
    return out


HOSTED_TOOLS = ("web_search", "web_search_preview")  # run by OpenAI's servers: not offered to the model


def function_tools(tools: Optional[List[Dict[str, Any]]]) -> tuple:
    """(OpenAI function tools for the template, {function name: namespace}).

    Function tools, and the function tools inside a `namespace` group, are offered
    to the model; hosted tools (web search) are left out; other types are a 400."""
    out, namespaces = [], {}
    for i, t in enumerate(tools or ()):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind in HOSTED_TOOLS:
            continue
        if kind not in ("function", "namespace"):
            raise bad_request(f"tools[{i}]: tool type {kind!r} is not supported (function tools, namespaces of "
                              "function tools, and web_search, which is left out)", f"tools.{i}.type")
        group = [validated(FunctionTool, t, f"tools.{i}")] if kind == "function" else validated(NamespaceTool, t, f"tools.{i}").tools
        for fn in group:
            out.append(function_tool(fn.name, fn.parameters, fn.description))
            if kind == "namespace" and t.get("name"):
                namespaces[fn.name] = t["name"]
    return out, namespaces


def tool_choice(choice) -> tuple:
    """(mode, named function) from "none" / "auto" / "required" / {"type": "function", "name": ...}."""
    if choice is None or choice in ("none", "auto", "required"):
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return None, choice["name"]
    raise bad_request(f"tool_choice {choice!r} is not supported (none, auto, required, or a function by name)", "tool_choice")


def thinking_kwargs(reasoning: Optional[ReasoningConfig]) -> Optional[dict]:
    return thinking_switch(reasoning.effort if reasoning is not None else None)


def render(svc: Service, req: ResponsesRequest, history: List[dict]) -> tuple:
    """(prompt, the conversation so far without instructions, {function: namespace})."""
    schema_mode = req.json_schema_mode or svc.config.json_schema_mode
    output = constraints.from_response_format(req.text.format if req.text else None, "text.format", schema_mode)
    conversation = history + input_messages(req.input, history)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    mode, name = tool_choice(req.tool_choice)
    tools, namespaces = function_tools(req.tools)
    prompt = svc.render(system + conversation, tools, mode, name, thinking_kwargs(req.reasoning), messages_param="input",
                             output=output, parallel_tool_calls=req.parallel_tool_calls, schema_mode=schema_mode)
    return prompt, conversation, namespaces


# ---------------------------------------------------------------- output


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def reasoning_item(iid: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": iid, "summary": [], "content": [{"type": "reasoning_text", "text": text}] if text else [],
            "status": status}


def text_part(text: str, logprobs: Optional[list] = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(iid: str, text: Optional[str], status: str = "completed", logprobs: Optional[list] = None) -> dict:
    return {"type": "message", "id": iid, "status": status, "role": "assistant",
            "content": [] if text is None else [text_part(text, logprobs)]}


def call_item(iid: str, call_id: str, name: str, arguments: str, namespaces: Dict[str, str], status: str = "completed") -> dict:
    item = {"type": "function_call", "id": iid, "call_id": call_id, "name": name, "arguments": arguments, "status": status}
    if name in namespaces:
        item["namespace"] = namespaces[name]
    return item


def output_items(parsed: ParsedOutput, namespaces: Dict[str, str], cut_off: bool) -> List[dict]:
    """The output items; a reply with no text and no call still has its (empty) message. Cut off
    by max_output_tokens, the last item is `incomplete`."""
    items = []
    if parsed.reasoning is not None:
        items.append(reasoning_item(new_id("rs"), parsed.reasoning))
    if parsed.content is not None or not parsed.tool_calls:
        items.append(message_item(new_id("msg"), parsed.content or ""))
    for c in parsed.tool_calls:
        items.append(call_item(new_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"], namespaces))
    if cut_off:
        items[-1]["status"] = "incomplete"
    return items


def usage(svc: Service, u: Usage, reasoning: str) -> dict:
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens, "image_tokens": u.image_tokens},
            "output_tokens": u.output_tokens,
            "output_tokens_details": {"reasoning_tokens": len(svc.encode(reasoning)) if reasoning else 0},
            "total_tokens": u.prompt_tokens + u.output_tokens, "speculative": u.speculative, **u.note}


def response_body(rid: str, created: int, svc: Service, req: ResponsesRequest, run: Run, *, status: str,
                  output: List[dict], usage_: Optional[dict] = None, error: Optional[dict] = None) -> dict:
    text = req.text.model_dump(exclude_none=True) if req.text else {}
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "model": svc.config.served_model_name,
        "error": error, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "output": output,
        "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
        "reasoning": req.reasoning.model_dump() if req.reasoning else None, "store": req.store, "background": req.background,
        "temperature": run.params.temperature, "top_logprobs": req.top_logprobs,
        "text": text | {"format": text.get("format") or {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [], "top_p": run.params.top_p, "truncation": "disabled", "usage": usage_, "metadata": req.metadata or {},
    }


def history_after(conversation: List[dict], items: List[dict]) -> List[dict]:
    """The conversation a later request continues: this response's output appended."""
    return conversation + input_messages([{k: v for k, v in item.items() if k != "id"} if item["type"] != "message"
                                          else {"type": "message", "role": "assistant", "content": item["content"]}
                                          for item in items])


def wants_logprobs(req: ResponsesRequest) -> Optional[int]:
    """How many top logprobs each output_text token gets (None: no logprobs)."""
    for i, value in enumerate(req.include or ()):
        if value not in INCLUDABLE:
            raise bad_request(f"include[{i}]: {value!r} is not supported (supported: {', '.join(INCLUDABLE)})", f"include.{i}")
    if OUTPUT_LOGPROBS in (req.include or ()) or req.top_logprobs:
        return req.top_logprobs or 0
    return None


def check_modes(req: ResponsesRequest) -> None:
    if req.background and not req.store:
        raise bad_request("background responses must be stored: background=true needs store=true", "background")
    if req.background and req.stream:
        raise bad_request("background=true with stream=true is not supported: create the response in the background, "
                          "then poll GET /v1/responses/{id}", "stream")


@router.post("/v1/responses")
async def responses(req: ResponsesRequest, request: Request):
    refuse_unsupported(req)
    check_modes(req)
    top = wants_logprobs(req)
    svc = await service_for(request, req.model)
    store: ResponseStore = request.app.state.response_store
    history = store.conversation(req.previous_response_id) if req.previous_response_id else []
    prompt, conversation, namespaces = await svc.run_cpu(render, svc, req, history)
    run = svc.start(request, prompt, req, max_tokens=req.max_output_tokens, logprobs=top,
                    options=Options(parallel_tool_calls=req.parallel_tool_calls, prompt_param="input",
                                    max_tokens_param="max_output_tokens"))
    rid, created = new_id("resp"), int(time.time())
    final: Dict[str, Any] = {}  # the finished body and its structured-output report

    def finish(output: List[dict], u: Usage, reason: str, reasoning: str, report: Optional[dict]) -> dict:
        status = "incomplete" if reason == "length" else "completed"
        body = response_body(rid, created, svc, req, run, status=status, output=output, usage_=usage(svc, u, reasoning))
        body = final["body"] = {**body, **structured.field(report)}
        final["report"] = report
        if req.store and (not req.background or rid in store):  # a deleted background response stays deleted
            store.put(rid, body, history_after(conversation, output))
        return body

    def stream(ev: Events, items: Optional[Dict[int, dict]] = None, on_start=None):
        return response_stream(svc, req, run, rid, created, ev, finish, namespaces, items=items, on_start=on_start,
                               logprobs=top is not None)

    if req.background:
        return start_background(request, store, svc, req, run, rid, created, stream)
    if req.stream:
        ev = Events()

        def failed(e: Exception) -> List[dict]:
            return [ev("response.failed", response=response_body(rid, created, svc, req, run, status="failed", output=[],
                                                                 error={"code": "server_error", "message": str(e)}))]

        return sse_response(svc, stream(ev), request.scope, on_error=failed)
    if top is not None:  # logprobs are laid out per output_text part, as the stream lays them out
        async for _ in stream(Events()):
            pass
        return run.respond(final["body"], final["report"])
    done = await run.complete()
    body = finish(output_items(done.parsed, namespaces, done.finish_reason == "length"), done.usage, done.finish_reason,
                  done.parsed.reasoning or "", None)
    return run.respond(body, done.report)


def failure_message(e: Exception) -> str:
    """What a client may read of a failure (an engine's own message; anything else is logged)."""
    return str(e) if isinstance(e, (EngineError, EngineStopped)) else internal_error(e, "/v1/responses")


def start_background(request: Request, store: ResponseStore, svc: Service, req: ResponsesRequest, run: Run, rid: str,
                     created: int, stream):
    """Answer `queued` now; the response generates in a task of its own (responses_store.py)."""
    body = response_body(rid, created, svc, req, run, status="queued", output=[])
    store.put(rid, body)
    items: Dict[int, dict] = {}

    async def work():
        async for _ in stream(Events(), items, on_start=lambda: store.update(rid, status="in_progress")):
            pass

    # The model's leases go with the task: released when it ends, not with this request.
    leases = request.scope.get("mtp_leases")
    held = list(leases or ())
    if leases:
        leases.clear()
    models = request.app.state.models
    so_far = lambda: [items[i] for i in sorted(items)]  # noqa: E731
    run_in_background(store, rid, work(),
                      on_cancel=lambda: {"status": "cancelled", "output": so_far()},
                      on_failure=lambda e: {"status": "failed", "output": so_far(),
                                            "error": {"code": "server_error", "message": failure_message(e)}},
                      release=lambda: [models.release(e) for e in held])
    return run.respond(body)


# ---------------------------------------------------------------- streaming


class Events:
    """Responses stream events with their `event:` names and increasing sequence numbers."""

    def __init__(self):
        self.n = 0

    def __call__(self, kind: str, **body) -> dict:
        self.n += 1
        return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": self.n - 1, **body}, ensure_ascii=False)}


def item_events(ev: Events, e: BlockEvent, items: Dict[int, dict], namespaces: Dict[str, str],
                text_logprobs: Dict[int, list], step_logprobs: list, status: str = "completed") -> List[dict]:
    """One content block's event as output item events: added (and its content part),
    deltas, then the done events (the item `status` given). A text delta carries
    `step_logprobs` (emptied once used), which also join its part's logprobs."""
    b, idx = e.block, e.block.index
    if e.type == "start":
        if b.kind == "thinking":
            item, part = reasoning_item(new_id("rs"), "", "in_progress"), {"type": "reasoning_text", "text": ""}
        elif b.kind == "text":
            item, part = message_item(new_id("msg"), "", "in_progress"), text_part("")
        else:
            item, part = call_item(new_id("fc"), b.call.id, b.call.name, "", namespaces, "in_progress"), None
        items[idx] = item
        out = [ev("response.output_item.added", output_index=idx, item=dict(item))]
        if part is not None:
            out.append(ev("response.content_part.added", item_id=item["id"], output_index=idx, content_index=0, part=part))
        return out
    item = items[idx]
    if e.type == "delta":
        if b.kind == "tool_use":
            return [ev("response.function_call_arguments.delta", item_id=item["id"], output_index=idx, delta=e.delta)]
        if b.kind == "thinking":
            return [ev("response.reasoning_text.delta", item_id=item["id"], output_index=idx, content_index=0, delta=e.delta)]
        lps = list(step_logprobs)
        step_logprobs.clear()
        text_logprobs.setdefault(idx, []).extend(lps)
        return [ev("response.output_text.delta", item_id=item["id"], output_index=idx, content_index=0, delta=e.delta,
                   logprobs=lps)]
    if b.kind == "thinking":
        item["content"] = [{"type": "reasoning_text", "text": b.text}]
        part = item["content"][0]
        out = [ev("response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0, text=b.text),
               ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0, part=part)]
    elif b.kind == "text":
        lps = text_logprobs.get(idx, [])
        item["content"] = [text_part(b.text, lps)]
        out = [ev("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0, text=b.text, logprobs=lps),
               ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0, part=item["content"][0])]
    else:
        item["arguments"] = b.text
        out = [ev("response.function_call_arguments.done", item_id=item["id"], output_index=idx, name=item["name"],
                  arguments=b.text)]
    item["status"] = status
    return out + [ev("response.output_item.done", output_index=idx, item=item)]


async def response_stream(svc: Service, req, run: Run, rid: str, created: int, ev: Events, finish, namespaces,
                          items: Optional[Dict[int, dict]] = None, on_start=None, logprobs: bool = False):
    """response.created, response.in_progress, then per output item: output_item.added,
    its content / argument events, output_item.done; then response.completed
    (response.incomplete when max_output_tokens cut it: the last item is `incomplete`).
    A reply with neither text nor a call still has its (empty) message. `items` (given)
    holds the output items so far; `on_start` is called at the first engine step;
    with `logprobs`, each engine step's token logprobs go with its text."""
    start = response_body(rid, created, svc, req, run, status="in_progress", output=[])
    yield ev("response.created", response=start)
    yield ev("response.in_progress", response=start)
    blocks, items = Blocks(), {} if items is None else items
    text_logprobs: Dict[int, list] = {}
    pending: list = []  # logprobs of tokens whose text is still held back by the parsers
    kinds = set()
    async for step in run.steps():
        if on_start is not None:
            on_start()
            on_start = None
        if logprobs and step.chunk is not None and step.chunk.logprobs:
            pending += chat_logprobs(step.chunk.logprobs, svc.token_text)["content"]
        events = blocks.feed(step.events)
        if step.events and not any(e.type == "delta" and e.block.kind == "text" for e in events):
            pending.clear()  # reasoning or call tokens: not the message's
        closing = blocks.close() if step.finish_reason else []
        if closing and not {"text", "tool_use"} & (kinds | {e.block.kind for e in events}):
            empty = Block(blocks.count, "text")  # no text and no call: the message is there, empty
            closing += [BlockEvent("start", empty), BlockEvent("stop", empty)]
        for e in events + closing:
            kinds.add(e.block.kind)
            last = step.finish_reason == "length" and e is (closing[-1] if closing else None)
            for x in item_events(ev, e, items, namespaces, text_logprobs, pending, "incomplete" if last else "completed"):
                yield x
        if step.finish_reason:
            reasoning = "".join(items[i]["content"][0]["text"] for i in sorted(items)
                                if items[i]["type"] == "reasoning" and items[i]["content"])
            body = finish([items[i] for i in sorted(items)], step.usage, step.finish_reason, reasoning, step.report)
            yield ev("response.incomplete" if body["status"] == "incomplete" else "response.completed", response=body)

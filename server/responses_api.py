"""OpenAI Responses (`POST /v1/responses`): an adapter over the internal request model,
for Codex CLI and `client.responses.create`.

In: input (a string or items: messages, function_call, function_call_output,
reasoning), instructions, function tools, tool_choice, max_output_tokens,
sampling, reasoning effort (the template's thinking switch), previous_response_id.
Out: output items (reasoning, message with output_text, function_call), usage
with `input_tokens_details.cached_tokens` and the MTP figures as
`usage.speculative`. Streams send the documented events, each with its
`sequence_number`; an engine failure ends a stream with `response.failed`.

Stored responses (`store`, default true) live in a bounded in-memory store,
so a request can continue one with `previous_response_id`; clients that resend
the whole conversation (Codex) need no store.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any, Dict, List, Literal, Optional, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from mtp_serve.server.errors import APIError, bad_request
from mtp_serve.server.schemas import STRICT, RepetitionPenalty, Seed
from mtp_serve.server.generation import Generation, complete, parse_output, stream_steps
from mtp_serve.server import constraints, structured
from mtp_serve.server.openai_format import speculative
from mtp_serve.server.parsers import ContentDelta, ParsedOutput, ReasoningDelta, ToolCallArgsDelta, ToolCallStart
from mtp_serve.server.service import Sampling, Service
from mtp_serve.server.streaming import sse_response

router = APIRouter()
STORE_ENTRIES = 512  # stored responses kept (least recently used go first)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", **STRICT)
    model: Optional[str] = None
    input: Union[str, List[Dict[str, Any]]]
    instructions: Optional[str] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    parallel_tool_calls: bool = True
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    text: Optional[Dict[str, Any]] = None
    reasoning: Optional[Dict[str, Any]] = None
    stream: bool = False
    store: bool = True
    previous_response_id: Optional[str] = None
    metadata: Optional[Dict[str, Any]] = None
    # mtp-serve extras (extra_body), as on /v1/chat/completions
    top_k: Optional[int] = Field(default=None, ge=-1)
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: Optional[RepetitionPenalty] = None
    seed: Optional[Seed] = None
    mtp_depth: Optional[int] = Field(default=None, ge=0, le=8)
    json_schema_mode: Optional[Literal["strict", "relaxed"]] = None  # None: the server's --json-schema-mode
    ignore_eos: bool = False


class ResponseStore:
    """Conversations of stored responses (template messages, instructions left out), bounded."""

    def __init__(self, entries: int = STORE_ENTRIES):
        self.entries = entries
        self._items: "OrderedDict[str, List[dict]]" = OrderedDict()

    def get(self, rid: str) -> List[dict]:
        if rid not in self._items:
            raise APIError(404, f"Previous response with id '{rid}' not found.", param="previous_response_id",
                           code="previous_response_not_found", type="invalid_request_error")
        self._items.move_to_end(rid)
        return self._items[rid]

    def put(self, rid: str, messages: List[dict]) -> None:
        self._items[rid] = messages
        while len(self._items) > self.entries:
            self._items.popitem(last=False)


# ---------------------------------------------------------------- request -> template messages


def _text_parts(content, where: str, param: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for k, part in enumerate(content if isinstance(content, list) else []):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind in ("input_image", "input_file"):
            raise bad_request(f"{where}.content[{k}]: {kind} is not supported: this model reads text only", param)
        else:
            raise bad_request(f"{where}.content[{k}]: content part of type {kind!r} is not supported", param)
    return "".join(parts)


def _assistant(out: List[dict]) -> dict:
    """The assistant message that output items of the current turn add to."""
    if not out or out[-1]["role"] != "assistant":
        out.append({"role": "assistant", "content": ""})
    return out[-1]


def input_messages(items: Union[str, List[Dict[str, Any]]]) -> List[dict]:
    """Responses input -> the OpenAI-style messages chat templates read."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: List[dict] = []
    for i, item in enumerate(items):
        where, param = f"input[{i}]", f"input.{i}"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}: unknown role {role!r}", f"{param}.role")
            text = _text_parts(item.get("content", ""), where, f"{param}.content")
            if role == "assistant":
                a = _assistant(out)
                a["content"] += text
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            try:
                args = json.loads(item.get("arguments") or "{}")
            except (TypeError, json.JSONDecodeError) as e:
                raise bad_request(f"{where}: arguments are not valid JSON: {e}", f"{param}.arguments") from e
            if not isinstance(item.get("name"), str):
                raise bad_request(f"{where}: a function_call needs 'name'", f"{param}.name")
            _assistant(out).setdefault("tool_calls", []).append(
                {"id": item.get("call_id", ""), "type": "function", "function": {"name": item["name"], "arguments": args}})
        elif kind == "function_call_output":
            output = item.get("output", "")
            out.append({"role": "tool", "tool_call_id": item.get("call_id", ""),
                        "content": output if isinstance(output, str) else _text_parts(output, where, f"{param}.output")})
        elif kind == "reasoning":
            texts = [c.get("text", "") for c in (item.get("content") or []) if isinstance(c, dict)]
            texts = texts or [s.get("text", "") for s in (item.get("summary") or []) if isinstance(s, dict)]
            a = _assistant(out)
            a["reasoning_content"] = a.get("reasoning_content", "") + "".join(texts)
        else:
            raise bad_request(f"{where}: input item type {kind!r} is not supported (message, function_call, "
                              "function_call_output, reasoning)", f"{param}.type")
    return out


HOSTED_TOOLS = ("web_search", "web_search_preview")  # run by OpenAI's servers: not offered to the model


def function_tools(tools: Optional[List[Dict[str, Any]]]) -> tuple:
    """(OpenAI function tools for the template, {function name: namespace}).

    Function tools, and the function tools inside a `namespace` group, are offered
    to the model; hosted tools (web search) are left out; other types are a 400."""
    out, namespaces = [], {}

    def add(t: Dict[str, Any], where: str, namespace: Optional[str] = None):
        if t.get("type") != "function" or not isinstance(t.get("name"), str) or not t["name"]:
            raise bad_request(f"{where}: tool type {t.get('type')!r} is not supported (function tools, namespaces of "
                              "function tools, and web_search, which is left out)", where.replace("[", ".").replace("]", "") + ".type")
        fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
        if namespace:
            namespaces[t["name"]] = namespace

    for i, t in enumerate(tools or ()):
        if t.get("type") in HOSTED_TOOLS:
            continue
        if t.get("type") == "namespace" and isinstance(t.get("tools"), list):
            for j, sub in enumerate(t["tools"]):
                add(sub, f"tools[{i}].tools[{j}]", t.get("name"))
        else:
            add(t, f"tools[{i}]")
    return out, namespaces


def tool_choice(choice) -> tuple:
    """(mode, named function) from "none" / "auto" / "required" / {"type": "function", "name": ...}."""
    if choice is None or choice in ("none", "auto", "required"):
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return None, choice["name"]
    raise bad_request(f"tool_choice {choice!r} is not supported (none, auto, required, or a function by name)", "tool_choice")


def thinking_kwargs(reasoning: Optional[dict]) -> Optional[dict]:
    effort = (reasoning or {}).get("effort")
    if effort is None:
        return None
    return {"enable_thinking": effort not in ("none", "minimal")}


def render(svc: Service, req: ResponsesRequest, history: List[dict]) -> tuple:
    """(prompt, the conversation so far without instructions, {function: namespace})."""
    schema_mode = req.json_schema_mode or svc.config.json_schema_mode
    output = constraints.from_response_format((req.text or {}).get("format"), "text.format", schema_mode)
    conversation = history + input_messages(req.input)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    mode, name = tool_choice(req.tool_choice)
    tools, namespaces = function_tools(req.tools)
    prompt = svc.chat.render(system + conversation, tools, mode, name, thinking_kwargs(req.reasoning), messages_param="input",
                             output=output, parallel_tool_calls=req.parallel_tool_calls, schema_mode=schema_mode)
    return prompt, conversation, namespaces


# ---------------------------------------------------------------- output


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def reasoning_item(iid: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": iid, "summary": [], "content": [{"type": "reasoning_text", "text": text}] if text else [],
            "status": status}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(iid: str, text: Optional[str], status: str = "completed") -> dict:
    return {"type": "message", "id": iid, "status": status, "role": "assistant",
            "content": [] if text is None else [text_part(text)]}


def call_item(iid: str, call_id: str, name: str, arguments: str, namespaces: Dict[str, str], status: str = "completed") -> dict:
    item = {"type": "function_call", "id": iid, "call_id": call_id, "name": name, "arguments": arguments, "status": status}
    if name in namespaces:
        item["namespace"] = namespaces[name]
    return item


def output_items(parsed: ParsedOutput, namespaces: Dict[str, str]) -> List[dict]:
    items = []
    if parsed.reasoning is not None:
        items.append(reasoning_item(new_id("rs"), parsed.reasoning))
    if parsed.content is not None:
        items.append(message_item(new_id("msg"), parsed.content))
    for c in parsed.tool_calls:
        items.append(call_item(new_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"], namespaces))
    return items


def usage(svc: Service, stats, n_prompt: int, reasoning: str) -> dict:
    out = stats.generated_tokens if stats is not None else 0
    return {"input_tokens": n_prompt, "input_tokens_details": {"cached_tokens": stats.cached_tokens if stats is not None else 0},
            "output_tokens": out,
            "output_tokens_details": {"reasoning_tokens": len(svc.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0},
            "total_tokens": n_prompt + out, "speculative": speculative(stats)}


def response_body(rid: str, created: int, svc: Service, req: ResponsesRequest, gen: Generation, *, status: str,
                  output: List[dict], usage_: Optional[dict] = None, error: Optional[dict] = None) -> dict:
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "model": svc.config.served_model_name,
        "error": error, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "output": output,
        "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
        "reasoning": req.reasoning, "store": req.store, "temperature": gen.params.temperature,
        "text": (req.text or {}) | {"format": (req.text or {}).get("format") or {"type": "text"}}, "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
        "top_p": gen.params.top_p, "truncation": "disabled", "usage": usage_, "metadata": req.metadata or {},
    }


def structured_report(constraint, output: List[dict], reason: str) -> Optional[dict]:
    """The structured_output report (beside usage) from the output items."""
    text = "".join(part.get("text", "") for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"function": {"name": item["name"], "arguments": item["arguments"]}} for item in output if item["type"] == "function_call"]
    return structured.output_report(constraint, text if any(i["type"] == "message" for i in output) else None, calls,
                                    "length" if reason == "length" else "stop")


def history_after(conversation: List[dict], items: List[dict]) -> List[dict]:
    """The conversation a later request continues: this response's output appended."""
    return conversation + input_messages([{k: v for k, v in item.items() if k != "id"} if item["type"] != "message"
                                          else {"type": "message", "role": "assistant", "content": item["content"]}
                                          for item in items])


@router.post("/v1/responses")
async def responses(req: ResponsesRequest, request: Request):
    started = time.perf_counter()
    svc: Service = request.app.state.service
    svc.check_model(req.model)
    store: ResponseStore = request.app.state.response_store
    history = store.get(req.previous_response_id) if req.previous_response_id else []
    prompt, conversation, namespaces = await svc.run_cpu(render, svc, req, history)
    sampling = Sampling.of(req, max_tokens=req.max_output_tokens)
    gen = svc.generation(prompt, sampling, started=started, prompt_param="input", max_tokens_param="max_output_tokens",
                         parallel_tool_calls=req.parallel_tool_calls)
    handle = svc.submit(gen)
    rid, created = new_id("resp"), int(time.time())

    def finish(output: List[dict], stats, reason: str, reasoning: str) -> dict:
        status = "incomplete" if reason == "length" else "completed"
        if req.store:
            store.put(rid, history_after(conversation, output))
        body = response_body(rid, created, svc, req, gen, status=status, output=output,
                             usage_={**usage(svc, stats, len(prompt.ids), reasoning), **gen.budget_note})
        report = structured_report(prompt.constraint, output, reason)
        return body if report is None else {**body, "structured_output": report}

    if req.stream:
        ev = Events()

        def failed(e: Exception) -> List[dict]:
            return [ev("response.failed", response=response_body(rid, created, svc, req, gen, status="failed", output=[],
                                                                 error={"code": "server_error", "message": str(e)}))]

        return sse_response(svc, response_stream(svc, req, gen, handle, request, rid, created, ev, finish, namespaces), request.scope,
                            on_error=failed)
    done = await complete(svc, gen, handle, request)
    parsed = parse_output(svc, gen, done.text)
    svc.metrics.request(request.scope, 200)
    body = finish(output_items(parsed, namespaces), done.stats, done.finish_reason, parsed.reasoning or "")
    return structured.respond(body, body.get("structured_output"))


# ---------------------------------------------------------------- streaming


class Events:
    """Responses stream events with their `event:` names and increasing sequence numbers."""

    def __init__(self):
        self.n = 0

    def __call__(self, kind: str, **body) -> dict:
        self.n += 1
        return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": self.n - 1, **body}, ensure_ascii=False)}


async def response_stream(svc: Service, req, gen, handle, request, rid: str, created: int, ev: Events, finish, namespaces):
    """response.created, response.in_progress, then per output item: output_item.added,
    its content / argument events, output_item.done; then response.completed
    (response.incomplete when max_output_tokens cut it)."""
    start = response_body(rid, created, svc, req, gen, status="in_progress", output=[])
    yield ev("response.created", response=start)
    yield ev("response.in_progress", response=start)
    items: List[dict] = []  # finished output items
    open_: Optional[dict] = None  # the item being streamed
    reasoning: List[str] = []

    def close():
        nonlocal open_
        item, open_ = open_, None
        idx = len(items)
        items.append(item)
        done = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"] if item["content"] else ""
            done += [ev("response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0, text=text),
                     ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                        part={"type": "reasoning_text", "text": text})]
        elif item["type"] == "message":
            part = item["content"][0]
            done += [ev("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0, text=part["text"], logprobs=[]),
                     ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0, part=part)]
        else:
            done.append(ev("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                           name=item["name"], arguments=item["arguments"]))
        item["status"] = "completed"
        return done + [ev("response.output_item.done", output_index=idx, item=item)]

    def begin(item: dict, part: Optional[dict]):
        nonlocal open_
        open_ = item
        idx = len(items)
        out = [ev("response.output_item.added", output_index=idx, item={**item, "status": "in_progress"})]
        if part is not None:
            out.append(ev("response.content_part.added", item_id=item["id"], output_index=idx, content_index=0, part=part))
        return out

    async for step in stream_steps(svc, gen, handle, request):
        for e in step.events:
            idx = len(items)
            if isinstance(e, ReasoningDelta):
                if open_ is None or open_["type"] != "reasoning":
                    for x in (close() if open_ else []) + begin(reasoning_item(new_id("rs"), "", "in_progress"),
                                                                  {"type": "reasoning_text", "text": ""}):
                        yield x
                    open_["content"] = [{"type": "reasoning_text", "text": ""}]
                open_["content"][0]["text"] += e.text
                reasoning.append(e.text)
                yield ev("response.reasoning_text.delta", item_id=open_["id"], output_index=len(items), content_index=0, delta=e.text)
            elif isinstance(e, ContentDelta):
                if open_ is None or open_["type"] != "message":
                    for x in (close() if open_ else []) + begin(message_item(new_id("msg"), "", "in_progress"), text_part("")):
                        yield x
                open_["content"][0]["text"] += e.text
                yield ev("response.output_text.delta", item_id=open_["id"], output_index=len(items), content_index=0,
                         delta=e.text, logprobs=[])
            elif isinstance(e, ToolCallStart):
                for x in (close() if open_ else []) + begin(call_item(new_id("fc"), e.id, e.name, "", namespaces, "in_progress"), None):
                    yield x
            elif isinstance(e, ToolCallArgsDelta):
                open_["arguments"] += e.text
                yield ev("response.function_call_arguments.delta", item_id=open_["id"], output_index=idx, delta=e.text)
        if step.finish_reason:
            for x in close() if open_ else []:
                yield x
            body = finish(items, step.chunk.stats, step.finish_reason, "".join(reasoning))
            yield ev("response.incomplete" if body["status"] == "incomplete" else "response.completed", response=body)

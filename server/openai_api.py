"""OpenAI chat completions and completions: adapters over the internal request model.

Each route renders the prompt, starts its `Run` (`svc.start`), and turns the
run's `Completion` or `Step`s into OpenAI's wire bodies (plain dicts, below).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Callable, List, Optional

from fastapi import APIRouter, Request

from mtp_serve.engine import scoring
from mtp_serve.server import constraints
from mtp_serve.server import structured
from mtp_serve.server.chat import ChatPrompt, PromptEncoder, template_messages
from mtp_serve.server.errors import bad_request, failure_body
from mtp_serve.server.parsers import ContentDelta, Event, ParsedOutput, ReasoningDelta, ToolCallStart, prompt_opens_reasoning
from mtp_serve.server.run import Options, Run, Usage, respond
from mtp_serve.server.schemas import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from mtp_serve.server.models_registry import service_for
from mtp_serve.server.service import Service
from mtp_serve.server.streaming import sse_response

router = APIRouter()


# ---------------------------------------------------------------- wire bodies


def usage(u: Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.output_tokens,
        "total_tokens": u.prompt_tokens + u.output_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens, "image_tokens": u.image_tokens},
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


def prompt_logprobs_body(ids, lps, token_text: Callable[[int], str]) -> dict:
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



def openai_stream(svc: Service, events, scope):
    """OpenAI streams end with `data: [DONE]`; an engine failure is an error object first."""
    return sse_response(svc, events, scope, done={"data": "[DONE]"},
                        on_error=lambda e: [sse(failure_body(e))])  # e: what the client may read


def check_common(svc: Service, req) -> None:
    if req.n != 1:
        raise bad_request("n must be 1: this server returns one choice per request", "n")


def include_usage(req) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


# ---------------------------------------------------------------- chat


def render_chat(svc: Service, req: ChatCompletionRequest) -> ChatPrompt:
    named = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else None
    return svc.render(template_messages(req.messages), [t.model_dump(exclude_none=True) for t in req.tools or ()],
                           None if named else req.tool_choice, named, req.chat_template_kwargs,
                           output=constraints.requested(req, schema_mode(svc, req)), parallel_tool_calls=req.parallel_tool_calls,
                           schema_mode=schema_mode(svc, req), continue_final=req.continue_final_message)


def schema_mode(svc: Service, req) -> str:
    """The request's json_schema_mode, else the server's (--json-schema-mode)."""
    return req.json_schema_mode or svc.config.json_schema_mode


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request):
    svc = await service_for(request, req.model)
    check_common(svc, req)
    prompt = await svc.run_cpu(render_chat, svc, req)
    top = (req.top_logprobs or 0) if req.logprobs else None
    run = svc.start(request, prompt, req, max_tokens=req.max_completion_tokens or req.max_tokens, stop=req.stop_list,
                    stop_token_ids=tuple(req.stop_token_ids or ()), logprobs=top,
                    options=Options(parallel_tool_calls=req.parallel_tool_calls,
                                    max_tokens_param="max_completion_tokens" if req.max_completion_tokens else "max_tokens"))
    rid, created, model = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), svc.config.served_model_name
    if req.stream:
        return openai_stream(svc, chat_stream(svc, run, rid, created, include_usage(req)), request.scope)
    done = await run.complete()
    logprobs = chat_logprobs(done.logprobs, svc.token_text) if top is not None else None
    body = chat_body(rid, created, model, chat_message(done.parsed), logprobs, done.finish_reason, usage(done.usage))
    return run.respond(body, done.report)


async def chat_stream(svc: Service, run: Run, rid: str, created: int, with_usage: bool):
    model = svc.config.served_model_name

    def chunk(delta, **kw):
        return chat_chunk(rid, created, model, delta, include_usage=with_usage, **kw)

    yield chunk({"role": "assistant", "content": ""})
    async for step in run.steps():
        deltas = [event_delta(ev) for ev in step.events]
        c = step.chunk
        lp = chat_logprobs(c.logprobs, svc.token_text) if c is not None and c.logprobs else None
        if lp is not None and not deltas:
            deltas = [{}]
        for i, d in enumerate(deltas):
            yield chunk(d, logprobs=lp if i == 0 else None)
        if step.finish_reason:
            report = structured.field(step.report)
            yield chunk({}, finish=step.finish_reason, **({} if with_usage else report))
            if with_usage:
                yield chunk(None, usage_=usage(step.usage), **report)


# ---------------------------------------------------------------- completions


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    svc = await service_for(request, req.model)
    check_common(svc, req)
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    ids = await svc.run_cpu(completion_prompt_ids, svc.chat.encoder, req.prompt, svc.loaded.model.vocab_size)
    svc.chat.refuse_image_pads(ids, "prompt")
    constraint = constraints.requested(req, schema_mode(svc, req))
    if constraint is not None:
        await svc.run_cpu(svc.check_constraint, constraint)
    rid, created, model = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time()), svc.config.served_model_name
    echo = svc.tokenizer.decode(ids) if req.echo else ""
    # echo with logprobs: the prompt's own log-probabilities first (eval harnesses' loglikelihood)
    scored = await prompt_logprobs(svc, ids, req.logprobs) if req.echo and req.logprobs is not None else None
    if req.max_tokens == 0:  # nothing to generate: the prompt (and its scores) alone
        svc.check_context(len(ids), "prompt")
        if req.stream:
            return openai_stream(svc, scored_stream(rid, created, model, echo, scored, len(ids), include_usage(req)), request.scope)
        return respond(svc.metrics, request.scope, completion_body(rid, created, model, echo, "length", scored,
                                                                       usage(Usage.of(None, len(ids)))))
    # The thinking budget counts from a think block the prompt opens; the constraint then applies after it.
    opens = (req.thinking_token_budget is not None and svc.chat.reasoning_parser != "none"
             and prompt_opens_reasoning(svc.tokenizer.decode(ids)))
    prompt = ChatPrompt.raw(ids, constraint, svc.chat.checkpoints(ids), opens_reasoning=opens,
                            engine_constraint=svc.chat.engine_constraint(constraint, opens))
    run = svc.start(request, prompt, req, max_tokens=req.max_tokens, stop=req.stop_list,
                    stop_token_ids=tuple(req.stop_token_ids or ()), logprobs=req.logprobs,
                    options=Options(parse=False, prompt_param="prompt"))
    if req.stream:
        return openai_stream(svc, completion_stream(svc, run, rid, created, include_usage(req), echo, scored), request.scope)
    done = await run.complete()
    logprobs = completion_logprobs(done.logprobs, len(echo), svc.token_text) if req.logprobs is not None else None
    body = completion_body(rid, created, model, echo + done.text, done.finish_reason, joined_logprobs(scored, logprobs),
                               usage(done.usage))
    return run.respond(body, done.report)


async def prompt_logprobs(svc: Service, ids: List[int], top_n: int) -> dict:
    """The prompt tokens' log-probabilities (a forward pass on the engine thread), as completions report them."""
    if not svc.engine.jobs_supported:
        raise bad_request("prompt logprobs (echo with logprobs) are not supported when serving across ranks", "echo")
    svc.check_context(len(ids), "prompt")
    lps = await svc.engine_job(lambda: scoring.prompt_logprobs(svc.loaded.model, ids, top_n, svc.config.prefill_chunk))
    return prompt_logprobs_body(ids, lps, svc.token_text)


async def scored_stream(rid: str, created: int, model: str, echo: str, scored, n_prompt: int, with_usage: bool):
    def chunk(text, **kw):
        return completion_chunk(rid, created, model, text, include_usage=with_usage, **kw)

    yield chunk(echo, logprobs=scored)
    yield chunk("", finish="length")
    if with_usage:
        yield chunk(None, usage_=usage(Usage.of(None, n_prompt)))


async def completion_stream(svc: Service, run: Run, rid: str, created: int, with_usage: bool, echo: str, scored=None):
    model = svc.config.served_model_name

    def chunk(text, **kw):
        return completion_chunk(rid, created, model, text, include_usage=with_usage, **kw)

    offset = len(echo)
    if echo:
        yield chunk(echo, logprobs=scored)
    async for step in run.steps():
        c = step.chunk
        lp = completion_logprobs(c.logprobs, offset, svc.token_text) if c.logprobs else None
        offset += len(c.text)
        if c.text or lp is not None:
            yield chunk(c.text, logprobs=lp)
        if step.finish_reason:
            report = structured.field(step.report)
            yield chunk("", finish=step.finish_reason, **({} if with_usage else report))
            if with_usage:
                yield chunk(None, usage_=usage(step.usage), **report)


def completion_prompt_ids(encoder: PromptEncoder, prompt, vocab: int) -> List[int]:
    """A raw prompt is the client's own text: its special tokens are read as such."""
    if isinstance(prompt, str):
        return encoder.encode(prompt)
    if prompt and all(isinstance(t, int) for t in prompt):
        if any(t < 0 or t >= vocab for t in prompt):
            raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
        return list(prompt)
    if len(prompt) != 1:
        raise bad_request("exactly one prompt per request (batched prompts are not supported)", "prompt")
    return completion_prompt_ids(encoder, prompt[0], vocab)

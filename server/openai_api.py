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
from mtp_serve.server import choices, structured
from mtp_serve.server.chat import ChatPrompt, PromptEncoder, template_messages, thinking_switch
from mtp_serve.server.errors import bad_request, failure_body
from mtp_serve.server.fields import refuse_unsupported
from mtp_serve.server.parsers import ContentDelta, Event, ParsedOutput, ReasoningDelta, ToolCallStart, prompt_opens_reasoning
from mtp_serve.server.run import Options, Run, Step, Usage, respond
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


def chat_usage(u: Usage, reasoning_tokens: int) -> dict:
    return {**usage(u), "completion_tokens_details": {"reasoning_tokens": reasoning_tokens}}


def reasoning_fields(text: str) -> dict:
    """Reasoning under both names clients read: `reasoning_content` (DeepSeek's, older
    clients) and `reasoning` (vLLM's and OpenRouter's, newer ones)."""
    return {"reasoning_content": text, "reasoning": text}


def chat_message(parsed: ParsedOutput) -> dict:
    # OpenAI sends "" for an empty reply; null content only beside tool calls.
    content = parsed.content if parsed.content is not None or parsed.tool_calls else ""
    message = {"role": "assistant", "content": content}
    if parsed.reasoning is not None:
        message.update(reasoning_fields(parsed.reasoning))
    if parsed.tool_calls:
        message["tool_calls"] = parsed.tool_calls
    return message


def chat_choice(index: int, message: dict, logprobs: Optional[dict], finish: str) -> dict:
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def chat_body(rid: str, created: int, model: str, items: List[dict], usage_: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": items,
            "usage": usage_}


def chat_chunk(rid: str, created: int, model: str, delta: Optional[dict], *, index: int = 0, finish=None, logprobs=None,
               include_usage: bool = False, usage_: Optional[dict] = None, **extra) -> dict:
    """One `chat.completion.chunk` of choice `index`; delta None: the usage-only last chunk;
    `extra`: top-level fields of the last chunk (structured_output)."""
    body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [] if delta is None else [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
    if include_usage:
        body["usage"] = usage_
    return sse({**body, **extra})


def event_delta(ev: Event) -> dict:
    """A parser event as a chat chunk's delta."""
    if isinstance(ev, ReasoningDelta):
        return reasoning_fields(ev.text)
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


def completion_choice(index: int, text: str, finish: str, logprobs: Optional[dict]) -> dict:
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def completion_body(rid: str, created: int, model: str, items: List[dict], usage_: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": items,
            "usage": usage_}


def completion_chunk(rid: str, created: int, model: str, text: Optional[str], *, index: int = 0, finish=None, logprobs=None,
                     include_usage: bool = False, usage_: Optional[dict] = None, **extra) -> dict:
    body = {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [] if text is None else [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
    if include_usage:
        body["usage"] = usage_
    return sse({**body, **extra})


def top_entries(x, token_text: Callable[[int], str]) -> dict:
    """A completions `top_logprobs` entry: the `logprobs` most likely tokens and the chosen
    one, always among them (up to logprobs + 1 entries, as OpenAI's legacy completions)."""
    top = {token_text(t): lp for t, lp in x.top}
    top.setdefault(token_text(x.token), x.logprob)
    return top


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
        "top_logprobs": [None if x is None else top_entries(x, token_text) for x in lps],
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
        "top_logprobs": [top_entries(x, token_text) for x in lps],
        "text_offset": offsets,
    }



def openai_stream(svc: Service, events, scope):
    """OpenAI streams end with `data: [DONE]`; an engine failure is an error object first."""
    return sse_response(svc, events, scope, done={"data": "[DONE]"},
                        on_error=lambda e: [sse(failure_body(e))])  # e: what the client may read


def check_common(svc: Service, req) -> None:
    refuse_unsupported(req)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def include_usage(req) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


# ---------------------------------------------------------------- chat


def render_chat(svc: Service, req: ChatCompletionRequest) -> ChatPrompt:
    named = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else None
    return svc.render(template_messages(req.messages), [t.model_dump(exclude_none=True) for t in req.tools or ()],
                      None if named else req.tool_choice, named, template_kwargs(req),
                      output=constraints.requested(req, schema_mode(svc, req)), parallel_tool_calls=req.parallel_tool_calls,
                      schema_mode=schema_mode(svc, req), continue_final=req.continue_final_message,
                      add_generation_prompt=req.add_generation_prompt is not False)


def template_kwargs(req: ChatCompletionRequest) -> Optional[dict]:
    """chat_template_kwargs, with reasoning_effort as the template's thinking switch (as on
    /v1/responses) unless the kwargs set it themselves."""
    switch = thinking_switch(req.reasoning_effort) or {}
    return {**switch, **(req.chat_template_kwargs or {})} or None


def schema_mode(svc: Service, req) -> str:
    """The request's json_schema_mode, else the server's (--json-schema-mode)."""
    return req.json_schema_mode or svc.config.json_schema_mode


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request):
    svc = await service_for(request, req.model)
    check_common(svc, req)
    if req.continue_final_message and req.add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true: a continued "
                          "message is not followed by a new turn", "add_generation_prompt")
    check_choices(svc, req.n, "n")
    prompt = await svc.run_cpu(render_chat, svc, req)
    top = (req.top_logprobs or 0) if req.logprobs else None
    options = Options(parallel_tool_calls=req.parallel_tool_calls,
                      max_tokens_param="max_completion_tokens" if req.max_completion_tokens else "max_tokens")
    runs = choices.start(lambda k: svc.start(request, prompt, req, max_tokens=req.max_completion_tokens or req.max_tokens,
                                             stop=req.stop_list, stop_token_ids=tuple(req.stop_token_ids or ()), logprobs=top,
                                             options=options, seed_offset=k), req.n)
    rid, created, model = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), svc.config.served_model_name
    if req.stream:
        return openai_stream(svc, chat_stream(svc, runs, rid, created, include_usage(req)), request.scope)
    done = await choices.complete(runs)
    out = [chat_choice(k, chat_message(d.parsed), chat_logprobs(d.logprobs, svc.token_text) if top is not None else None,
                       d.finish_reason) for k, d in enumerate(done)]
    several_reports(out, [d.report for d in done])
    reasoning = sum(len(svc.encode(d.parsed.reasoning)) for d in done if d.parsed.reasoning)
    u = choices.total_usage([d.usage for d in done], [d.stats for d in done], len(done))
    return respond(svc.metrics, request.scope, chat_body(rid, created, model, out, chat_usage(u, reasoning)), done[0].report)


def several_reports(out: List[dict], reports: List[Optional[dict]]) -> None:
    """With several choices each carries its own structured_output report (the body's is the first's)."""
    if len(out) > 1:
        for c, r in zip(out, reports):
            c.update(structured.field(r))


async def chat_stream(svc: Service, runs: List[Run], rid: str, created: int, with_usage: bool):
    model = svc.config.served_model_name
    several = len(runs) > 1
    reasoning = [""] * len(runs)
    finals: List[Optional[Step]] = [None] * len(runs)

    def chunk(delta, **kw):
        return chat_chunk(rid, created, model, delta, include_usage=with_usage, **kw)

    for k in range(len(runs)):
        yield chunk({"role": "assistant", "content": ""}, index=k)
    async for k, step in choices.steps(runs):
        deltas = [event_delta(ev) for ev in step.events]
        reasoning[k] += "".join(ev.text for ev in step.events if isinstance(ev, ReasoningDelta))
        c = step.chunk
        lp = chat_logprobs(c.logprobs, svc.token_text) if c is not None and c.logprobs else None
        if lp is not None and not deltas:
            deltas = [{}]
        for i, d in enumerate(deltas):
            yield chunk(d, index=k, logprobs=lp if i == 0 else None)
        if step.finish_reason:
            finals[k] = step
            report = structured.field(step.report)
            yield chunk({}, index=k, finish=step.finish_reason, **({} if with_usage and not several else report))
    if with_usage:
        u = choices.total_usage([s.usage for s in finals], [s.chunk.stats for s in finals], len(finals))
        n_reasoning = sum(len(svc.encode(r)) for r in reasoning if r)
        yield chunk(None, usage_=chat_usage(u, n_reasoning), **({} if several else structured.field(finals[0].report)))


# ---------------------------------------------------------------- completions


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    svc = await service_for(request, req.model)
    check_common(svc, req)
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    prompts = await svc.run_cpu(completion_prompts, svc.chat.encoder, req.prompt, svc.loaded.model.vocab_size)
    check_choices(svc, len(prompts) * req.n, "prompt")
    for ids in prompts:
        svc.chat.refuse_image_pads(ids, "prompt")
    constraint = constraints.requested(req, schema_mode(svc, req))
    if constraint is not None:
        await svc.run_cpu(svc.check_constraint, constraint)
    rid, created, model = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time()), svc.config.served_model_name
    n = req.n  # choice index = prompt * n + k, as OpenAI numbers them
    echoes = [svc.tokenizer.decode(ids) if req.echo else "" for ids in prompts]
    # echo with logprobs: the prompt's own log-probabilities first (eval harnesses' loglikelihood)
    scored = [await prompt_logprobs(svc, ids, req.logprobs) if req.echo and req.logprobs is not None else None for ids in prompts]
    if req.max_tokens == 0:  # nothing to generate: the prompts (and their scores) alone
        for ids in prompts:
            svc.check_context(len(ids), "prompt")
        n_prompt = sum(len(ids) for ids in prompts)
        if req.stream:
            return openai_stream(svc, scored_stream(rid, created, model, echoes, scored, n, n_prompt, include_usage(req)),
                                 request.scope)
        out = [completion_choice(j, echoes[j // n], "length", scored[j // n]) for j in range(len(prompts) * n)]
        return respond(svc.metrics, request.scope, completion_body(rid, created, model, out, usage(Usage.of(None, n_prompt))))
    raw = [completion_prompt(svc, ids, constraint, req.thinking_token_budget is not None) for ids in prompts]
    runs = choices.start(lambda j: svc.start(request, raw[j // n], req, max_tokens=req.max_tokens, stop=req.stop_list,
                                             stop_token_ids=tuple(req.stop_token_ids or ()), logprobs=req.logprobs,
                                             options=Options(parse=False, prompt_param="prompt"), seed_offset=j % n),
                         len(prompts) * n)
    if req.stream:
        return openai_stream(svc, completion_stream(svc, runs, rid, created, include_usage(req),
                                                    [echoes[j // n] for j in range(len(runs))],
                                                    [scored[j // n] for j in range(len(runs))], n), request.scope)
    done = await choices.complete(runs)
    out = []
    for j, d in enumerate(done):
        echo = echoes[j // n]
        logprobs = completion_logprobs(d.logprobs, len(echo), svc.token_text) if req.logprobs is not None else None
        out.append(completion_choice(j, echo + d.text, d.finish_reason, joined_logprobs(scored[j // n], logprobs)))
    several_reports(out, [d.report for d in done])
    u = choices.total_usage([d.usage for d in done], [d.stats for d in done], n)
    return respond(svc.metrics, request.scope, completion_body(rid, created, model, out, usage(u)), done[0].report)


def completion_prompt(svc: Service, ids: List[int], constraint, with_budget: bool) -> ChatPrompt:
    # The thinking budget counts from a think block the prompt opens; the constraint then applies after it.
    opens = with_budget and svc.chat.reasoning_parser != "none" and prompt_opens_reasoning(svc.tokenizer.decode(ids))
    return ChatPrompt.raw(ids, constraint, svc.chat.checkpoints(ids), opens_reasoning=opens,
                          engine_constraint=svc.chat.engine_constraint(constraint, opens))


async def prompt_logprobs(svc: Service, ids: List[int], top_n: int) -> dict:
    """The prompt tokens' log-probabilities (a forward pass on the engine thread), as completions report them."""
    if not svc.engine.jobs_supported:
        raise bad_request("prompt logprobs (echo with logprobs) are not supported when serving across ranks", "echo")
    svc.check_context(len(ids), "prompt")
    lps = await svc.engine_job(lambda: scoring.prompt_logprobs(svc.loaded.model, ids, top_n, svc.config.prefill_chunk))
    return prompt_logprobs_body(ids, lps, svc.token_text)


async def scored_stream(rid: str, created: int, model: str, echoes: List[str], scored: list, n: int, n_prompt: int,
                        with_usage: bool):
    def chunk(text, **kw):
        return completion_chunk(rid, created, model, text, include_usage=with_usage, **kw)

    for j in range(len(echoes) * n):
        yield chunk(echoes[j // n], index=j, logprobs=scored[j // n])
        yield chunk("", index=j, finish="length")
    if with_usage:
        yield chunk(None, usage_=usage(Usage.of(None, n_prompt)))


async def completion_stream(svc: Service, runs: List[Run], rid: str, created: int, with_usage: bool, echoes: List[str],
                            scored: list, n: int):
    """`echoes` and `scored`: each run's echoed prompt and its scores ("" and None without echo)."""
    model = svc.config.served_model_name
    several = len(runs) > 1
    finals: List[Optional[Step]] = [None] * len(runs)

    def chunk(text, **kw):
        return completion_chunk(rid, created, model, text, include_usage=with_usage, **kw)

    offsets = [len(e) for e in echoes]
    for j, echo in enumerate(echoes):
        if echo:
            yield chunk(echo, index=j, logprobs=scored[j])
    async for j, step in choices.steps(runs):
        c = step.chunk
        lp = completion_logprobs(c.logprobs, offsets[j], svc.token_text) if c.logprobs else None
        offsets[j] += len(c.text)
        if c.text or lp is not None:
            yield chunk(c.text, index=j, logprobs=lp)
        if step.finish_reason:
            finals[j] = step
            report = structured.field(step.report)
            yield chunk("", index=j, finish=step.finish_reason, **({} if with_usage and not several else report))
    if with_usage:
        u = choices.total_usage([s.usage for s in finals], [s.chunk.stats for s in finals], n)
        yield chunk(None, usage_=usage(u), **({} if several else structured.field(finals[0].report)))


def check_choices(svc: Service, count: int, param: str) -> None:
    """Every choice is an engine request: more than the queue holds could never all start."""
    if count > svc.config.max_queue:
        raise bad_request(f"{count} choices requested; this server queues at most {svc.config.max_queue} requests "
                          "(--max-queue)", param)


def completion_prompts(encoder: PromptEncoder, prompt, vocab: int) -> List[List[int]]:
    """The request's prompts as token ids: a string, a list of token ids, or a list of either."""
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        return [completion_prompt_ids(encoder, prompt, vocab)]
    if not prompt:
        raise bad_request("prompt must not be an empty list", "prompt")
    return [completion_prompt_ids(encoder, p, vocab) for p in prompt]


def completion_prompt_ids(encoder: PromptEncoder, prompt, vocab: int) -> List[int]:
    """A raw prompt is the client's own text: its special tokens are read as such."""
    if isinstance(prompt, str):
        return encoder.encode(prompt)
    if any(t < 0 or t >= vocab for t in prompt):
        raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
    return list(prompt)

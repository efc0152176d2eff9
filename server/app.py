"""The OpenAI-compatible HTTP front end.

    app = create_app(loaded_model, ServerConfig(served_model_name="demo"))

Routes stay thin: validate (pydantic + a few checks), render the prompt, then
`engine.submit` -> iterate the handle -> `cancel` on every exit path (a client
that goes away frees its engine slot within one round). Errors leave through
`errors.py` as OpenAI error objects.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import AsyncIterator, List, Optional

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from mtp_serve.engine.engine_loop import EngineError, EngineLoop, EngineStopped, QueueFull, RequestHandle
from mtp_serve.engine.policy import DepthPolicy
from mtp_serve.engine.prompt_cache import PromptCache
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.server.chat import ChatFormat, ChatPrompt, hf_tokenizer
from mtp_serve.server.errors import APIError, bad_request, error_body, install_error_handlers
from mtp_serve.server.metrics import Metrics
from mtp_serve.server.parsers import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallStart, collect
from mtp_serve.server.schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("mtp_serve.server")

SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: Optional[str] = None
    max_context: Optional[int] = None  # None: the model's max_position_embeddings
    max_queue: int = 64
    max_active: int = 8  # --max-batch-size
    prefill_chunk: int = 512
    mtp_depth: int = 0  # most drafts per round (the policy picks up to it per row); 0 = MTP off
    fixed_depth: bool = False  # draft exactly mtp_depth every round instead
    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"
    chat_template: Optional[str] = None  # a file or template text overriding the checkpoint's
    ping_seconds: float = 15.0  # SSE keep-alive comment interval
    prompt_cache_entries: int = 16
    prompt_cache_bytes: int = 4 << 30
    sampling_defaults: dict = field(default_factory=dict)  # from generation_config.json


def model_max_context(config: dict) -> int:
    text = config.get("text_config", config)
    return int(text.get("max_position_embeddings") or config.get("max_position_embeddings") or 32768)


def generation_defaults(path) -> dict:
    """Sampling defaults from the checkpoint's generation_config.json (as vLLM uses them)."""
    try:
        gen = json.loads((path / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: gen[k] for k in SAMPLING_DEFAULT_KEYS if isinstance(gen.get(k), (int, float))}


class Service:
    """Everything the routes share: model, engine, chat format, metrics, config."""

    def __init__(self, loaded, config: ServerConfig, engine_factory=EngineLoop):
        self.loaded = loaded
        self.config = config
        self.max_context = config.max_context or model_max_context(loaded.config)
        self.tokenizer = hf_tokenizer(loaded.tokenizer)
        self.chat = ChatFormat(loaded.tokenizer, loaded.card, chat_template=config.chat_template,
                               tool_parser=config.tool_call_parser, reasoning_parser=config.reasoning_parser)
        self.engine = engine_factory(loaded.model, loaded.tokenizer, max_queue=config.max_queue, max_active=config.max_active,
                                 prefill_chunk=config.prefill_chunk,
                                 prompt_cache=PromptCache(config.prompt_cache_entries, config.prompt_cache_bytes),
                                 policy=DepthPolicy(max_depth=config.mtp_depth, fixed=config.fixed_depth))
        self.metrics = Metrics(self.engine)
        # One thread renders and tokenizes prompts: off the event loop, never concurrent.
        self.cpu = ThreadPoolExecutor(1, thread_name_prefix="mtp-tokenize")
        self.created = int(time.time())

    # -- checks

    def check_model(self, name: Optional[str]) -> None:
        if name and name not in (self.config.served_model_name, str(self.loaded.path)):
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.config.served_model_name}'",
                           param="model", code="model_not_found")

    def check_context(self, n_prompt: int, param: str) -> int:
        """Returns the room left for the completion."""
        if n_prompt >= self.max_context:
            raise bad_request(f"This model's maximum context length is {self.max_context} tokens; the prompt has {n_prompt} tokens",
                              param, "context_length_exceeded")
        if n_prompt == 0:
            raise bad_request("the prompt is empty", param)
        return self.max_context - n_prompt

    def sampling(self, req, max_tokens: Optional[int], room: int, logprobs: Optional[int]) -> SamplingParams:
        d = self.config.sampling_defaults
        pick = lambda k, fallback: getattr(req, k) if getattr(req, k) is not None else d.get(k, fallback)  # noqa: E731
        top_k = pick("top_k", 0)
        try:
            return SamplingParams(
                temperature=float(pick("temperature", 1.0)),
                top_p=float(pick("top_p", 1.0)),
                top_k=0 if top_k in (None, -1) else int(top_k),
                min_p=float(pick("min_p", 0.0)),
                presence_penalty=float(pick("presence_penalty", 0.0)),
                frequency_penalty=float(pick("frequency_penalty", 0.0)),
                repetition_penalty=float(pick("repetition_penalty", 1.0)),
                seed=req.seed,
                max_tokens=min(max_tokens, room) if max_tokens else room,
                stop=req.stop_list,
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
            )
        except ValueError as e:
            raise bad_request(str(e)) from e

    def depth(self, req) -> int:
        return req.mtp_depth if req.mtp_depth is not None else self.config.mtp_depth

    def submit(self, ids: List[int], params: SamplingParams, depth: int, checkpoints: tuple = ()) -> RequestHandle:
        try:
            return self.engine.submit(ids, params, depth, checkpoints)
        except QueueFull as e:
            raise APIError(429, f"{e}; retry shortly", code="queue_full", headers={"Retry-After": "1"}) from e
        except EngineStopped as e:
            raise APIError(503, str(e), code="engine_stopped", headers={"Retry-After": "5"}) from e

    async def run_cpu(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.cpu, fn, *args)

    # -- token text, for logprobs

    @lru_cache(maxsize=65536)
    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def chat_logprobs(self, lps) -> dict:
        def entry(t, lp):
            s = self.token_text(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

        return {"content": [{**entry(x.token, x.logprob), "top_logprobs": [entry(t, lp) for t, lp in x.top]} for x in lps]}

    def completion_logprobs(self, lps, offset: int) -> dict:
        tokens, offsets = [], []
        for x in lps:
            s = self.token_text(x.token)
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
        return {
            "tokens": tokens,
            "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [{self.token_text(t): lp for t, lp in x.top} for x in lps],
            "text_offset": offsets,
        }


def usage(stats, n_prompt: int) -> dict:
    s = stats.as_dict() if stats is not None else {}
    completion = stats.generated_tokens if stats is not None else 0
    return {
        "prompt_tokens": n_prompt,
        "completion_tokens": completion,
        "total_tokens": n_prompt + completion,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens if stats is not None else 0},
        "speculative": {k: s.get(k) for k in ("depth", "drafted", "accepted", "acceptance_rate",
                                               "drafted_per_position", "accepted_per_position", "tokens_per_pass")},
    }


class Timing:
    """Time to first token and inter-token latency, as the client sees them."""

    def __init__(self, metrics: Metrics, start: float):
        self.metrics, self.start, self.last = metrics, start, None

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            for _ in range(n):
                self.metrics.itl.observe((now - self.last) / n)
        self.last = now


async def engine_chunks(svc: Service, handle: RequestHandle, request: Request, timing: Timing, watch_disconnect: bool) -> AsyncIterator:
    """The handle's chunks; cancels the request on any exit (disconnect, error, early return)."""

    async def watch():
        while not handle.finished:
            await asyncio.sleep(0.2)
            if await request.is_disconnected():
                log.info("request %d: client disconnected, cancelling", handle.id)
                handle.cancel()
                return

    watcher = asyncio.create_task(watch()) if watch_disconnect else None
    try:
        async for chunk in handle:
            timing.tokens(len(chunk.token_ids))
            yield chunk
            if chunk.finish_reason:
                svc.metrics.finished(chunk.stats)
    finally:
        if watcher is not None:
            watcher.cancel()
        handle.cancel()


def engine_error(e: Exception):
    """(status, error body) for a request the engine failed: 503 when the engine
    stopped under it (shutting down, or a lost rank), 500 otherwise."""
    if isinstance(e, EngineStopped):
        return 503, error_body(str(e), "service_unavailable", code="engine_stopped")
    return 500, error_body(str(e), "server_error")


def engine_failure(svc: Service, path: str, e: Exception) -> JSONResponse:
    status, body = engine_error(e)
    svc.metrics.request(path, status)
    return JSONResponse(body, status_code=status, headers={"Retry-After": "5"} if status == 503 else None)


def _event_delta(ev) -> dict:
    if isinstance(ev, ReasoningDelta):
        return {"reasoning_content": ev.text}
    if isinstance(ev, ContentDelta):
        return {"content": ev.text}
    if isinstance(ev, ToolCallStart):
        return {"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function", "function": {"name": ev.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]}


def _keep_event(ev, parallel: bool) -> bool:
    return parallel or not isinstance(ev, (ToolCallStart, ToolCallArgsDelta)) or ev.index == 0


def create_app(loaded, config: ServerConfig, engine_factory=EngineLoop) -> FastAPI:
    """`engine_factory` builds the engine (with EngineLoop's arguments); serving
    across ranks passes a `DistributedEngine`."""
    svc = Service(loaded, config, engine_factory)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        svc.engine.start()
        try:
            yield
        finally:
            svc.engine.stop()
            svc.cpu.shutdown(wait=False)

    app = FastAPI(title="mtp-serve", lifespan=lifespan)
    app.state.service = svc
    install_error_handlers(app, on_error=lambda request, status: svc.metrics.request(request.url.path, status))

    async def auth(request: Request) -> None:
        if not config.api_key:
            return
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if token != config.api_key:
            raise APIError(401, "Invalid or missing API key" + ("" if header else ": send 'Authorization: Bearer <key>'"),
                           type="invalid_request_error", code="invalid_api_key")

    @app.get("/health")
    async def health():
        if not svc.engine.running:
            return JSONResponse(error_body("engine is not running", "service_unavailable"), status_code=503)
        return {"status": "ok", "model": config.served_model_name, "mtp": loaded.mtp_status,
                "queue_depth": svc.engine.queue_depth, "active": svc.engine.active_count}

    @app.get("/metrics")
    async def metrics():
        return Response(svc.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict:
        return {"id": config.served_model_name, "object": "model", "created": svc.created, "owned_by": "mtp-serve",
                "root": str(loaded.path), "max_model_len": svc.max_context}

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(auth)])
    async def get_model(model_id: str):
        svc.check_model(model_id)
        return model_card()

    # ------------------------------------------------------------ chat

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)])
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        start = time.perf_counter()
        svc.check_model(req.model)
        if req.n != 1:
            raise bad_request("n must be 1: this server returns one choice per request", "n")
        if req.response_format is not None and req.response_format.type != "text":
            raise bad_request(f"response_format type {req.response_format.type!r} is not supported (only 'text')", "response_format")
        prompt: ChatPrompt = await svc.run_cpu(svc.chat.render, req)
        room = svc.check_context(len(prompt.ids), "messages")
        top = (req.top_logprobs or 0) if req.logprobs else None
        params = svc.sampling(req, req.max_completion_tokens or req.max_tokens, room, top)
        handle = svc.submit(prompt.ids, params, svc.depth(req), prompt.checkpoints)
        rid, created, timing = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), Timing(svc.metrics, start)
        path = request.url.path
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventSourceResponse(
                sse_guard(chat_stream(handle, request, prompt, req, rid, created, timing, include_usage), path),
                ping=config.ping_seconds, sep="\n")

        text, lps, finish, stats = [], [], None, None
        try:
            async for chunk in engine_chunks(svc, handle, request, timing, watch_disconnect=True):
                text.append(chunk.text)
                lps += chunk.logprobs or []
                finish, stats = chunk.finish_reason, chunk.stats
        except (EngineError, EngineStopped) as e:
            return engine_failure(svc, path, e)
        if finish is None:  # cancelled: the client is gone
            svc.metrics.request(path, 499)
            return Response(status_code=499)
        parser = svc.chat.output_parser(prompt, streaming=False)
        events = parser.feed(prompt.forced + "".join(text)) + parser.finish()
        parsed = collect([e for e in events if _keep_event(e, req.parallel_tool_calls)])
        message = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning is not None:
            message["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
            if finish == "stop":
                finish = "tool_calls"
        svc.metrics.request(path, 200)
        return {
            "id": rid, "object": "chat.completion", "created": created, "model": config.served_model_name,
            "choices": [{"index": 0, "message": message, "logprobs": svc.chat_logprobs(lps) if top is not None else None,
                         "finish_reason": finish}],
            "usage": usage(stats, len(prompt.ids)),
        }

    async def chat_stream(handle, request, prompt: ChatPrompt, req, rid, created, timing, include_usage):
        def chunk(delta: Optional[dict], finish=None, logprobs=None, usage_=None) -> dict:
            body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": config.served_model_name,
                    "choices": [] if delta is None else [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
            if include_usage:
                body["usage"] = usage_
            return {"data": json.dumps(body, ensure_ascii=False)}

        parser = svc.chat.output_parser(prompt, streaming=True)
        parallel = req.parallel_tool_calls
        yield chunk({"role": "assistant", "content": ""})
        for ev in parser.feed(prompt.forced):
            if _keep_event(ev, parallel):
                yield chunk(_event_delta(ev))
        async for c in engine_chunks(svc, handle, request, timing, watch_disconnect=False):
            events = parser.feed(c.text)
            if c.finish_reason:
                events += parser.finish()
            deltas = [_event_delta(ev) for ev in events if _keep_event(ev, parallel)]
            lp = svc.chat_logprobs(c.logprobs) if c.logprobs else None
            if lp is not None and not deltas:
                deltas = [{}]
            for i, d in enumerate(deltas):
                yield chunk(d, logprobs=lp if i == 0 else None)
            if c.finish_reason:
                finish = "tool_calls" if (parser.has_tool_calls and c.finish_reason == "stop") else c.finish_reason
                yield chunk({}, finish=finish)
                if include_usage:
                    yield chunk(None, usage_=usage(c.stats, len(prompt.ids)))

    # ------------------------------------------------------------ completions

    @app.post("/v1/completions", dependencies=[Depends(auth)])
    async def completions(req: CompletionRequest, request: Request):
        start = time.perf_counter()
        svc.check_model(req.model)
        if req.n != 1:
            raise bad_request("n must be 1: this server returns one choice per request", "n")
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        ids = await svc.run_cpu(completion_prompt_ids, svc.tokenizer, req.prompt, loaded.model.vocab_size)
        room = svc.check_context(len(ids), "prompt")
        params = svc.sampling(req, req.max_tokens, room, req.logprobs)
        handle = svc.submit(ids, params, svc.depth(req))
        rid, created, timing = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time()), Timing(svc.metrics, start)
        echo = svc.tokenizer.decode(ids) if req.echo else ""
        path = request.url.path
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventSourceResponse(sse_guard(completion_stream(handle, request, ids, req, rid, created, timing, include_usage, echo), path),
                                       ping=config.ping_seconds, sep="\n")
        text, lps, finish, stats = [echo], [], None, None
        try:
            async for chunk in engine_chunks(svc, handle, request, timing, watch_disconnect=True):
                text.append(chunk.text)
                lps += chunk.logprobs or []
                finish, stats = chunk.finish_reason, chunk.stats
        except (EngineError, EngineStopped) as e:
            return engine_failure(svc, path, e)
        if finish is None:
            svc.metrics.request(path, 499)
            return Response(status_code=499)
        svc.metrics.request(path, 200)
        return {
            "id": rid, "object": "text_completion", "created": created, "model": config.served_model_name,
            "choices": [{"index": 0, "text": "".join(text), "finish_reason": finish,
                         "logprobs": svc.completion_logprobs(lps, len(echo)) if req.logprobs is not None else None}],
            "usage": usage(stats, len(ids)),
        }

    async def completion_stream(handle, request, ids, req, rid, created, timing, include_usage, echo):
        def chunk(text: Optional[str], finish=None, logprobs=None, usage_=None) -> dict:
            body = {"id": rid, "object": "text_completion", "created": created, "model": config.served_model_name,
                    "choices": [] if text is None else [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
            if include_usage:
                body["usage"] = usage_
            return {"data": json.dumps(body, ensure_ascii=False)}

        offset = len(echo)
        if echo:
            yield chunk(echo)
        async for c in engine_chunks(svc, handle, request, timing, watch_disconnect=False):
            lp = svc.completion_logprobs(c.logprobs, offset) if c.logprobs else None
            offset += len(c.text)
            if c.text or lp is not None:
                yield chunk(c.text, logprobs=lp)
            if c.finish_reason:
                yield chunk("", finish=c.finish_reason)
                if include_usage:
                    yield chunk(None, usage_=usage(c.stats, len(ids)))

    async def sse_guard(events, path: str):
        """Ends every stream with [DONE]; an engine error becomes an error event; metrics by outcome."""
        status = 200
        try:
            async for event in events:
                yield event
            yield {"data": "[DONE]"}
        except (EngineError, EngineStopped) as e:
            status, body = engine_error(e)
            yield {"data": json.dumps(body)}
            yield {"data": "[DONE]"}
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            svc.metrics.request(path, status)

    return app


def completion_prompt_ids(tokenizer, prompt, vocab: int) -> List[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=False)
    if prompt and all(isinstance(t, int) for t in prompt):
        if any(t < 0 or t >= vocab for t in prompt):
            raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
        return list(prompt)
    if len(prompt) != 1:
        raise bad_request("exactly one prompt per request (batched prompts are not supported)", "prompt")
    return completion_prompt_ids(tokenizer, prompt[0], vocab)

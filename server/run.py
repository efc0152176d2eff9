"""One request running on the engine, whatever API it came in through.

    run = svc.start(request, prompt, req, max_tokens=n, options=Options(...))  # 400 / 429 / 503 before any output
    done = await run.complete()               # non-streamed: text, parsed output, finish, usage, report
    return run.respond(body(done))            # ... its body, counted once in the metrics
    async for step in run.steps(): ...        # streamed: the parser's events for each engine chunk

An adapter only translates: its wire request into `svc.start`'s arguments, and a
`Completion` or the `Step`s into its wire body or events.

Every exit path cancels the engine request (a client that goes away frees its
slot within one round). A non-streamed request whose client left raises
`ClientGone` (answered 499); engine failures raise EngineError / EngineStopped,
which `errors.py` answers in the API's own error shape.

The reasoning budget (`Options.reasoning_budget`) runs one request as two engine
requests: the first stops after the budget; when the reasoning is still open
then, the run writes the think block's end itself and a second request goes on
from everything so far (the prompt cache holds the first one's state) with the
tokens left. Both together never pass the request's max_tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, AsyncIterator, List, Optional

from mtp_serve.engine.engine_loop import EngineError, RequestHandle
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.server import structured
from mtp_serve.server.chat import ChatPrompt
from mtp_serve.server.errors import APIError, ClientGone
from mtp_serve.server.parsers import ContentDelta, Event, OutputParser, ParsedOutput, ToolCallArgsDelta, ToolCallStart, collect

if TYPE_CHECKING:
    from mtp_serve.server.service import Service

log = logging.getLogger("mtp_serve.server")

THINK_CLOSE = "\n</think>\n\n"
REASONING_ENDS = ("</think>", "<tool_call>")  # what ends reasoning (see parsers/reasoning.py)
SPECULATIVE_KEYS = ("depth", "drafted", "accepted", "acceptance_rate", "drafted_per_position", "accepted_per_position",
                    "copy_drafted", "copy_accepted", "forced_drafted", "forced_accepted", "tokens_per_pass")


@dataclass
class Options:
    """How an adapter wants its request run, beside the sampling fields."""

    parallel_tool_calls: bool = True  # off: only the first tool call goes out
    reasoning_budget: Optional[int] = None  # reasoning tokens before the run closes the think block
    parse: bool = True  # parse reasoning and tool calls out of the text (not for raw completions)
    prompt_param: str = "messages"  # the wire names 400s point at
    max_tokens_param: str = "max_tokens"


@dataclass
class Usage:
    """One request's token counts and MTP figures; each API names them its own way."""

    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    speculative: dict  # the MTP figures (SPECULATIVE_KEYS), an extra field of every API's usage
    note: dict  # {"max_tokens_lowered": {"requested", "granted"}} when the budget was lowered, else {}
    image_tokens: int = 0  # prompt tokens that are image embeddings (part of prompt_tokens)

    @classmethod
    def of(cls, stats, n_prompt: int, note: Optional[dict] = None, image_tokens: int = 0) -> "Usage":
        s = stats.as_dict() if stats is not None else {}
        return cls(n_prompt, stats.cached_tokens if stats is not None else 0, stats.generated_tokens if stats is not None else 0,
                   {k: s.get(k) for k in SPECULATIVE_KEYS}, note or {}, image_tokens)


@dataclass
class Completion:
    """A finished non-streamed run."""

    text: str
    token_ids: List[int]
    logprobs: list
    finish_reason: str  # "stop", "length", or "tool_calls" (the output ended in tool calls)
    parsed: ParsedOutput  # reasoning, content, tool calls (content = text when not parsed)
    usage: Usage
    report: Optional[dict]  # the structured_output report, when the constraint came from JSON schemas
    stats: object  # the engine's DecodeStats


@dataclass
class Step:
    """One step of a streamed run: the parser's events for one engine chunk."""

    events: List[Event]
    chunk: Optional[object] = None  # the GenerationChunk
    finish_reason: Optional[str] = None  # on the last step: "stop", "length" or "tool_calls"
    usage: Optional[Usage] = None  # on the last step
    report: Optional[dict] = None  # on the last step, when there is one


class Timing:
    """Time to first token and inter-token latency, as the client sees them."""

    def __init__(self, metrics, start: float):
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


@dataclass
class Run:
    """A request on the engine. `Service.start` checks it, builds it (no side effects) and
    submits it (`submit`)."""

    service: "Service"  # the model's: its engine, chat format (output parser), tokenizer and metrics
    prompt: ChatPrompt  # ids, prompt-cache checkpoints, output constraint, parser configuration
    params: SamplingParams
    depth: int  # MTP drafts per round
    options: Options
    request: object  # the starlette Request: its scope (metrics) and disconnects
    started: float = field(default_factory=time.perf_counter)
    lowered_from: Optional[int] = None  # the client's max_tokens, when it was lowered to fit the context
    token_ids: List[int] = field(default_factory=list)  # the output so far
    text: str = ""
    handle: Optional[RequestHandle] = None

    def submit(self) -> "Run":
        """Put the first engine request in the queue (up to the reasoning budget when one applies);
        a full queue or a stopped engine raises its APIError here, before any output."""
        first = replace(self.params, max_tokens=self.options.reasoning_budget) if self._budget_applies else self.params
        self.handle = self.service.submit_ids(self.prompt.ids, first, self.depth, self.prompt.checkpoints,
                                              images=self.prompt.images)
        return self

    @property
    def metrics(self):
        return self.service.metrics

    @property
    def _budget_applies(self) -> bool:
        budget = self.options.reasoning_budget
        return budget is not None and self.prompt.opens_reasoning and budget < self.params.max_tokens

    @property
    def note(self) -> dict:
        if self.lowered_from is None:
            return {}
        return {"max_tokens_lowered": {"requested": self.lowered_from, "granted": self.params.max_tokens}}

    def usage(self, stats) -> Usage:
        return Usage.of(stats, len(self.prompt.ids), self.note, self.prompt.image_tokens)

    # -- the engine's chunks

    async def chunks(self, watch_disconnect: bool = False) -> AsyncIterator:
        """The engine's chunks; cancels the request on any exit (disconnect, error, early
        return). Streams notice a disconnect when their send fails; a non-streamed request
        has nothing to send, so it polls (`watch_disconnect`)."""
        timing = Timing(self.metrics, self.started)
        watcher = asyncio.create_task(self._watch()) if watch_disconnect else None
        try:
            async for chunk in self.handle:
                self._took(chunk, timing)
                if chunk.finish_reason and self._budget_applies:  # the budget's end: the second request decides
                    async for more in self._past_the_budget(chunk, timing):
                        yield more
                    return
                yield chunk
                if chunk.finish_reason:
                    self._finished(chunk)
        finally:
            if watcher is not None:
                watcher.cancel()
            self.handle.cancel()

    async def _past_the_budget(self, first, timing: Timing) -> AsyncIterator:
        """After the first engine request stopped at the reasoning budget: close the think block
        (unless the reasoning ended already) and go on with a second engine request from
        everything so far, with the tokens left; its chunks, the last one with both requests' stats."""
        close = "" if any(tag in self.text for tag in REASONING_ENDS) else THINK_CLOSE
        close_ids = self.service.encode(close) if close else []
        left = self.params.max_tokens - len(self.token_ids) - len(close_ids)
        if first.finish_reason != "length" or left <= 0:  # ended in the budget, or no room to go on
            yield first
            self._finished(first)
            return
        yield replace(first, finish_reason=None)
        if close:
            yield replace(first, token_ids=close_ids, text=close, logprobs=None, finish_reason=None)
            self.token_ids += close_ids
            self.text += close
        try:
            # The reasoning is closed: an output constraint applies from the first token on.
            params = replace(self.params, max_tokens=left, constraint=self.prompt.constraint)
            self.handle = self.service.submit_ids(self.prompt.ids + self.token_ids, params, self.depth, (),
                                                  images=self.prompt.images)
        except APIError as e:  # queue full or engine stopped, mid-response: the engine failed this request
            raise EngineError(e.message) from e
        async for chunk in self.handle:
            self._took(chunk, timing)
            if chunk.finish_reason:
                chunk = replace(chunk, stats=merge_stats(first.stats, chunk.stats, len(close_ids)))
                self._finished(chunk)
            yield chunk

    async def _watch(self) -> None:
        while not self.handle.finished:
            await asyncio.sleep(0.2)
            if await self.request.is_disconnected():
                log.info("request %d: client disconnected, cancelling", self.handle.id)
                self.handle.cancel()
                return

    def _took(self, chunk, timing: Timing) -> None:
        timing.tokens(len(chunk.token_ids))
        self.token_ids += chunk.token_ids
        self.text += chunk.text

    def _finished(self, chunk) -> None:
        """Per-request totals: metrics and one log line."""
        st = chunk.stats
        self.metrics.finished(st)
        images = self.prompt.images
        log.info("request %d: %d prompt tokens (%d cached%s), %d generated, finish %s, MTP depth %d acceptance %.2f",
                 self.handle.id, st.prompt_tokens, st.cached_tokens,
                 f"; {len(images)} image{'s' if len(images) > 1 else ''}, {self.prompt.image_tokens} image tokens" if images else "",
                 st.generated_tokens, chunk.finish_reason, st.depth, st.acceptance_rate)

    # -- parsed output

    def _parser(self) -> Optional[OutputParser]:
        return self.service.chat.output_parser(self.prompt) if self.options.parse else None

    def _keep(self, events: List[Event]) -> List[Event]:
        """With parallel_tool_calls off only the first call goes out."""
        if self.options.parallel_tool_calls:
            return events
        return [e for e in events if not isinstance(e, (ToolCallStart, ToolCallArgsDelta)) or e.index == 0]

    def _finish(self, engine_reason: str, tool_calls: bool) -> str:
        """The engine's "stop" becomes "tool_calls" when the output ended in tool calls."""
        return "tool_calls" if tool_calls and engine_reason == "stop" else engine_reason

    def _report(self, parsed: ParsedOutput, engine_reason: str) -> Optional[dict]:
        return structured.output_report(self.prompt.constraint, parsed.content, parsed.tool_calls,
                                        "length" if engine_reason == "length" else "stop")

    async def complete(self) -> Completion:
        """The whole output (the shared collect loop of every non-streamed response)."""
        lps, finish, stats = [], None, None
        async for chunk in self.chunks(watch_disconnect=True):
            lps += chunk.logprobs or []
            finish, stats = chunk.finish_reason, chunk.stats
        if finish is None:  # cancelled: the client is gone
            raise ClientGone()
        parser = self._parser()
        if parser is None:
            parsed = ParsedOutput(None, self.text, [])
        else:
            parsed = collect(self._keep(parser.feed(self.text) + parser.finish()))
        return Completion(self.text, list(self.token_ids), lps, self._finish(finish, bool(parsed.tool_calls)), parsed,
                          self.usage(stats), self._report(parsed, finish), stats)

    async def steps(self) -> AsyncIterator[Step]:
        """The streamed output: one step per engine chunk, the last one with finish, usage and report."""
        parser = self._parser()
        events_so_far: List[Event] = []
        async for chunk in self.chunks():
            events = parser.feed(chunk.text) if parser is not None else ([ContentDelta(chunk.text)] if chunk.text else [])
            if not chunk.finish_reason:
                events = self._keep(events)
                events_so_far += events
                yield Step(events, chunk)
                continue
            events = self._keep(events + (parser.finish() if parser is not None else []))
            parsed = collect(events_so_far + events)
            yield Step(events, chunk, self._finish(chunk.finish_reason, bool(parsed.tool_calls)), self.usage(chunk.stats),
                       self._report(parsed, chunk.finish_reason))

    def respond(self, body: dict, report: Optional[dict] = None):
        """The run's non-streamed body (streams are counted in streaming.py)."""
        return respond(self.metrics, self.request.scope, body, report)


def respond(metrics, scope, body: dict, report: Optional[dict] = None):
    """A non-streamed 200 body (with its structured_output report), counted once in the metrics."""
    metrics.request(scope, 200)
    return structured.respond(body, report)


def merge_stats(first, second, inserted: int):
    """One request's stats from its two engine requests (the prompt is the first one's)."""
    n = max(len(first.drafted), len(second.drafted))
    pad = lambda xs: list(xs) + [0] * (n - len(xs))  # noqa: E731
    return replace(
        second,
        prompt_tokens=first.prompt_tokens,
        cached_tokens=first.cached_tokens,
        generated_tokens=first.generated_tokens + inserted + second.generated_tokens,
        backbone_passes=first.backbone_passes + second.backbone_passes,
        drafted=[a + b for a, b in zip(pad(first.drafted), pad(second.drafted))],
        accepted=[a + b for a, b in zip(pad(first.accepted), pad(second.accepted))],
        **{k: getattr(first, k) + getattr(second, k) for k in ("copy_drafted", "copy_accepted", "forced_drafted",
                                                               "forced_accepted")},
        prefill_s=first.prefill_s + second.prefill_s,
        decode_s=first.decode_s + second.decode_s,
    )

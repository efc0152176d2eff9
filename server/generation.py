"""The internal request model every API adapts to, and the one way to run it.

    gen = svc.generation(prompt, sampling, started=t0, prompt_param="messages")
    handle = svc.submit(gen)                                  # 429 / 503 before any output
    done = await complete(svc, gen, handle, request)          # non-streamed: the whole output
    async for step in stream_steps(svc, gen, handle, request): ...   # streamed: parser events per chunk

Both iterate the engine handle through `engine_chunks`, which cancels the
request on every exit path (a client that goes away frees its engine slot
within one round). A non-streamed request whose client left raises
`ClientGone` (answered 499); engine failures raise EngineError / EngineStopped,
which `errors.py` answers in the API's own error shape.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, AsyncIterator, List, Optional

from mtp_serve.engine.engine_loop import EngineError, RequestHandle
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.server.chat import ChatPrompt
from mtp_serve.server.errors import APIError, ClientGone
from mtp_serve.server.parsers import Event, ParsedOutput, ToolCallArgsDelta, ToolCallStart, collect

if TYPE_CHECKING:
    from mtp_serve.server.service import Service

log = logging.getLogger("mtp_serve.server")


@dataclass
class Generation:
    """One request to the engine, whatever API it came in through."""

    prompt: ChatPrompt  # ids, prompt-cache checkpoints, output constraint, parser configuration
    params: SamplingParams
    depth: int  # MTP drafts per round
    parallel_tool_calls: bool = True
    started: float = field(default_factory=time.perf_counter)  # when the request arrived
    reasoning_budget: Optional[int] = None  # tokens of reasoning before the server closes the think block
    max_tokens_lowered_from: Optional[int] = None  # the client's max_tokens, when it was lowered to fit the context

    @property
    def budget_note(self) -> dict:
        """Usage's note on a lowered output budget (every API adds it to its usage); {} when none."""
        if self.max_tokens_lowered_from is None:
            return {}
        return {"max_tokens_lowered": {"requested": self.max_tokens_lowered_from, "granted": self.params.max_tokens}}

    @property
    def first_params(self) -> SamplingParams:
        """What the first engine request runs with: a reasoning budget stops it early."""
        if self.budget_applies:
            return replace(self.params, max_tokens=self.reasoning_budget)
        return self.params

    @property
    def budget_applies(self) -> bool:
        return (self.reasoning_budget is not None and self.prompt.opens_reasoning
                and self.reasoning_budget < self.params.max_tokens)


@dataclass
class Completion:
    """A finished non-streamed generation."""

    text: str
    token_ids: List[int]
    logprobs: list
    finish_reason: str
    stats: object  # the engine's DecodeStats


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


THINK_CLOSE = "\n</think>\n\n"
REASONING_ENDS = ("</think>", "<tool_call>")  # what ends reasoning (see parsers/reasoning.py)


async def engine_chunks(svc: "Service", gen: Generation, handle: RequestHandle, request, watch_disconnect: bool) -> AsyncIterator:
    """The generation's chunks; cancels the request on any exit (disconnect, error, early return).

    Streams notice a disconnect when their send fails; a non-streamed request
    has nothing to send, so it polls (`watch_disconnect`).

    A reasoning budget runs the generation in two engine requests: the first
    stops after `reasoning_budget` tokens; when the reasoning is still open
    then, the server writes the think block's end (a chunk of its own) and a
    second request continues from everything so far (the prompt cache holds
    the first one's state) with the tokens left."""
    timing = Timing(svc.metrics, gen.started)
    current = [handle]

    async def watch():
        while not current[0].finished:
            await asyncio.sleep(0.2)
            if await request.is_disconnected():
                log.info("request %d: client disconnected, cancelling", current[0].id)
                current[0].cancel()
                return

    watcher = asyncio.create_task(watch()) if watch_disconnect else None
    try:
        first = None
        ids, text = [], []
        async for chunk in handle:
            timing.tokens(len(chunk.token_ids))
            ids += chunk.token_ids
            text.append(chunk.text)
            if chunk.finish_reason and gen.budget_applies:
                first = chunk  # the budget's end: decided below
                break
            yield chunk
            if chunk.finish_reason:
                finished(svc, handle, chunk)
        if first is None:
            return
        left = gen.params.max_tokens - len(ids)
        if first.finish_reason != "length" or left <= 0:
            yield first
            finished(svc, handle, first)
            return
        close = "" if any(tag in "".join(text) for tag in REASONING_ENDS) else THINK_CLOSE
        close_ids = svc.tokenizer.encode(close, add_special_tokens=False) if close else []
        yield replace(first, finish_reason=None)
        if close:
            yield replace(first, token_ids=close_ids, text=close, logprobs=None, finish_reason=None)
        rest = max(1, left - len(close_ids))
        try:
            # The reasoning is closed: an output constraint applies from the first token on.
            params = replace(gen.params, max_tokens=rest, constraint=gen.prompt.constraint)
            second = svc.submit_ids(gen.prompt.ids + ids + close_ids, params, gen.depth)
        except APIError as e:  # queue full or engine stopped, mid-response: the engine failed this request
            raise EngineError(e.message) from e
        current[0] = second
        async for chunk in second:
            timing.tokens(len(chunk.token_ids))
            if chunk.finish_reason:
                chunk = replace(chunk, stats=merge_stats(first.stats, chunk.stats, len(close_ids)))
                finished(svc, handle, chunk)
            yield chunk
    finally:
        if watcher is not None:
            watcher.cancel()
        current[0].cancel()
        handle.cancel()


def finished(svc: "Service", handle: RequestHandle, chunk) -> None:
    """Per-request totals: metrics and one log line."""
    st = chunk.stats
    svc.metrics.finished(st)
    log.info("request %d: %d prompt tokens (%d cached), %d generated, finish %s, MTP depth %d acceptance %.2f",
             handle.id, st.prompt_tokens, st.cached_tokens, st.generated_tokens, chunk.finish_reason, st.depth, st.acceptance_rate)


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
        prefill_s=first.prefill_s + second.prefill_s,
        decode_s=first.decode_s + second.decode_s,
    )


async def complete(svc: "Service", gen: Generation, handle: RequestHandle, request) -> Completion:
    """The shared collect loop of every non-streamed response."""
    text, ids, lps, finish, stats = [], [], [], None, None
    async for chunk in engine_chunks(svc, gen, handle, request, watch_disconnect=True):
        text.append(chunk.text)
        ids += chunk.token_ids
        lps += chunk.logprobs or []
        finish, stats = chunk.finish_reason, chunk.stats
    if finish is None:  # cancelled: the client is gone
        raise ClientGone()
    return Completion("".join(text), ids, lps, finish, stats)


def keep_event(ev: Event, parallel: bool) -> bool:
    """With parallel_tool_calls off only the first call goes out."""
    return parallel or not isinstance(ev, (ToolCallStart, ToolCallArgsDelta)) or ev.index == 0


def parse_output(svc: "Service", gen: Generation, text: str) -> ParsedOutput:
    """A whole output as reasoning, content and tool calls."""
    parser = svc.chat.output_parser(gen.prompt)
    events = parser.feed(text) + parser.finish()
    return collect([e for e in events if keep_event(e, gen.parallel_tool_calls)])


def finish_reason(engine_reason: str, tool_calls: bool) -> str:
    """The engine's "stop" becomes "tool_calls" when the output ended in tool calls."""
    return "tool_calls" if tool_calls and engine_reason == "stop" else engine_reason


@dataclass
class Step:
    """One step of a streamed output: the parser's events for one engine chunk."""

    events: List[Event]
    chunk: Optional[object] = None  # the GenerationChunk
    finish_reason: Optional[str] = None  # on the last step: "stop", "length" or "tool_calls"


async def stream_steps(svc: "Service", gen: Generation, handle: RequestHandle, request) -> AsyncIterator[Step]:
    """The shared streaming loop: one step per engine chunk."""
    parser = svc.chat.output_parser(gen.prompt)
    keep = lambda evs: [e for e in evs if keep_event(e, gen.parallel_tool_calls)]  # noqa: E731
    async for chunk in engine_chunks(svc, gen, handle, request, watch_disconnect=False):
        events = parser.feed(chunk.text)
        finish = None
        if chunk.finish_reason:
            events += parser.finish()
            finish = finish_reason(chunk.finish_reason, parser.has_tool_calls)
        yield Step(keep(events), chunk, finish)

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, List, Optional

from mtp_serve.engine.engine_loop import RequestHandle
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.server.chat import ChatPrompt
from mtp_serve.server.errors import ClientGone
from mtp_serve.server.parsers import Event, ParsedOutput, ToolCallArgsDelta, ToolCallStart, collect

if TYPE_CHECKING:
    from mtp_serve.server.service import Service

log = logging.getLogger("mtp_serve.server")


@dataclass
class Generation:
    """One request to the engine, whatever API it came in through."""

    prompt: ChatPrompt  # ids, prompt-cache checkpoints, forced text, parser configuration
    params: SamplingParams
    depth: int  # MTP drafts per round
    parallel_tool_calls: bool = True
    started: float = field(default_factory=time.perf_counter)  # when the request arrived


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


async def engine_chunks(svc: "Service", gen: Generation, handle: RequestHandle, request, watch_disconnect: bool) -> AsyncIterator:
    """The handle's chunks; cancels the request on any exit (disconnect, error, early return).

    Streams notice a disconnect when their send fails; a non-streamed request
    has nothing to send, so it polls (`watch_disconnect`)."""
    timing = Timing(svc.metrics, gen.started)

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
    """A whole output (the forced prefix first) as reasoning, content and tool calls."""
    parser = svc.chat.output_parser(gen.prompt)
    events = parser.feed(gen.prompt.forced + text) + parser.finish()
    return collect([e for e in events if keep_event(e, gen.parallel_tool_calls)])


def finish_reason(engine_reason: str, tool_calls: bool) -> str:
    """The engine's "stop" becomes "tool_calls" when the output ended in tool calls."""
    return "tool_calls" if tool_calls and engine_reason == "stop" else engine_reason


@dataclass
class Step:
    """One step of a streamed output: the parser's events for one engine chunk."""

    events: List[Event]
    chunk: Optional[object] = None  # the GenerationChunk; None for the forced prefix
    finish_reason: Optional[str] = None  # on the last step: "stop", "length" or "tool_calls"


async def stream_steps(svc: "Service", gen: Generation, handle: RequestHandle, request) -> AsyncIterator[Step]:
    """The shared streaming loop: first the forced prefix's events, then one step per chunk."""
    parser = svc.chat.output_parser(gen.prompt)
    keep = lambda evs: [e for e in evs if keep_event(e, gen.parallel_tool_calls)]  # noqa: E731
    yield Step(keep(parser.feed(gen.prompt.forced)))
    async for chunk in engine_chunks(svc, gen, handle, request, watch_disconnect=False):
        events = parser.feed(chunk.text)
        finish = None
        if chunk.finish_reason:
            events += parser.finish()
            finish = finish_reason(chunk.finish_reason, parser.has_tool_calls)
        yield Step(keep(events), chunk, finish)

"""Server-sent events for every API: keep-alive, engine errors, metrics by outcome."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, List, Optional

from sse_starlette import EventSourceResponse

from mtp_serve.engine.engine_loop import EngineError, EngineStopped


def sse_response(svc, events: AsyncIterator[dict], path: str, *, on_error: Callable[[Exception], List[dict]],
                 done: Optional[dict] = None, ping: Optional[Callable[[], dict]] = None) -> EventSourceResponse:
    """`events` as an SSE response. An engine failure mid-stream becomes the API's own
    error events (`on_error`); `done` (e.g. OpenAI's `[DONE]`) ends every stream;
    `ping` makes the keep-alive an event (Anthropic's `ping`) instead of a comment."""

    async def guarded():
        status = 200
        try:
            async for event in events:
                yield event
        except (EngineError, EngineStopped) as e:
            status = 500
            for event in on_error(e):
                yield event
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            svc.metrics.request(path, status)
        if done is not None:
            yield done

    return EventSourceResponse(guarded(), ping=svc.config.ping_seconds, sep="\n",
                               ping_message_factory=ping)

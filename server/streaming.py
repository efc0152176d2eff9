"""Server-sent events for every API: keep-alive, engine errors, metrics by outcome."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, List, Optional

from sse_starlette import EventSourceResponse
from starlette.types import Scope

from mtp_serve.engine.engine_loop import ConstraintFailed, EngineError, EngineStopped
from mtp_serve.server.errors import internal_error


def sse_response(svc, events: AsyncIterator[dict], scope: Scope, *, on_error: Callable[[Exception], List[dict]],
                 done: Optional[dict] = None, ping: Optional[Callable[[], dict]] = None) -> EventSourceResponse:
    """`events` as an SSE response. A failure mid-stream becomes the API's own error
    events (`on_error`, given an exception whose message the client may read: the
    cause itself is logged, never sent); `done` (e.g. OpenAI's `[DONE]`) ends every
    stream; `ping` makes the keep-alive an event (Anthropic's `ping`) instead of a comment."""

    async def guarded():
        status = 200
        try:
            async for event in events:
                yield event
        except EngineStopped as e:
            status = 503
            for event in on_error(e):
                yield event
        except ConstraintFailed as e:  # the request's own grammar failed: its message is the client's
            status = 400
            for event in on_error(e):
                yield event
        except asyncio.CancelledError:
            status = 499
            raise
        except Exception as e:  # noqa: BLE001 - an engine failure, or a bug: the stream still ends in the API's shape
            status = 500
            for event in on_error(EngineError(internal_error(e, scope["path"]))):
                yield event
        finally:
            svc.metrics.request(scope, status)
        if done is not None:
            yield done

    return EventSourceResponse(guarded(), ping=svc.config.ping_seconds, sep="\n",
                               ping_message_factory=ping)

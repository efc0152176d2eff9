"""Stored Responses: retrieve (`GET /v1/responses/{id}`), delete, cancel, and background runs.

A stored response (`store`, the default) keeps its response object, as `GET` returns it, and the
conversation a later request continues with `previous_response_id`. A background response
(`background: true`) is answered at once with status `queued`; its generation runs on in the
server (`in_progress` from its first token) and ends `completed`, `incomplete`, `failed` or,
through `POST /v1/responses/{id}/cancel`, `cancelled`. The store is in memory and bounded: the
least recently used responses go first (a running one is cancelled).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from typing import Awaitable, Callable, List, Optional

from fastapi import APIRouter, Request

from mtp_serve.server.errors import APIError, bad_request

router = APIRouter()
STORE_ENTRIES = 512  # stored responses kept (least recently used go first)
RUNNING = ("queued", "in_progress")


@dataclass
class Stored:
    body: dict  # the response object, as GET returns it
    messages: Optional[List[dict]] = None  # the conversation a later request continues; None until it ends
    task: Optional[asyncio.Task] = None  # a background response's generation

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()


def not_found(rid: str) -> APIError:
    return APIError(404, f"Response with id '{rid}' not found.", type="invalid_request_error")


class ResponseStore:
    def __init__(self, entries: int = STORE_ENTRIES):
        self.entries = entries
        self._items: "OrderedDict[str, Stored]" = OrderedDict()

    def __contains__(self, rid: str) -> bool:
        return rid in self._items

    def conversation(self, rid: str) -> List[dict]:
        """The conversation `previous_response_id` continues."""
        entry = self._items.get(rid)
        if entry is None:
            raise APIError(404, f"Previous response with id '{rid}' not found.", param="previous_response_id",
                           code="previous_response_not_found", type="invalid_request_error")
        if entry.messages is None:
            raise bad_request(f"Previous response with id '{rid}' is still {entry.body['status']}: wait until it "
                              "completes", "previous_response_id")
        self._items.move_to_end(rid)
        return entry.messages

    def lookup(self, rid: str) -> Stored:
        entry = self._items.get(rid)
        if entry is None:
            raise not_found(rid)
        self._items.move_to_end(rid)
        return entry

    def put(self, rid: str, body: dict, messages: Optional[List[dict]] = None) -> Stored:
        entry = self._items.get(rid)
        if entry is None:
            entry = self._items[rid] = Stored(body)
        entry.body, entry.messages = body, messages
        self._items.move_to_end(rid)
        while len(self._items) > self.entries:
            _, old = self._items.popitem(last=False)
            if old.running:
                old.task.cancel()
        return entry

    def update(self, rid: str, **fields) -> None:
        """Change fields of a stored response's body (a background run's status), if it is still stored."""
        entry = self._items.get(rid)
        if entry is not None:
            entry.body = {**entry.body, **fields}

    def delete(self, rid: str) -> Stored:
        entry = self._items.pop(rid, None)
        if entry is None:
            raise not_found(rid)
        if entry.running:
            entry.task.cancel()
        return entry


def run_in_background(store: ResponseStore, rid: str, work: Awaitable, on_cancel: Callable[[], dict],
                      on_failure: Callable[[Exception], dict], release: Callable[[], None]) -> None:
    """Run `work` (which stores the finished response) as a task of stored response `rid`."""

    async def task():
        try:
            await work
        except asyncio.CancelledError:
            store.update(rid, **on_cancel())
        except Exception as e:  # noqa: BLE001 - an engine failure: the response says so
            store.update(rid, **on_failure(e))
        finally:
            release()

    store.lookup(rid).task = asyncio.get_running_loop().create_task(task())


def response_store(request: Request) -> ResponseStore:
    return request.app.state.response_store


@router.get("/v1/responses/{rid}")
async def retrieve(rid: str, request: Request, stream: bool = False):
    if stream:
        raise bad_request("streaming a stored response again (stream=true) is not supported; retrieve it without stream",
                          "stream")
    return response_store(request).lookup(rid).body


@router.delete("/v1/responses/{rid}")
async def delete(rid: str, request: Request):
    response_store(request).delete(rid)
    return {"id": rid, "object": "response", "deleted": True}


@router.post("/v1/responses/{rid}/cancel")
async def cancel(rid: str, request: Request):
    entry = response_store(request).lookup(rid)
    if not entry.body.get("background"):
        raise bad_request("Only responses created with background=true can be cancelled.")
    if entry.running:
        entry.task.cancel()
        await asyncio.wait([entry.task])
    return entry.body

"""Two lanes for preparing prompts (checking, rendering, tokenizing, fetching and decoding
images, compiling grammars), so that heavy requests wait behind their own kind:

    set_heavy(True)                          # in the request's task, before its preparation (limits.py)
    await lanes.run(fn, *args)               # on the lane the request was put on

A request is heavy when its body is large, or it has images or an output constraint
(limits.check_request decides). Each lane has its own threads (--tokenizer-threads each): a
trickling image URL or a wide schema can hold only heavy threads, never the small requests'.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from contextvars import ContextVar

# Grammar work (serving a schema, compiling a constraint) runs here, waited on within its
# budget: past it the request is refused then, the work goes on here and its result is dropped
# (llguidance cannot be interrupted; it drops the GIL, and schemas are sized before: schema_relax.py).
GRAMMAR_THREADS = ThreadPoolExecutor(4, thread_name_prefix="mtp-grammar")
_HEAVY: ContextVar[bool] = ContextVar("mtp_heavy_preparation", default=False)


def set_heavy(heavy: bool) -> None:
    """Put the current request's preparation on the heavy lane (or back on the light one)."""
    _HEAVY.set(heavy)


def is_heavy() -> bool:
    return _HEAVY.get()


class Lanes:
    def __init__(self, threads: int):
        threads = max(1, threads)
        self.light = ThreadPoolExecutor(threads, thread_name_prefix="mtp-tokenize")
        self.heavy = ThreadPoolExecutor(threads, thread_name_prefix="mtp-tokenize-heavy")

    async def run(self, fn, *args):
        pool = self.heavy if is_heavy() else self.light
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def shutdown(self) -> None:
        self.light.shutdown(wait=False)
        self.heavy.shutdown(wait=False)


def within(seconds: float, fn, *args):
    """`fn(*args)` on a grammar thread, waited on at most `seconds`: TimeoutError past them."""
    try:
        return GRAMMAR_THREADS.submit(fn, *args).result(timeout=seconds)
    except FutureTimeout:
        raise TimeoutError from None

"""The engine loop: one thread owns the model and every MLX call.

    engine = EngineLoop(model, tokenizer, max_queue=64, prompt_cache=PromptCache())
    engine.start()
    handle = engine.submit(prompt_ids, params, depth)   # from asyncio code
    async for chunk in handle: ...                       # GenerationChunk, as rounds commit
    engine.cancel(handle)                                # e.g. the client went away

Requests wait in a bounded queue (`QueueFull` when more than `max_queue` wait
beyond the free batch slots) and join the `Scheduler` between engine steps (up to
`max_active` at once). One engine step is one
scheduler step: a prefill chunk of the oldest newcomer and one decode round
for the running rows (the single-sequence MTP round, or a batched round with
per-row acceptance when several run). The loop only admits, cancels and
delivers; what a step computes is the scheduler's business.

Delivery: each committed chunk goes to the request's asyncio queue through
`loop.call_soon_threadsafe`, so the asyncio side never waits on MLX. An
exception in one request ends that request with an `EngineError` item and
never stops the loop. A cancelled request is dropped at the start of the next
step, so its slot is free within one round. When the last request is done, the
loop hands MLX's buffer cache and the heap's free pages back (`memory.py`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional

from .grammar import GrammarError
from .memory import release_idle_memory
from .policy import DepthPolicy
from .context_drafts import MAX_COPY
from .prompt_cache import PromptCache
from .sampling import SamplingParams
from .scheduler import Scheduler, SchedulerLike

log = logging.getLogger("mtp_serve.engine")


class QueueFull(RuntimeError):
    """The waiting queue is full; retry later."""


class EngineStopped(RuntimeError):
    """The engine is not running."""


class EngineError(RuntimeError):
    """A request failed inside the engine; the message names the cause."""


class ConstraintFailed(EngineError):
    """The request's own output constraint failed while decoding (a grammar that hits one of its
    limits only after some tokens): the client's input, not the server, so the message is the client's."""


_DONE = object()


@dataclass(eq=False)
class Job:
    """Work for the engine thread beside the requests (e.g. scoring a prompt): a generator the
    loop advances one of its steps per engine step, so a long one never holds the running rows for long. Its
    return value (StopIteration.value) resolves `future`."""

    make_steps: Callable[[], Iterator]  # called on the engine thread: MLX work stays there
    future: asyncio.Future
    _loop: asyncio.AbstractEventLoop
    steps: Optional[Iterator] = None


@dataclass(eq=False)
class RequestHandle:
    """One request as the asyncio side sees it: iterate for chunks, `cancel()` to stop."""

    id: int
    prompt: List[int]
    params: SamplingParams
    depth: int
    checkpoints: tuple
    _loop: asyncio.AbstractEventLoop
    _queue: asyncio.Queue
    _engine: "EngineLoop"
    submitted_at: float = field(default_factory=time.perf_counter)
    images: tuple = ()  # the prompt's prepared images (models/vision), in order
    cancelled: bool = False
    finished: bool = False

    def cancel(self) -> None:
        self._engine.cancel(self)

    def __aiter__(self):
        return self._chunks()

    async def _chunks(self):
        while True:
            item = await self._queue.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class EngineLoop:
    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_queue: int = 64,
        max_active: int = 8,
        prefill_chunk: int = 512,
        prompt_cache: Optional[PromptCache] = None,
        policy: Optional[DepthPolicy] = None,
        copy_max: int = MAX_COPY,
        pipeline: bool = True,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.max_queue = max_queue
        self.max_active = max_active
        self.prompt_cache = prompt_cache
        self.scheduler: SchedulerLike = Scheduler(model, tokenizer, max_batch_size=max_active, prefill_chunk=prefill_chunk,
                                   prompt_cache=prompt_cache, policy=policy, copy_max=copy_max,
                                   pipeline=pipeline)
        self._waiting: Deque[RequestHandle] = deque()
        self._active: Dict[int, RequestHandle] = {}  # in the scheduler (prefilling or running)
        self._jobs: Deque[Job] = deque()
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        self._thread: Optional[threading.Thread] = None
        self._running = False
        self.steps = 0  # completed engine steps, for tests and metrics
        self._idle_after = 0  # `steps` when memory was last released

    # -- asyncio side

    def submit(self, prompt: List[int], params: SamplingParams, depth: int = 0, checkpoints: tuple = (),
               images: tuple = ()) -> RequestHandle:
        """Queue a request; call from the event loop that will iterate the handle.

        `checkpoints`: prompt lengths at which to keep a prompt-cache snapshot; `images`:
        the prompt's prepared images, one per run of image-pad tokens, in order."""
        loop = asyncio.get_running_loop()
        handle = RequestHandle(next(self._ids), list(prompt), params, depth, tuple(checkpoints), loop, asyncio.Queue(), self,
                               images=tuple(images))
        with self._cond:
            if not self._running:
                raise EngineStopped("the engine is not running")
            if self._queued() >= self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting for a slot)")
            self._waiting.append(handle)
            self._cond.notify()
        return handle

    jobs_supported = True  # False where a job on this thread alone would desync other ranks

    def run_job(self, make_steps: Callable[[], Iterator]) -> asyncio.Future:
        """Run `make_steps()` (a generator) on the engine thread between engine steps; from the event loop.
        Cancelling the returned future drops the job at its next step."""
        loop = asyncio.get_running_loop()
        job = Job(make_steps, loop.create_future(), loop)
        with self._cond:
            if not self._running:
                raise EngineStopped("the engine is not running")
            if self._queued() + len(self._jobs) >= self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting for a slot)")
            self._jobs.append(job)
            self._cond.notify()
        return job.future

    def check_constraint(self, constraint) -> None:
        """Compile an output constraint and its first mask, within the grammar budget (GrammarError
        naming the problem or the limit); from any thread but this one's. The compiled matcher rides
        on `constraint`, so admitting the request copies it instead of compiling on the engine thread."""
        self.scheduler.grammar_compiler().check(constraint)

    def cancel(self, handle: RequestHandle) -> None:
        """Stop a request: freed at the start of the next engine step (or now, if still waiting)."""
        with self._cond:
            if handle.finished or handle.cancelled:
                return
            handle.cancelled = True
            if handle in self._waiting:
                self._waiting.remove(handle)
                self._finish(handle, None)
            self._cond.notify()

    def _queued(self) -> int:
        """Requests waiting beyond the free batch slots (the ones `max_queue` bounds): requests
        that arrive within one engine step all wait for admission, but while slots are free
        they are not queued."""
        free = max(0, self.max_active - len(self._active))
        return max(0, len(self._waiting) - free)

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def active_count(self) -> int:
        return len(self._active)

    @property
    def running(self) -> bool:
        return self._running and self._thread is not None and self._thread.is_alive()

    # -- lifecycle

    def start(self) -> "EngineLoop":
        with self._cond:
            if self._running:
                return self
            self._running = True
        self._thread = threading.Thread(target=self._run, name="mtp-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._running = False
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.prompt_cache is not None:
            self.prompt_cache.close()  # the disk tier's writes in flight

    # -- engine thread

    def _run(self) -> None:
        while True:
            with self._cond:
                idle = self._running and not self._waiting and not self._active and not self._jobs
            if idle and self.steps != self._idle_after:
                release_idle_memory()  # a burst is over: its buffers go back to the OS
                self._idle_after = self.steps
            with self._cond:
                while self._running and not self._waiting and not self._active and not self._jobs:
                    self._cond.wait()
                if not self._running:
                    pending = list(self._waiting) + list(self._active.values())
                    jobs = list(self._jobs)
                    self._waiting.clear()
                    self._active.clear()
                    self._jobs.clear()
                    for h in pending:
                        self._finish(h, EngineStopped("the server is shutting down"))
                    for job in jobs:
                        self._settle(job, error=EngineStopped("the server is shutting down"))
                    return
                job = self._jobs[0] if self._jobs else None
                cancelled = [h for h in self._active.values() if h.cancelled]
                admitted = []
                while self._waiting and len(self._active) - len(cancelled) + len(admitted) < self.max_active:
                    admitted.append(self._waiting.popleft())
            for handle in cancelled:
                self.scheduler.cancel(handle.id)  # dropped by the next step
                self._retire(handle, None)
            for handle in admitted:
                self._admit(handle)
            if job is not None:
                self._step_job(job)
            self._step()
            self.steps += 1

    def _admit(self, handle: RequestHandle) -> None:
        try:
            self.scheduler.add(handle.id, handle.prompt, handle.params, handle.depth, handle.checkpoints, handle.images)
        except Exception as e:  # noqa: BLE001 - reported to the request, the loop goes on
            log.warning("request %d rejected by the engine: %s", handle.id, e)
            self._finish(handle, EngineError(f"{type(e).__name__}: {e}"))
            return
        with self._cond:
            self._active[handle.id] = handle

    def _step(self) -> None:
        """One scheduler step: a prefill chunk and/or one (batched) decode round."""
        if not self.scheduler.has_work():
            return
        try:
            for key, item in self.scheduler.step():  # delivered as each is ready
                handle = self._active.get(key)
                if handle is None:
                    continue
                if isinstance(item, BaseException):
                    log.error("request %d failed: %s: %s", key, type(item).__name__, item)
                    failed = ConstraintFailed(str(item)) if isinstance(item, GrammarError) else \
                        EngineError(f"{type(item).__name__}: {item}")
                    self._retire(handle, failed)
                    continue
                self._deliver(handle, item)
                if item.finish_reason:
                    self._retire(handle, None)
        except Exception as e:  # noqa: BLE001 - the step failed as a whole: fail its requests, keep looping
            log.exception("engine step failed")
            self.scheduler.drop_all()
            for handle in list(self._active.values()):
                self._retire(handle, EngineError(f"{type(e).__name__}: {e}"))

    def _step_job(self, job: Job) -> None:
        """One step of the oldest job; settled (and dropped) when it returns, fails or was cancelled."""
        try:
            if job.future.cancelled():
                raise StopIteration
            if job.steps is None:
                job.steps = job.make_steps()
            next(job.steps)
            return
        except StopIteration as done:
            self._settle(job, value=done.value)
        except Exception as e:  # noqa: BLE001 - reported to the job's caller, the loop goes on
            log.warning("engine job failed: %s: %s", type(e).__name__, e)
            self._settle(job, error=EngineError(f"{type(e).__name__}: {e}"))
        with self._cond:
            self._jobs.remove(job)

    @staticmethod
    def _settle(job: Job, value: Any = None, error: Optional[BaseException] = None) -> None:
        def settle():
            if not job.future.done():
                job.future.set_exception(error) if error is not None else job.future.set_result(value)

        try:
            job._loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the event loop is closed: nobody is waiting
            pass

    def _retire(self, handle: RequestHandle, error: Optional[BaseException]) -> None:
        with self._cond:
            self._active.pop(handle.id, None)
        self._finish(handle, error)

    def _deliver(self, handle: RequestHandle, item: Any) -> None:
        try:
            handle._loop.call_soon_threadsafe(handle._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening
            handle.cancelled = True

    def _finish(self, handle: RequestHandle, error: Optional[BaseException]) -> None:
        if handle.finished:
            return
        handle.finished = True
        if error is not None:
            self._deliver(handle, error)
        self._deliver(handle, _DONE)

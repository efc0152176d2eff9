"""Serving one model across ranks: rank 0 runs the engine and decides, the other
ranks follow it step by step.

    rank 0:  engine = DistributedEngine(model, tokenizer, link=Link(group), mode="tensor", ...)
    others:  follow(model, tokenizer, Link(group))      # returns when rank 0 stops

Every rank runs the same `Scheduler` over its own part of the model
(`models/sharding.py`), so every rank runs the same forward passes in the same
order and the parallel layers' collectives pair up. What only rank 0 knows
travels on `Link` as small JSON messages over the same group:
- each step (`turn`): the requests that joined (prompt, sampling parameters
  with any output constraint, depth cap, the seed of the request's random
  stream) and those cancelled;
- a row's first token when its prefill completes (`first`);
- each round: every row's depth (`depths`: the policy times rounds on rank 0),
  the drafted tokens (`drafts`), what each row accepted and emitted (`accepted`).

Rank 0's decisions are final. Ranks that hold (part of) the MTP head, tensor
parallel, draft and accept as rank 0 does: the collectives give every rank the
same logits and a request's random stream has the same seed on every rank, so
their drafts match and the sharded head's inputs stay identical; a rank whose
result differs anyway takes rank 0's and logs it. Pipeline stages without the
head neither draft nor sample; they take the drafts and the emitted tokens.
Each rank rolls back its own caches (its heads' GatedDeltaNet states and KV,
or its layers') in `commit`, with the counts rank 0 decided.

Constrained requests: every rank compiles the request's grammar and keeps its
own matcher, advanced by the tokens rank 0 emitted, so a rank that drafts masks
its drafts as rank 0 does (and the rows end at the same token). The prompt
cache is not used across ranks: rank 0 alone would decide its hits, and the
other ranks would have to hold and evict the same snapshots of their parts.

A message nobody waits for yet (a first token, an accept decision) rides on the
next one rank 0 sends anyway. Control messages per decode round: tensor
parallel 3 (step, depths, drafts), pipeline 2 (step, depths with drafts), plain
decoding 1 (step).

Every rank must run its collectives in the same order, so a rank evaluates its
own part of a phase (drafting, the verify) before it takes the next message.

Faults: any error in a step on rank 0 (a collective fails as soon as a peer's
connection drops) or a step longer than `rank_timeout` (a stalled peer blocks a
collective forever) ends the engine: every in-flight and queued request fails
with `EngineStopped` (HTTP 503) and `on_fatal` runs (mtp-serve exits non-zero).
A follower raises on any error; when rank 0 is gone its next collective fails.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, List, Optional

import mlx.core as mx
import numpy as np

from .engine_loop import EngineLoop, EngineStopped
from .grammar import Constraint
from .policy import DepthPolicy
from .sampling import Rng, SamplingParams, random_seed
from .scheduler import Scheduler, SchedulerLike
from .speculative import Accepted, Drafts, accept, draft

log = logging.getLogger("mtp_serve.distributed")

SLOT = 4096  # bytes of a message's first collective; a longer message sends the rest in a second one
MAGIC = b"MTPs"  # opens every message: a rank whose collectives fell out of step with rank 0's sees garbage instead
HEADER = 12  # magic, message number, payload length
WARM_UP_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


class DesyncError(RuntimeError):
    """A rank's state no longer matches rank 0's: it cannot go on."""


# ---------------------------------------------------------------- the link


@dataclass
class LinkStats:
    messages: int = 0
    bytes: int = 0  # payload bytes
    seconds: float = 0.0  # in the collectives (waiting for the slowest rank included)


class Link:
    """Rank 0's control messages to the other ranks. A broadcast is an all-sum over a
    byte buffer to which the other ranks contribute zeros."""

    def __init__(self, group):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.stats = LinkStats()
        self._outbox: Dict[str, Any] = {}
        self._inbox: Dict[str, Any] = {}

    # -- rank 0

    def post(self, **items) -> None:
        """Queue items for the next message."""
        for kind, value in items.items():
            if kind in self._outbox:
                raise DesyncError(f"a second {kind!r} message before the first was sent")
            self._outbox[kind] = value

    def send(self, **items) -> None:
        """Send these items now, with whatever was queued."""
        self.post(**items)
        self.flush()

    def flush(self) -> None:
        if self._outbox:
            payload, self._outbox = json.dumps(self._outbox, separators=(",", ":")).encode(), {}
            self._broadcast(payload)

    # -- the other ranks

    def take(self, kind: str) -> Any:
        """The next `kind` item from rank 0, receiving messages until one holds it."""
        while kind not in self._inbox:
            message = json.loads(self._broadcast(None))
            if message.keys() & self._inbox.keys():
                raise DesyncError(f"rank 0 sent {sorted(message.keys() & self._inbox.keys())} again before this rank used them")
            self._inbox.update(message)
        return self._inbox.pop(kind)

    # -- every rank

    def gather(self, obj: Any) -> List[Any]:
        """Every rank's small JSON-able `obj`, in rank order."""
        rows = np.array(self._collective(mx.distributed.all_gather, _framed(json.dumps(obj).encode(), SLOT, 0)))
        return [json.loads(_unframe(row)[0]) for row in rows.reshape(self.size, SLOT)]

    def _broadcast(self, payload: Optional[bytes]) -> bytes:
        t0 = time.perf_counter()
        number = self.stats.messages
        got = self._collective(mx.distributed.all_sum,
                               _framed(payload, SLOT, number) if payload else np.zeros(SLOT, np.uint8))
        data, n, seen = _unframe(got)
        if seen != number:
            raise DesyncError(f"rank {self.rank} expected control message {number} from rank 0 and got "
                              f"{'message ' + str(seen) if seen >= 0 else 'other data'}: the ranks' collectives are out of step")
        if n > len(data):  # the rest of a long message
            rest = np.frombuffer(payload[len(data):], np.uint8) if payload else np.zeros(n - len(data), np.uint8)
            data += self._collective(mx.distributed.all_sum, rest).tobytes()
        self.stats.messages += 1
        self.stats.bytes += n
        self.stats.seconds += time.perf_counter() - t0
        return data

    def _collective(self, op: Callable, buf: np.ndarray) -> np.ndarray:
        out = op(mx.array(buf), group=self.group)
        mx.eval(out)
        return np.array(out)


def _framed(payload: bytes, size: int, number: int) -> np.ndarray:
    """[MAGIC][message number][payload length][payload ...] in `size` bytes (the payload cut to fit)."""
    header = MAGIC + number.to_bytes(4, "little") + len(payload).to_bytes(4, "little")
    buf = np.zeros(size, np.uint8)
    buf[:HEADER] = np.frombuffer(header, np.uint8)
    head = payload[: size - HEADER]
    buf[HEADER : HEADER + len(head)] = np.frombuffer(head, np.uint8)
    return buf


def _unframe(buf: np.ndarray):
    """(the payload bytes in the buffer, the whole payload's length, the message number;
    -1 when the buffer holds no message)."""
    raw = buf[:HEADER].tobytes()
    if raw[:4] != MAGIC:
        return b"", 0, -1
    n = int.from_bytes(raw[8:12], "little")
    return buf[HEADER : HEADER + min(n, len(buf) - HEADER)].tobytes(), n, int.from_bytes(raw[4:8], "little")


def params_to_json(params: SamplingParams) -> dict:
    return dataclasses.asdict(params)


def params_from_json(d: dict) -> SamplingParams:
    d = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    if d.get("constraint") is not None:
        d["constraint"] = Constraint(**d["constraint"])
    return SamplingParams(**d)


# ---------------------------------------------------------------- the scheduler hooks


class LeaderSync:
    """Rank 0's side of the scheduler's `sync` hooks: decide as usual, and share."""

    def __init__(self, link: Link, mode: str, sched: Scheduler):
        self.link, self.mode, self.sched = link, mode, sched

    def _may_draft(self, rows) -> bool:
        return any(self.sched.policy.request_cap(s) for s in rows)  # as the other ranks know it

    def first_token(self, seq, emitted):
        self.link.post(first=[seq.key, emitted[0][0]])
        return emitted

    def depths(self, rows, depths: List[int]) -> List[int]:
        if self._may_draft(rows):
            self.link.post(depths=depths)
        if self.mode == "tensor" or not self._may_draft(rows):
            # Before the round's first collective: ranks that draft need the depths, and
            # a rank that just prefilled a row needs its first token. (Pipeline stages get
            # the depths with the drafts: rank 0 drafts alone.)
            self.link.flush()
        return depths

    def draft(self, model, batch, depths: List[int]) -> Drafts:
        drafts = draft(model, batch, depths)
        if _drafts_shared(self.mode, depths, self._may_draft(batch.rows)):
            self.link.send(drafts=drafts.tokens.tolist() if drafts.tokens is not None else None)
        return drafts

    def accept(self, verified, rows) -> Accepted:
        accepted = accept(verified, rows)
        self.link.post(accepted=[accepted.counts, accepted.tokens])
        return accepted


def _drafts_shared(mode: str, depths: List[int], may_draft: bool) -> bool:
    return max(depths) > 0 or (mode == "pipeline" and may_draft)


class FollowerSync:
    """The other ranks' side: take rank 0's decisions. A rank holding the head (tensor
    parallel) computes them too, which keeps its part of the head's inputs and its
    random streams in step with rank 0's."""

    def __init__(self, link: Link, mode: str, local: bool):
        self.link, self.mode, self.local = link, mode, local
        self.caps: Dict[Hashable, int] = {}  # rank 0's depth cap per request
        self.diverged = 0

    def _may_draft(self, rows) -> bool:
        return any(self.caps.get(s.key, 0) for s in rows)

    def _differs(self, what: str, keys) -> None:
        self.diverged += 1
        if self.diverged <= 5:
            log.warning("rank %d: its %s for request(s) %s differed from rank 0's; rank 0's are used",
                        self.link.rank, what, list(keys))

    def first_token(self, seq, emitted):
        key, token = self.link.take("first")
        if key != seq.key:
            raise DesyncError(f"rank 0 prefilled request {key}, this rank request {seq.key}")
        if token != emitted[0][0]:
            self._differs("first token", [key])
            seq.primary = token  # not forwarded yet: replacing it is enough
            if seq.owed.tokens:
                seq.owed.tokens[-1] = token
            if seq.grammar is not None:
                seq.grammar.rollback_to(0)
                seq.grammar.consume([token])
        return [token], emitted[1]

    def depths(self, rows, depths: List[int]) -> List[int]:
        return self.link.take("depths") if self._may_draft(rows) else [0] * len(rows)

    def draft(self, model, batch, depths: List[int]) -> Drafts:
        shared = _drafts_shared(self.mode, depths, self._may_draft(batch.rows))
        rows = batch.rows
        if not self.local:  # (no masks: this rank does not score the window)
            tokens = self.link.take("drafts") if shared else None
            return Drafts.given(rows, depths, mx.array(tokens) if tokens else None)
        drafts = draft(model, batch, depths)
        if shared:
            mine = drafts.tokens.tolist() if drafts.tokens is not None else None  # runs this rank's part first
            tokens = self.link.take("drafts")
            if mine != tokens:
                self._differs("drafts", [s.key for s in rows])
                drafts.tokens = mx.array(tokens)
                for s, start in zip(rows, drafts.grammar_start):  # its matchers took its own drafts: back
                    if s.grammar is not None:
                        s.grammar.rollback_to(start)
        return drafts

    def accept(self, verified, rows) -> Accepted:
        if self.local:
            mine = accept(verified, rows)
        else:
            mx.eval(verified.hidden)  # this stage's part of the verify, and the pipeline's collectives
        counts, tokens = self.link.take("accepted")
        if self.local and (mine.counts != counts or mine.tokens != tokens):
            self._differs("accepted tokens", [s.key for s in rows])
        return Accepted(verified, counts, tokens)


# ---------------------------------------------------------------- rank 0


class Leader(SchedulerLike):
    """Rank 0's scheduler as the engine loop sees it: calls pass through to the
    `Scheduler`, and what the other ranks need to follow goes out on the link."""

    def __init__(self, sched: Scheduler, link: Link, mode: str, on_fault: Callable[[BaseException], None]):
        self.sched, self.link, self.mode = sched, link, mode
        sched.sync = LeaderSync(link, mode, sched)
        self.on_fault = on_fault
        self._adds: List[dict] = []
        self._cancels: List[Hashable] = []
        self.busy_since: Optional[float] = None  # monotonic time the current step began
        link.post(hello={"mode": mode, "max_batch_size": sched.max_batch_size, "prefill_chunk": sched.prefill_chunk})

    def add(self, key: Hashable, prompt: List[int], params: SamplingParams, max_depth: int, checkpoints: tuple = (),
            images: tuple = ()) -> None:
        if images:
            raise ValueError("images are not served across mlx.launch ranks yet: serve a vision model on one rank")
        self.sched.add(key, prompt, params, max_depth, checkpoints)
        seq, seed = self.sched.seqs[key], random_seed()
        seq.rng = Rng(seed)
        self._adds.append({"key": key, "prompt": list(prompt), "params": params_to_json(params), "depth": max_depth,
                           "checkpoints": list(checkpoints), "seed": seed, "cap": self.sched.policy.request_cap(seq)})

    def cancel(self, key: Hashable) -> None:
        self.sched.cancel(key)
        self._cancels.append(key)

    def has_work(self) -> bool:
        return self.sched.has_work()

    def grammar_compiler(self):
        return self.sched.grammar_compiler()

    def drop_all(self) -> None:
        self.sched.drop_all()

    def step(self):
        """The scheduler's step, announced to the other ranks. Any error is the whole
        group's: `on_fault` runs and the error propagates."""
        self.busy_since = time.monotonic()
        try:
            self.link.send(turn={"adds": self._adds, "cancels": self._cancels})
            self._adds, self._cancels = [], []
            for key, item in self.sched.step():
                if isinstance(item, BaseException):  # the ranks may no longer agree on the batch
                    raise item
                yield key, item
            if not self.sched.has_work():
                self.link.flush()  # nothing follows soon: the other ranks wait for the last decisions
        except Exception as e:
            self.on_fault(e)
            raise
        finally:
            self.busy_since = None

    def stop(self) -> None:
        self.link.send(turn={"stop": True})


class DistributedEngine(EngineLoop):
    """The engine loop of rank 0 when serving across ranks."""

    jobs_supported = False  # a forward pass on rank 0 alone: the other ranks would not take part

    def __init__(self, model, tokenizer, *, link: Link, mode: str, rank_timeout: float = 60.0,
                 on_fatal: Optional[Callable[[BaseException], None]] = None, **engine_options):
        if engine_options.get("prompt_cache") is not None:
            raise ValueError("the prompt cache cannot be used across ranks (the other ranks cannot restore its state)")
        super().__init__(model, tokenizer, **engine_options)
        self.scheduler = Leader(self.scheduler, link, mode, on_fault=self.abort)
        self.link = link
        self.rank_timeout = rank_timeout
        self.on_fatal = on_fatal
        self.fault: Optional[BaseException] = None
        self._watchdog: Optional[threading.Thread] = None

    def start(self) -> "DistributedEngine":
        super().start()
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="mtp-rank-watchdog", daemon=True)
            self._watchdog.start()
        return self

    def warm_up(self, depth: int) -> float:
        """Before serving, on every rank: rounds at each depth up to `depth`, for one
        row and for two (kernels are built on first use). Returns the seconds taken."""
        t0, sched = time.perf_counter(), self.scheduler.sched
        saved, sched.policy = sched.policy, DepthPolicy(max_depth=depth, fixed=True)
        key = -1  # request ids are positive
        try:
            for rows in (1, 2):
                for K in range(depth + 1):
                    for _ in range(rows):
                        self.scheduler.add(key, WARM_UP_PROMPT, SamplingParams(max_tokens=K + 2, ignore_eos=True), K)
                        key -= 1
                    while self.scheduler.has_work():
                        for _ in self.scheduler.step():
                            pass
        finally:
            sched.policy = saved
        return time.perf_counter() - t0

    def abort(self, error: BaseException) -> None:
        """The group is broken: fail every request with a 503 and stop (once)."""
        with self._cond:
            if self.fault is not None:
                return
            self.fault = error
            self._running = False
            pending = list(self._waiting) + list(self._active.values())
            self._waiting.clear()
            self._active.clear()
            self._cond.notify()
        log.error("serving across %d ranks failed: %s: %s", self.link.size, type(error).__name__, error)
        stopped = EngineStopped(f"a rank of this server failed ({type(error).__name__}: {error}); the server is stopping")
        for handle in pending:
            self._finish(handle, stopped)
        if self.on_fatal is not None:
            self.on_fatal(error)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop; a step still running after `timeout` waits on a rank that no longer
        answers: its requests fail with 503 as for a broken group."""
        super().stop(timeout)
        if self._thread is not None and self._thread.is_alive():
            self.abort(TimeoutError(f"stopping: the other ranks did not finish the engine step within {timeout:g}s"))

    def _run(self) -> None:
        try:
            super()._run()
        finally:
            if self.fault is None:
                try:
                    self.scheduler.stop()  # the other ranks leave their loops
                except Exception as e:  # noqa: BLE001 - shutting down anyway
                    log.warning("could not tell the other ranks to stop: %s", e)

    def _watch(self) -> None:
        while self.fault is None and (self._running or self.scheduler.busy_since is not None):
            time.sleep(min(1.0, self.rank_timeout / 4))
            since = self.scheduler.busy_since
            if since is not None and time.monotonic() - since > self.rank_timeout:
                self.abort(TimeoutError(f"an engine step has waited more than {self.rank_timeout:g}s "
                                        f"for the other ranks: one stopped responding"))


# ---------------------------------------------------------------- the other ranks


def follow(model, tokenizer, link: Link) -> None:
    """Run rank 0's steps on this rank until rank 0 stops."""
    settings = link.take("hello")
    mode = settings["mode"]
    sync = FollowerSync(link, mode, local=model.has_mtp or mode == "tensor")
    sched = Scheduler(model, tokenizer, max_batch_size=settings["max_batch_size"], prefill_chunk=settings["prefill_chunk"],
                      policy=DepthPolicy(max_depth=0, fixed=True), sync=sync)
    while True:
        turn = link.take("turn")
        if turn.get("stop"):
            return
        for op in turn["adds"]:
            sched.add(op["key"], op["prompt"], params_from_json(op["params"]), op["depth"], tuple(op["checkpoints"]))
            sched.seqs[op["key"]].rng = Rng(op["seed"])
            sync.caps[op["key"]] = op["cap"]
        for key in turn["cancels"]:
            sched.cancel(key)
        for _, item in sched.step():
            if isinstance(item, BaseException):
                raise item
        for key in [k for k in sync.caps if k not in sched.seqs]:
            del sync.caps[key]

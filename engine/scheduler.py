"""What runs in each engine step: continuous batching with per-row MTP depth.

    sched = Scheduler(model, tokenizer, max_batch_size=8)
    sched.add(key, prompt_ids, params, max_depth)
    while sched.has_work():
        for key, chunk in sched.step(): ...      # GenerationChunk (or an exception) per request

A step is decided, then run: `schedule` picks what it does without touching the
model (one prefill chunk of the oldest newcomer when a batch slot is free, so a
long prompt never stalls running streams for more than one chunk, and a decode
round over the running rows), and `run` does it: the chunk, then one speculative
round, each row drafting its own depth (`DepthPolicy`). One row is a batch of
one: the same round, the same policy. Rows join after their prefill and leave
when done or cancelled.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, Hashable, Iterator, List, Optional, Protocol, Tuple

from mtp_serve.models.mtp_model import MTPModel

from mtp_serve.models.mlx_lm_compat import hf_tokenizer

from .batch import Batch
from .grammar import GrammarCompiler, GrammarError
from .policy import Bucket, DepthPolicy, round_bucket
from .prefill import prefill
from .context_drafts import MAX_COPY, MIN_COPY
from .prompt_cache import PromptCache
from .sampling import SamplingParams
from .sequence import Sequence, Status, new_sequence
from .pipeline import Pending, accept_plain, can_pipeline, launch, plain_choice, undo
from .speculative import Accepted, CertainDrafts, RoundSync, commit, draft, run_round, verify

log = logging.getLogger("mtp_serve.engine")
_COMPILER_LOCK = threading.Lock()


class SchedulerLike(Protocol):
    """What the engine loop drives: the `Scheduler`, or rank 0's `Leader` around it
    (serving across ranks, `distributed.py`)."""

    def add(self, key: Hashable, prompt: List[int], params: SamplingParams, max_depth: int, checkpoints: tuple = (),
            images: tuple = ()) -> None: ...

    def cancel(self, key: Hashable) -> None: ...

    def has_work(self) -> bool: ...

    def step(self) -> Iterator[Tuple[Hashable, object]]: ...

    def grammar_compiler(self) -> GrammarCompiler: ...

    def drop_all(self) -> None: ...


@dataclass(frozen=True)
class Plan:
    """What one engine step runs."""

    prefill: Optional[Sequence]  # the newcomer whose next prompt chunk is prefilled, if any
    decode: bool  # a round over the running rows (joined by `prefill`'s row when its prompt is done)


class Scheduler(SchedulerLike):
    def __init__(
        self,
        model: MTPModel,
        tokenizer,
        *,
        max_batch_size: int = 8,
        prefill_chunk: int = 512,
        prompt_cache: Optional[PromptCache] = None,
        policy: Optional[DepthPolicy] = None,
        sync: Optional[RoundSync] = None,
        copy_max: int = MAX_COPY,
        pipeline: bool = True,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.prefill_chunk = prefill_chunk
        self.prompt_cache = prompt_cache
        self.policy = policy or DepthPolicy()
        self.copy_max = copy_max  # most tokens a row copies from its context per round; 0: no copy drafts
        # Serving across ranks (`distributed.py`): rank 0's decisions (first tokens,
        # depths, drafts, accepted tokens) are shared, and the other ranks take them.
        self.sync = sync
        self.prefilling: Deque[Sequence] = deque()
        self.batch = Batch()  # the running rows, in join order
        self.seqs: Dict[Hashable, Sequence] = {}
        self.last_round: Dict[Hashable, Tuple[int, int]] = {}  # key -> (head drafts, accepted) in the last round
        self.last_certain: Dict[Hashable, int] = {}  # key -> copied or forced drafts in the last round
        self._grammars: Optional[GrammarCompiler] = None
        # Plain rounds start the next step's backbone pass before their tokens reach the host
        # (`pipeline.py`); `_pending` is that pass until the next round takes or undoes it.
        self.pipeline = pipeline
        self._pending: Optional[Pending] = None
        self.launched = 0  # passes started ahead (pipelined rounds)
        self.undone = 0  # of those, taken back unused

    # -- requests

    def add(self, key: Hashable, prompt: List[int], params: SamplingParams, max_depth: int, checkpoints: tuple = (),
            images: tuple = ()) -> None:
        """`checkpoints`: prompt lengths worth a prompt-cache snapshot (message boundaries);
        `images`: the prompt's prepared images (models/vision), in order."""
        if self.prompt_cache is not None:
            checkpoints = self.prompt_cache.checkpoints(len(prompt), checkpoints)
        # The constraint arrives prepared (compiled off this thread, `EngineLoop.check_constraint`): a copy, no compiling.
        grammar = self.grammar_compiler().matcher(params.constraint) if params.constraint is not None else None
        seq = new_sequence(self.model, self.tokenizer, key, prompt, params, max_depth, checkpoints,
                           prior_acceptance=self.policy.start_rates(), grammar=grammar, images=images)
        self.seqs[key] = seq
        self.prefilling.append(seq)

    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles constraints for this model's tokenizer (built on first use)."""
        with _COMPILER_LOCK:  # the server's tokenizer pool prepares constraints with it too
            if self._grammars is None:
                self._grammars = GrammarCompiler(hf_tokenizer(self.tokenizer), self.model.vocab_size,
                                                 self.tokenizer.eos_token_ids)
        return self._grammars

    def cancel(self, key: Hashable) -> None:
        seq = self.seqs.get(key)
        if seq is not None and not seq.finished:
            seq.status = Status.CANCELLED

    def has_work(self) -> bool:
        return bool(self.prefilling or self.batch.rows)

    @property
    def active(self) -> int:
        return len(self.prefilling) + len(self.batch)

    # -- one step

    def step(self) -> Iterator[Tuple[Hashable, Any]]:
        """Yields (key, GenerationChunk) per request that got tokens, or (key, exception),
        each as soon as it is ready."""
        return self.run(self.schedule())

    def schedule(self) -> Plan:
        """Decide this step (no model work): cancelled requests leave, the oldest newcomer
        prefills a chunk while the batch has a free slot, and the running rows decode."""
        self._drop_cancelled()
        newcomer = self.prefilling[0] if self.prefilling and len(self.batch) < self.max_batch_size else None
        return Plan(prefill=newcomer, decode=bool(self.batch.rows) or newcomer is not None)

    def run(self, plan: Plan) -> Iterator[Tuple[Hashable, Any]]:
        """Run `plan`: a finished prefill's first token comes before the running rows' round
        (which the new row then joins)."""
        if plan.prefill is not None:
            yield from self._prefill_step(plan.prefill)
        if plan.decode and self.batch.rows:
            yield from self._round()

    # -- internals

    def _prefill_step(self, seq: Sequence) -> Iterator[Tuple[Hashable, Any]]:
        try:
            if self.prompt_cache is not None and seq.prefilled == 0 and seq.cached_tokens == 0:
                self._restore(seq)
            emitted = prefill(self.model, seq, self.prefill_chunk, self._checkpoint if self.prompt_cache is not None else None)
        except Exception as e:  # noqa: BLE001 - reported to this request only
            self._forget(self.prefilling.popleft())
            yield seq.key, e
            return
        if emitted is None:
            return
        if self.sync is not None:
            emitted = self.sync.first_token(seq, emitted)
        self.prefilling.popleft()
        if _grammar_failed(seq):
            self._forget(seq)
            yield seq.key, GrammarError(f"the output constraint failed: {seq.grammar.error}")
            return
        yield seq.key, seq.apply(emitted)
        self._store(seq, seq.prompt_key, seq.caches)
        if seq.finished:
            self._forget(seq)
        else:
            self._drain()  # the started pass ran without the new row
            self.batch.add(seq)

    def _round(self) -> List[Tuple[Hashable, Any]]:
        rows = list(self.batch.rows)
        t0 = time.perf_counter()
        try:
            depths = self.policy.depths(rows)
            if self.sync is not None:
                depths = self.sync.depths(rows, depths)
            certain = self._certain_drafts(rows, depths) if self.sync is None else None
            if certain is not None:
                depths = [0 if c else d for c, d in zip(certain.chains, depths)]
            if self.pipeline and self.sync is None and certain is None and not any(depths) and can_pipeline(self.batch):
                accepted = self._plain_round(rows, depths)
            else:
                self._drain()
                accepted = run_round(self.model, self.batch, depths, self.sync, certain)
            elapsed = time.perf_counter() - t0
            out = [(s.key, s.apply(accepted.emitted(i))) for i, s in enumerate(rows)]
            for s, emitted in zip(rows, accepted.tokens):
                s.copy_cap.settle(emitted)
        except Exception as e:  # noqa: BLE001 - a broken round (an MLX error, out of memory) fails its rows, not the loop
            self._drop_batch()
            return [(s.key, e) for s in rows]
        # A round with certain drafts is no sample of the head's window costs (its window was longer).
        self.policy.observe(rows, depths, accepted.counts, elapsed if certain is None else None)
        if certain is not None:
            self.policy.observe_copies(rows, [len(c) for c in certain.chains], depths, elapsed)
        self.last_round = {s.key: (d, m if d else 0) for s, d, m in zip(rows, depths, accepted.counts)}
        self.last_certain = {s.key: len(c) for s, c in zip(rows, certain.chains) if c} if certain is not None else {}
        if any(s.finished or _grammar_failed(s) for s in rows):
            self._drain()  # rows leave: the batch's caches as the round left them
        for i, s in enumerate(rows):
            if _grammar_failed(s):  # its own matcher failed (a grammar-engine limit): this row alone ends
                out[i] = (s.key, GrammarError(f"the output constraint failed: {s.grammar.error}"))
                self._leave(s)
            elif s.finished:
                self._leave(s, store=True)
        return out

    def _plain_round(self, rows: List[Sequence], depths: List[int]) -> Accepted:
        """A round without drafts, pipelined: it takes the pass the last round started (if
        any), and starts the next one over its own tokens, still lazy, before they reach the
        host; rows at their last token start none (they stop after this round)."""
        pending, self._pending = self._pending, None
        if pending is not None and not pending.matches(self.batch):
            undo(self.batch, pending)
            self.undone += 1
            pending = None
        drafts = draft(self.model, self.batch, depths)
        verified = verify(self.model, self.batch, drafts, pending.outputs if pending is not None else None)
        tokens = plain_choice(verified, rows)
        if all(s.tokens_left > 1 for s in rows):
            self._pending = launch(self.model, self.batch, tokens)
            self.launched += 1
        accepted = accept_plain(verified, tokens)
        commit(self.batch, accepted)
        return accepted

    def _drain(self) -> None:
        """Undo the started pass (the batch changes, a row stops, or the next round drafts)."""
        if self._pending is not None:
            undo(self.batch, self._pending)
            self._pending = None
            self.undone += 1

    def _certain_drafts(self, rows: List[Sequence], depths: List[int]) -> Optional[CertainDrafts]:
        """Drafts that come with certainty, for rows that speculate: under a grammar, the
        tokens it forces next; otherwise tokens copied from the row's context, at the length
        and where the policy expects them to emit faster than the head's drafts at the depth
        it chose. None when no row has any. Every row of a batch verifies the longest chain's
        window, so a batch shares the copy length out."""
        chains, sources = [], []
        most = self.copy_max if len(rows) == 1 else max(2 * MIN_COPY, self.copy_max // len(rows))
        bucket = round_bucket(rows)
        for s, depth in zip(rows, depths):
            chain, source = [], ""
            if s.max_depth > 0 and s.tokens_left > 1:
                if s.grammar is not None:
                    chain, source = s.grammar.forced(min(self.copy_max or MAX_COPY, s.tokens_left - 1)), "forced"
                elif s.params.copy_drafts and self.copy_max > 0:
                    chain, source = self._copy(s, min(s.copy_cap.limit, most, s.tokens_left - 1), depth, bucket), "copy"
            chains.append(chain)
            sources.append(source if chain else "")
        return CertainDrafts(chains, sources) if any(chains) else None

    def _copy(self, s: Sequence, limit: int, depth: int, bucket: Bucket) -> List[int]:
        chain, order = s.context_index().match(limit) if limit >= MIN_COPY else ([], 0)
        n = self.policy.copy_length(s, order, len(chain), depth, bucket) if chain else 0
        if n:
            s.copy_order = order
            return chain[:n]
        if chain:
            s.copy_cap.pass_over(order, chain)
        else:
            s.copy_cap.idle()
        return []

    def _drop_batch(self) -> None:
        """Forget every running row and its caches: after a failed round they may hold
        part of it, so nothing of the batch is reused."""
        for s in self.batch.rows:
            self._forget(s)
        self.batch = Batch()
        self._pending = None

    def drop_all(self) -> None:
        """Forget every request (the engine failed them all after a step failed as a whole)."""
        self._drop_batch()
        for s in self.prefilling:
            self._forget(s)
        self.prefilling.clear()

    def _restore(self, seq: Sequence) -> None:
        """Start from the longest stored prefix. Looked up when the prefill starts, not when
        the request arrived: one that came in with others finds the snapshots their prefills
        stored (the shared system prompt of agents started together)."""
        try:
            hit = self.prompt_cache.restore(seq.prompt_key, needs_head=seq.tracks_head)
        except Exception as e:  # noqa: BLE001 - a cache that fails costs reuse, never the request
            log.exception("request %r: prompt-cache lookup failed; prefilling the whole prompt", seq.key)
            self.prompt_cache.failed("lookup", e)
            return
        if hit is not None:
            seq.start_from(hit.n, hit.caches, hit.owed)

    def _checkpoint(self, seq: Sequence, n: int) -> None:
        self._store(seq, seq.prompt_key[:n], seq.caches)

    def _store(self, seq: Sequence, tokens: List[int], caches) -> None:
        if self.prompt_cache is None:
            return
        try:
            self.prompt_cache.store(tokens, caches, seq.owed.hidden)
        except Exception as e:  # noqa: BLE001 - a snapshot that fails costs reuse, never the request
            log.exception("request %r: prompt-cache snapshot of %d tokens failed", seq.key, len(tokens))
            self.prompt_cache.failed("snapshot", e)

    def _leave(self, seq: Sequence, store: bool = False) -> None:
        if store:
            self._store(seq, seq.cache_tokens(), self.batch.row_caches(seq))
        self.batch.remove(seq)
        self._forget(seq)

    def _forget(self, seq: Sequence) -> None:
        self.seqs.pop(seq.key, None)

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self.prefilling if s.status is Status.CANCELLED]:
            self.prefilling.remove(seq)
            self._forget(seq)
        cancelled = [s for s in self.batch.rows if s.status is Status.CANCELLED]
        if cancelled:
            self._drain()
        for seq in cancelled:
            self._leave(seq)


def _grammar_failed(seq: Sequence) -> bool:
    return seq.grammar is not None and seq.grammar.error is not None

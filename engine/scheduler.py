"""What runs in each engine step: continuous batching with per-sequence MTP.

    sched = Scheduler(model, tokenizer, max_batch_size=8)
    sched.add(key, prompt_ids, params, depth)
    while sched.has_work():
        for key, chunk in sched.step(): ...      # GenerationChunk per request

A step runs one prefill chunk of the oldest newcomer (so a long prompt never
stalls running streams for more than one chunk) and then one decode round
for the running rows: the single-sequence MTP round when one row runs, a
batched round (depth from `DepthPolicy`) when several do. Rows move between
the two paths with their caches and owed head pairs intact, so switching
neither loses nor repeats a token. Rows join after their prefill and leave
when done or cancelled.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, Hashable, Iterator, List, Optional, Tuple

from mtp_serve.models.mtp_model import MTPModel

from .batch import Batch, extract_caches
from .generator import GenerationChunk, token_logprobs
from .policy import DepthPolicy
from .prompt_cache import PromptCache, checkpoint_saver, sequence_snapshot, take_snapshot
from .sampling import SamplingParams
from .sequence import Sequence, new_sequence
from .speculative import Emitted, batched_round, mtp_round, plain_step, prefill
from .stopping import StopChecker


@dataclass(eq=False)
class Row:
    key: Hashable
    seq: Sequence
    stops: StopChecker
    started: float
    cancelled: bool = False


class Scheduler:
    def __init__(
        self,
        model: MTPModel,
        tokenizer,
        *,
        max_batch_size: int = 8,
        prefill_chunk: int = 512,
        prompt_cache: Optional[PromptCache] = None,
        policy: Optional[DepthPolicy] = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.prefill_chunk = prefill_chunk
        self.prompt_cache = prompt_cache
        self.policy = policy or DepthPolicy()
        self.prefilling: Deque[Row] = deque()
        self.running: List[Row] = []  # in join order
        self.batch: Optional[Batch] = None  # owns the caches when len(running) > 1
        self.rows: Dict[Hashable, Row] = {}
        self.last_round: Tuple[int, int, List[int]] = (0, 0, [])  # (batch size, K, accepted per row)

    # -- requests

    def add(self, key: Hashable, prompt: List[int], params: SamplingParams, depth: int, checkpoints: tuple = ()) -> None:
        seq = new_sequence(self.model, prompt, params, depth, self.prompt_cache, checkpoints)
        row = Row(key, seq, StopChecker(self.tokenizer, params), time.perf_counter())
        self.rows[key] = row
        self.prefilling.append(row)

    def cancel(self, key: Hashable) -> None:
        row = self.rows.get(key)
        if row is not None:
            row.cancelled = True

    def has_work(self) -> bool:
        return bool(self.prefilling or self.running)

    @property
    def active(self) -> int:
        return len(self.prefilling) + len(self.running)

    # -- one step

    def step(self) -> Iterator[Tuple[Hashable, Any]]:
        """Yields (key, GenerationChunk) per request that got tokens, or (key, exception),
        each as soon as it is ready: a finished prefill's first token comes before the
        running rows' round (which the new row then joins)."""
        self._drop_cancelled()
        if self.prefilling and len(self.running) < self.max_batch_size:
            row = self.prefilling[0]
            try:
                emitted = prefill(self.model, row.seq, self.prefill_chunk, checkpoint_saver(self.prompt_cache))
            except Exception as e:  # noqa: BLE001 - reported to this request only
                self._forget(self.prefilling.popleft())
                yield row.key, e
                emitted = None
            if emitted is not None:
                self.prefilling.popleft()
                row.seq.stats.prefill_s = time.perf_counter() - row.started
                row.started = time.perf_counter()
                yield self._deliver(row, emitted)
                if self.prompt_cache is not None:
                    self.prompt_cache.store(sequence_snapshot(row.seq, row.seq.prompt))
                if not row.stops.finish_reason:
                    self._join(row)
        if self.running:
            yield from self._decode_round()

    # -- internals

    def _decode_round(self) -> List[Tuple[Hashable, Any]]:
        rows = list(self.running)
        t0 = time.perf_counter()
        try:
            if len(rows) == 1:
                seq = rows[0].seq
                results = [mtp_round(self.model, seq) if seq.uses_mtp else plain_step(self.model, seq)]
                self.last_round = (1, seq.depth if seq.uses_mtp else 0, [len(results[0][0]) - 1])
            else:
                limit = min(r.seq.depth for r in rows) if self.batch.uses_mtp else 0
                K = self.policy.choose(len(rows), limit)
                results = batched_round(self.model, self.batch, K)
                accepted = [len(toks) - 1 for toks, _ in results]
                self.last_round = (len(rows), K, accepted)
                per_pos = [(sum(1 for m in accepted if m > j), len(accepted)) for j in range(K)]
                self.policy.observe(len(rows), K, time.perf_counter() - t0, per_pos)
        except Exception as e:  # noqa: BLE001 - a broken round fails its rows, not the loop
            for r in rows:
                self._leave(r)
            return [(r.key, e) for r in rows]
        out = []
        for row, emitted in zip(rows, results):
            out.append(self._deliver(row, emitted))
        for row in rows:
            if row.stops.finish_reason:
                self._leave(row, store=True)
        return out

    def _deliver(self, row: Row, emitted: Emitted) -> Tuple[Hashable, GenerationChunk]:
        seq = row.seq
        tokens, lp_rows = emitted
        seq.committed += tokens
        kept, text = row.stops.feed(tokens)
        seq.output += kept
        seq.history.add(kept)
        seq.stats.generated_tokens += len(kept)
        seq.stats.decode_s = time.perf_counter() - row.started
        logprobs = token_logprobs(kept, lp_rows, seq.params.logprobs) if seq.params.logprobs is not None and kept else None
        if row.stops.finish_reason:
            self.rows.pop(row.key, None)
        return row.key, GenerationChunk(kept, text, row.stops.finish_reason, seq.stats, logprobs)

    def _join(self, row: Row) -> None:
        self.running.append(row)
        if len(self.running) == 2:
            self.batch = Batch([r.seq for r in self.running])
        elif len(self.running) > 2:
            self.batch.add(row.seq)

    def _leave(self, row: Row, store: bool = False) -> None:
        if row not in self.running:
            return
        seq = row.seq
        if self.batch is not None:
            if store and self.prompt_cache is not None:
                i = self.batch.seqs.index(seq)
                cache = extract_caches(self.batch.cache, i)
                head = self.batch.head_cache[0].extract(i) if self.batch.head_cache is not None else None
                self.prompt_cache.store(take_snapshot(seq.cache_tokens(), cache, head, seq.pending_hidden))
            self.batch.remove([seq])
        elif store and self.prompt_cache is not None:
            self.prompt_cache.store(sequence_snapshot(seq, seq.cache_tokens()))
        self.running.remove(row)
        self.rows.pop(row.key, None)
        if len(self.running) == 1 and self.batch is not None:
            self.batch.release(self.running[0].seq)  # back to the single-sequence path
            self.batch = None

    def _forget(self, row: Row) -> None:
        self.rows.pop(row.key, None)

    def _drop_cancelled(self) -> None:
        for row in [r for r in self.prefilling if r.cancelled]:
            self.prefilling.remove(row)
            self._forget(row)
        for row in [r for r in self.running if r.cancelled]:
            self._leave(row)

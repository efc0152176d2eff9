"""What runs in each engine step: continuous batching with per-row MTP depth.

    sched = Scheduler(model, tokenizer, max_batch_size=8)
    sched.add(key, prompt_ids, params, max_depth)
    while sched.has_work():
        for key, chunk in sched.step(): ...      # GenerationChunk (or an exception) per request

A step runs one prefill chunk of the oldest newcomer (so a long prompt never
stalls running streams for more than one chunk) and then one speculative round
over the running rows, each row drafting its own depth (`DepthPolicy`). One
row is a batch of one: the same round, the same policy. Rows join after their
prefill and leave when done or cancelled.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Deque, Dict, Hashable, Iterator, List, Optional, Tuple

from mtp_serve.models.mtp_model import MTPModel

from .batch import Batch
from .chunks import GenerationChunk
from .policy import DepthPolicy
from .prefill import prefill
from .prompt_cache import PromptCache, checkpoint_saver, take_snapshot
from .sampling import SamplingParams
from .sequence import Sequence, Status, new_sequence
from .speculative import run_round


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
        sync=None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.prefill_chunk = prefill_chunk
        self.prompt_cache = prompt_cache
        self.policy = policy or DepthPolicy()
        # Serving across ranks (`distributed.py`): rank 0's decisions (first tokens,
        # depths, drafts, accepted tokens) are shared, and the other ranks take them.
        self.sync = sync
        self.prefilling: Deque[Sequence] = deque()
        self.batch = Batch()  # the running rows, in join order
        self.seqs: Dict[Hashable, Sequence] = {}
        self.last_round: Dict[Hashable, Tuple[int, int]] = {}  # key -> (drafted, accepted) in the last round

    # -- requests

    def add(self, key: Hashable, prompt: List[int], params: SamplingParams, max_depth: int, checkpoints: tuple = ()) -> None:
        seq = new_sequence(self.model, self.tokenizer, key, prompt, params, max_depth, self.prompt_cache, checkpoints,
                           prior_acceptance=self.policy.start_rates())
        self.seqs[key] = seq
        self.prefilling.append(seq)

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
        each as soon as it is ready: a finished prefill's first token comes before the
        running rows' round (which the new row then joins)."""
        self._drop_cancelled()
        if self.prefilling and len(self.batch) < self.max_batch_size:
            yield from self._prefill_step(self.prefilling[0])
        if self.batch.rows:
            yield from self._round()

    # -- internals

    def _prefill_step(self, seq: Sequence) -> Iterator[Tuple[Hashable, Any]]:
        try:
            emitted = prefill(self.model, seq, self.prefill_chunk, checkpoint_saver(self.prompt_cache))
        except Exception as e:  # noqa: BLE001 - reported to this request only
            self._forget(self.prefilling.popleft())
            yield seq.key, e
            return
        if emitted is None:
            return
        if self.sync is not None:
            emitted = self.sync.first_token(seq, emitted)
        self.prefilling.popleft()
        yield seq.key, seq.apply(emitted)
        self._store(seq, seq.prompt, seq.caches)
        if seq.finished:
            self._forget(seq)
        else:
            self.batch.add(seq)

    def _round(self) -> List[Tuple[Hashable, Any]]:
        rows = list(self.batch.rows)
        t0 = time.perf_counter()
        try:
            depths = self.policy.depths(rows)
            if self.sync is not None:
                depths = self.sync.depths(rows, depths)
            accepted = run_round(self.model, self.batch, depths, self.sync)
        except Exception as e:  # noqa: BLE001 - a broken round fails its rows, not the loop
            for s in rows:
                self._leave(s)
            return [(s.key, e) for s in rows]
        self.policy.observe(rows, depths, accepted.counts, time.perf_counter() - t0)
        self.last_round = {s.key: (d, m) for s, d, m in zip(rows, depths, accepted.counts)}
        out = [(s.key, s.apply(accepted.emitted(i))) for i, s in enumerate(rows)]
        for s in rows:
            if s.finished:
                self._leave(s, store=True)
        return out

    def _store(self, seq: Sequence, tokens: List[int], caches) -> None:
        if self.prompt_cache is not None:
            self.prompt_cache.store(take_snapshot(tokens, caches.backbone, caches.head, seq.owed.hidden))

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
        for seq in [s for s in self.batch.rows if s.status is Status.CANCELLED]:
            self._leave(seq)

"""Prefill, the plain decode step, and the MTP speculative round.

The round reads top to bottom: draft -> verify -> accept -> commit.

State between rounds (single sequence): the backbone caches hold every
committed token except `seq.primary` (x, the last emitted token); the head
cache holds entries up to two positions before x, and `pending_*` hold the
pairs (H[p], x[p+1]) whose head entries are still owed, the last of which is
(H[x-1], x): running the head over them yields the first draft.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import mlx.core as mx

from mtp_serve.models.caches import SpeculativeGDNCache, commit_verify, set_capture
from mtp_serve.models.mtp_model import MTPModel

from .batch import Batch, trim_rows
from .rejection import accept_greedy, rejection_sample
from .sampling import choose, target_logprobs
from .sequence import Sequence

# (emitted tokens, target log-probabilities rows for them [n, V] or None)
Emitted = Tuple[List[int], Optional[mx.array]]

PREFILL_CHUNK = 1024
MAX_OWED_PAIRS = 32


def prefill(
    model: MTPModel,
    seq: Sequence,
    max_tokens: Optional[int] = None,
    on_checkpoint: Optional[Callable[[Sequence, int], None]] = None,
) -> Optional[Emitted]:
    """Forward the next prompt tokens past those already in the caches.

    With `max_tokens`, forwards at most that many (chunked prefill, resumable)
    and returns None while prompt tokens remain; once the whole prompt is in,
    samples and returns the first token. The head runs over the prompt as it
    goes (its KV is warm for the first draft; only the last position's pair,
    whose next token is not sampled yet, stays owed). `on_checkpoint(seq, n)`
    is called when the caches hold exactly the first n prompt tokens, for each
    n in `seq.checkpoints` (a chunk ends there).
    """
    start = seq.cached_tokens + seq.prefilled
    end = len(seq.prompt) if max_tokens is None else min(len(seq.prompt), start + max_tokens)
    stops = sorted({n for n in seq.checkpoints if start < n < end} | {end})
    i = start
    for stop in stops:
        for j in range(i, stop, PREFILL_CHUNK):
            k = min(stop, j + PREFILL_CHUNK)
            hidden, logits = model.forward(mx.array([seq.prompt[j:k]]), seq.cache)
            if seq.tracks_head:
                seq.pending_hidden = hidden if seq.pending_hidden is None else mx.concatenate([seq.pending_hidden, hidden], axis=1)
                known = min(k, len(seq.prompt) - 1) - seq.head_cache.offset  # pairs whose next token is in the prompt
                absorb_head_pairs(model, seq, known, seq.prompt[seq.head_cache.offset + 1 : seq.head_cache.offset + 1 + known])
            mx.eval(logits, seq.pending_hidden if seq.tracks_head else [], [c.state for c in seq.cache])
            seq.last_logits = logits[:, -1]
        seq.prefilled += stop - i
        i = stop
        if on_checkpoint is not None and stop in seq.checkpoints:
            on_checkpoint(seq, stop)
    if end < len(seq.prompt):
        return None
    lp = target_logprobs(seq.last_logits, seq.params, seq.history)
    first = choose(lp, seq.params, seq.rng).item()
    seq.last_logits = None
    if seq.tracks_head:
        # Owed head pairs (H[p], x[p+1]) from the head cache's end up to the new token.
        seq.pending_tokens = seq.prompt[seq.head_cache.offset + 1 :] + [first]
    seq.primary = first
    return [first], lp


def plain_step(model: MTPModel, seq: Sequence) -> Emitted:
    hidden, logits = model.forward(mx.array([[seq.primary]]), seq.cache)
    lp = target_logprobs(logits[0], seq.params, seq.history)
    token = choose(lp, seq.params, seq.rng).item()
    seq.stats.backbone_passes += 1
    if seq.tracks_head:
        owe_head_pairs(model, seq, hidden, [token])
    seq.primary = token
    return [token], lp


def absorb_head_pairs(model: MTPModel, seq: Sequence, n: int, next_tokens: List[int]) -> None:
    """Run the head over the first n owed pairs (their hiddens and `next_tokens`)."""
    if n <= 0:
        return
    model.draft(seq.pending_hidden[:, :n], mx.array([next_tokens[:n]]), seq.head_cache)
    mx.eval(seq.head_cache.state)  # keep the lazy graph bounded
    seq.pending_hidden = seq.pending_hidden[:, n:]


def owe_head_pairs(model: MTPModel, seq: Sequence, hidden: mx.array, next_tokens: List[int]) -> None:
    """Record pairs the head has not seen yet; absorb them once they pile up (plain steps)."""
    seq.pending_hidden = mx.concatenate([seq.pending_hidden, hidden], axis=1)
    seq.pending_tokens = seq.pending_tokens + next_tokens
    if len(seq.pending_tokens) > MAX_OWED_PAIRS:
        n = len(seq.pending_tokens) - 1  # keep the last pair: it yields the next first draft
        absorb_head_pairs(model, seq, n, seq.pending_tokens)
        seq.pending_tokens = seq.pending_tokens[n:]


def mtp_round(model: MTPModel, seq: Sequence) -> Emitted:
    K, params = seq.depth, seq.params

    # 1. Draft: the head over the owed pairs gives d1; then chain on its own hidden.
    #    Everything stays lazy until acceptance needs the numbers.
    hidden, logits = model.draft(seq.pending_hidden, mx.array([seq.pending_tokens]), seq.head_cache)
    hidden, draft_logits = hidden[:, -1:], logits[0, -1:]
    drafts, q_rows = [], []
    for j in range(K):
        q = target_logprobs(draft_logits, params, seq.history, mx.concatenate(drafts) if drafts else None)
        d = choose(q, params, seq.rng)
        drafts.append(d)
        q_rows.append(q)
        if j < K - 1:
            hidden, logits = model.draft(hidden, d[None], seq.head_cache)
            draft_logits = logits[0, -1:]
    drafts = mx.concatenate(drafts)

    # 2. Verify: one backbone pass over [x, d1..dK], capturing GDN state per position.
    set_capture(seq.cache, True)
    verify_hidden, verify_logits = model.forward(mx.concatenate([mx.array([seq.primary]), drafts])[None], seq.cache)
    set_capture(seq.cache, False)
    p = target_logprobs(verify_logits[0], params, seq.history, drafts)

    # 3. Accept.
    if params.greedy:
        target = mx.argmax(p, axis=-1)
        mx.eval(drafts, target)
        draft_list = drafts.tolist()
        m, token = accept_greedy(draft_list, target.tolist())
    else:
        m, token = rejection_sample(drafts, p, mx.concatenate(q_rows), seq.rng)
        draft_list = drafts.tolist()

    # 4. Commit: keep GDN state after m+1 positions, trim KV, drop speculative head entries.
    commit_verify(seq.cache, accepted_tokens=m + 1, verified_tokens=K + 1)
    if K > 1:
        seq.head_cache.trim(K - 1)
    emitted = draft_list[:m] + [token]
    seq.pending_hidden = verify_hidden[:, : m + 1]
    seq.pending_tokens = emitted
    seq.primary = token
    seq.stats.backbone_passes += 1
    seq.stats.record_round(K, m)
    return emitted, p[: m + 1]


def _pad_right(x: mx.array, n: int) -> mx.array:
    return mx.pad(x, [(0, 0), (0, n - x.shape[1]), (0, 0)]) if x.shape[1] < n else x


def _head_over_owed(model: MTPModel, batch: Batch, keep_last: bool) -> Tuple[mx.array, mx.array]:
    """Run the batched head over each row's owed pairs (right-padded to a common length).

    Returns the head's hidden and logits at each row's last pair [B,1,H], [B,V].
    With keep_last, each row's last pair stays owed (absorbing a backlog).
    """
    seqs = batch.seqs
    take = [len(s.pending_tokens) - (1 if keep_last else 0) for s in seqs]
    N = max(take)
    hidden = mx.concatenate([_pad_right(s.pending_hidden[:, :n], N) for s, n in zip(seqs, take)])
    tokens = mx.array([s.pending_tokens[:n] + [0] * (N - n) for s, n in zip(seqs, take)])
    out, logits = model.draft(hidden, tokens, batch.head_cache[0])
    batch.head_cache[0].trim_rows([N - n for n in take])  # the padding entries
    last = mx.array([n - 1 for n in take])
    rows = mx.arange(len(seqs))
    if keep_last:
        mx.eval(batch.head_cache[0].state)
        for s, n in zip(seqs, take):
            s.pending_hidden, s.pending_tokens = s.pending_hidden[:, n:], s.pending_tokens[n:]
    return out[rows, last][:, None], logits[rows, last]


def batched_round(model: MTPModel, batch: Batch, K: int) -> List[Emitted]:
    """One round for every row of `batch`: K drafts each (K=0: plain batched step).

    Rows share the forward passes but not their fate: each row is sampled with
    its own parameters, accepts its own number of drafts and is rolled back by
    its own count. Returns each row's emitted tokens (and target log-probs).
    """
    seqs = batch.seqs
    B = len(seqs)

    # 1. Draft: the batched head over each row's owed pairs gives d1; then chain.
    drafts = None
    q_rows: List[List[mx.array]] = [[] for _ in seqs]
    if K > 0:
        hidden, step_logits = _head_over_owed(model, batch, keep_last=False)
        columns = []
        for j in range(K):
            prev = mx.stack(columns, axis=1) if columns else None
            col = []
            for i, s in enumerate(seqs):
                q = target_logprobs(step_logits[i : i + 1], s.params, s.history, prev[i] if prev is not None else None)
                q_rows[i].append(q)
                col.append(choose(q, s.params, s.rng))
            columns.append(mx.concatenate(col))
            if j < K - 1:
                hidden, logits = model.draft(hidden, columns[-1][:, None], batch.head_cache[0])
                step_logits = logits[:, -1]
        drafts = mx.stack(columns, axis=1)  # [B, K]

    # 2. Verify: one backbone pass over [B, K+1], capturing GDN state per position
    #    (a plain step, K=0, has nothing to roll back).
    inputs = mx.array([[s.primary] for s in seqs])
    if drafts is not None:
        inputs = mx.concatenate([inputs, drafts], axis=1)
    set_capture(batch.cache, K > 0)
    verify_hidden, verify_logits = model.forward(inputs, batch.cache)
    set_capture(batch.cache, False)
    p = [target_logprobs(verify_logits[i], s.params, s.history, drafts[i] if K else None) for i, s in enumerate(seqs)]

    # 3. Accept, row by row.
    greedy_targets = [mx.argmax(p[i], axis=-1) if s.params.greedy else None for i, s in enumerate(seqs)]
    mx.eval([t for t in greedy_targets if t is not None], drafts if drafts is not None else [])
    draft_lists = drafts.tolist() if drafts is not None else [[] for _ in seqs]
    results = []
    for i, s in enumerate(seqs):
        if s.params.greedy:
            m, token = accept_greedy(draft_lists[i], greedy_targets[i].tolist())
        elif K > 0:
            m, token = rejection_sample(drafts[i], p[i], mx.concatenate(q_rows[i]), s.rng)
        else:
            m, token = 0, choose(p[i], s.params, s.rng).item()
        results.append((m, token))

    # 4. Commit per row: GDN state after m+1 positions, KV trimmed by K-m, head entries
    #    of drafts 2..K dropped, owed pairs up to the new primary.
    if K > 0:
        accepted = mx.array([m + 1 for m, _ in results])
        for c in batch.cache:
            if isinstance(c, SpeculativeGDNCache):
                c.select(accepted)
        trim_rows(batch.cache, [K - m for m, _ in results])
    if K > 1:
        batch.head_cache[0].trim(K - 1)
    emitted_rows: List[Emitted] = []
    for i, (s, (m, token)) in enumerate(zip(seqs, results)):
        emitted = draft_lists[i][:m] + [token]
        owed = verify_hidden[i : i + 1, : m + 1]
        if K > 0:
            s.pending_hidden, s.pending_tokens = owed, emitted
        elif s.tracks_head:
            s.pending_hidden = mx.concatenate([s.pending_hidden, owed], axis=1)
            s.pending_tokens = s.pending_tokens + emitted
        s.primary = token
        s.stats.backbone_passes += 1
        if K > 0:
            s.stats.record_round(K, m)
        emitted_rows.append((emitted, p[i][: m + 1]))
    if K == 0 and batch.uses_mtp and max(len(s.pending_tokens) for s in seqs) > MAX_OWED_PAIRS:
        _head_over_owed(model, batch, keep_last=True)
    return emitted_rows

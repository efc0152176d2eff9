"""Prefill, the plain decode step, and the MTP speculative round.

The round reads top to bottom: draft -> verify -> accept -> commit.

State between rounds (single sequence): the backbone caches hold every
committed token except `seq.primary` (x, the last emitted token); the head
cache holds entries up to two positions before x, and `pending_*` hold the
pairs (H[p], x[p+1]) whose head entries are still owed, the last of which is
(H[x-1], x): running the head over them yields the first draft.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import mlx.core as mx

from mtp_serve.models.caches import commit_verify, set_capture
from mtp_serve.models.mtp_model import MTPModel

from .rejection import accept_greedy, rejection_sample
from .sampling import choose, target_logprobs
from .sequence import Sequence

# (emitted tokens, target log-probabilities rows for them [n, V] or None)
Emitted = Tuple[List[int], Optional[mx.array]]

PREFILL_CHUNK = 1024


def prefill(model: MTPModel, seq: Sequence) -> Emitted:
    """Forward the prompt past what a snapshot already holds, and emit the first token."""
    tokens = seq.prompt[seq.cached_tokens :]
    hiddens = [seq.pending_hidden] if seq.pending_hidden is not None else []
    for i in range(0, len(tokens), PREFILL_CHUNK):
        hidden, logits = model.forward(mx.array([tokens[i : i + PREFILL_CHUNK]]), seq.cache)
        if seq.uses_mtp:
            hiddens.append(hidden)
        mx.eval(logits, hiddens[-1:], [c.state for c in seq.cache])
    lp = target_logprobs(logits[0, -1:], seq.params, seq.history)
    first = choose(lp, seq.params, seq.rng).item()
    if seq.uses_mtp:
        # Owed head pairs (H[p], x[p+1]) from the head cache's end up to the new token.
        seq.pending_hidden = mx.concatenate(hiddens, axis=1) if len(hiddens) > 1 else hiddens[0]
        seq.pending_tokens = seq.prompt[seq.head_cache.offset + 1 :] + [first]
    seq.primary = first
    return [first], lp


def plain_step(model: MTPModel, seq: Sequence) -> Emitted:
    _, logits = model.forward(mx.array([[seq.primary]]), seq.cache)
    lp = target_logprobs(logits[0], seq.params, seq.history)
    token = choose(lp, seq.params, seq.rng).item()
    seq.stats.backbone_passes += 1
    seq.primary = token
    return [token], lp


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

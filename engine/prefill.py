"""Prompt prefill: forward a sequence's prompt into its own caches, then sample its
first token. Chunked and resumable, so a long prompt never stalls running rows
for more than one engine step."""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx

from mtp_serve.models.mtp_model import MTPModel

from .sampling import choose, coupled, position_noise, target_logprobs
from .sequence import Emitted, Sequence

# Longest forward pass of one prefill step (bounds activation memory).
PREFILL_CHUNK = 1024


def prefill(
    model: MTPModel,
    seq: Sequence,
    max_tokens: Optional[int] = None,
    on_checkpoint: Optional[Callable[[Sequence, int], None]] = None,
) -> Optional[Emitted]:
    """Forward the next prompt tokens past those already in the caches.

    With `max_tokens`, forwards at most that many and returns None while prompt
    tokens remain; once the whole prompt is in, samples and returns the first
    token. The head runs over the prompt as it goes (its KV is warm for the first
    draft; only the last position's pair, whose next token is not sampled yet,
    stays owed). `on_checkpoint(seq, n)` is called when the caches hold exactly
    the first n prompt tokens, for each n in `seq.checkpoints`.
    """
    caches, owed = seq.caches, seq.owed
    start = seq.cached_tokens + seq.prefilled
    end = len(seq.prompt) if max_tokens is None else min(len(seq.prompt), start + max_tokens)
    stops = sorted({n for n in seq.checkpoints if start < n < end} | {end})
    i = start
    for stop in stops:
        for j in range(i, stop, PREFILL_CHUNK):
            k = min(stop, j + PREFILL_CHUNK)
            hidden, logits = model.forward(mx.array([seq.prompt[j:k]]), caches.backbone)
            if seq.tracks_head:
                owed.hidden = hidden if owed.hidden is None else mx.concatenate([owed.hidden, hidden], axis=1)
                # Pairs whose next token is in the prompt: the head can take them now.
                done = caches.head.offset
                n = min(k, len(seq.prompt) - 1) - done
                if n > 0:
                    model.draft(owed.hidden[:, :n], mx.array([seq.prompt[done + 1 : done + 1 + n]]), caches.head)
                    owed.hidden = owed.hidden[:, n:]
            mx.eval(logits, owed.hidden if seq.tracks_head else [], [c.state for c in caches.backbone],
                    caches.head.state if seq.tracks_head else [])
            seq.last_logits = logits[:, -1]
        seq.prefilled += stop - i
        i = stop
        if on_checkpoint is not None and stop in seq.checkpoints:
            on_checkpoint(seq, stop)
    if end < len(seq.prompt):
        return None
    allowed = seq.grammar.mask()[None] if seq.grammar is not None else None
    lp = target_logprobs(seq.last_logits, seq.params, seq.history, allowed=allowed)
    noise = position_noise(seq.params.seed, 0, 1, model.vocab_size) if coupled(seq.params) else None
    first = choose(lp, seq.params, seq.rng, noise).item()
    if seq.grammar is not None:
        seq.grammar.consume([first])
    seq.last_logits = None
    if seq.tracks_head:
        owed.tokens = seq.prompt[caches.head.offset + 1 :] + [first]
    seq.primary = first
    return [first], lp


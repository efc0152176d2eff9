"""Prompt prefill: forward a sequence's prompt into its own caches, then sample its
first token. Resumable in chunks (the prompt tokens one engine step prefills,
`--prefill-chunk`), so a long prompt never stalls running rows for more than one
engine step; each chunk runs as forward passes of at most MAX_FORWARD_TOKENS."""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx

from mtp_serve.models.mtp_model import MTPModel

from .sampling import choose, coupled, position_noise, target_logprobs
from .sequence import Emitted, Sequence

# Longest forward pass inside a chunk (bounds activation memory).
MAX_FORWARD_TOKENS = 1024


def prefill(
    model: MTPModel,
    seq: Sequence,
    chunk: Optional[int] = None,
    on_checkpoint: Optional[Callable[[Sequence, int], None]] = None,
) -> Optional[Emitted]:
    """Forward the next prompt tokens past those already in the caches.

    With `chunk`, forwards up to the next multiple of it and returns None
    while prompt tokens remain; once the whole prompt is in, samples and returns
    the first token. The head runs over the prompt as it goes (its KV is warm
    for the first draft), up to the pair of the last forwarded position, which
    stays owed. `on_checkpoint(seq, n)` is called when the caches hold exactly
    the first n prompt tokens, for each n in `seq.checkpoints`: with the last
    pair owed, the state there is what a prompt that goes on differently after
    those n tokens needs (a prompt-cache snapshot).

    Forward passes end at multiples of `chunk` and of MAX_FORWARD_TOKENS and at
    the checkpoints, wherever prefill started: the state after a prefix is then
    computed by the same passes whether or not it was restored from a snapshot
    taken at a checkpoint (bit for bit, so a restored run drafts exactly as a
    cold one).
    """
    caches, owed, images = seq.caches, seq.owed, seq.images
    start = seq.cached_tokens + seq.prefilled
    end = len(seq.prompt) if chunk is None else min(len(seq.prompt), (start // chunk + 1) * chunk)
    if images is not None:
        # The vision tower runs for an image when prefill first reaches it: a block a step
        # when chunked (running rows decode between the pieces), all at once otherwise.
        while images.encode_next(start, end):
            if chunk is not None:
                return None
    ends = {n for n in seq.checkpoints if start < n < end} | {end}
    ends |= set(range((start // MAX_FORWARD_TOKENS + 1) * MAX_FORWARD_TOKENS, end, MAX_FORWARD_TOKENS))
    j = start
    for k in sorted(ends):
        tokens = seq.prompt[j:k]  # one forward pass
        if images is None:
            hidden, logits = model.forward(mx.array([tokens]), caches.backbone, last_logits=True)
        else:
            hidden, logits = model.forward(mx.array([tokens]), caches.backbone, last_logits=True,
                                           embeds=images.embeds(model.inner.embed_tokens, tokens, j), rope=images.rope(j, k))
        if seq.tracks_head:
            owed.hidden = hidden if owed.hidden is None else mx.concatenate([owed.hidden, hidden], axis=1)
            # Pairs whose next token is forwarded: the head takes them now.
            done = caches.head.offset
            n = k - 1 - done
            if n > 0:
                model.draft(owed.hidden[:, :n], mx.array([seq.prompt[done + 1 : done + 1 + n]]), caches.head,
                            images.rope(done, done + n) if images is not None else None)
                owed.hidden = owed.hidden[:, n:]
        mx.eval(logits, owed.hidden if seq.tracks_head else [], [c.state for c in caches.backbone],
                caches.head.state if seq.tracks_head else [])
        seq.last_logits = logits[:, -1]
        seq.prefilled += k - j
        j = k
        if on_checkpoint is not None and k in seq.checkpoints:
            on_checkpoint(seq, k)
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


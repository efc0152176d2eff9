"""A request's whole decoding state: tokens, sampling, caches and MTP bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

import mlx.core as mx

from .sampling import Rng, SamplingParams, TokenHistory
from .stats import DecodeStats


@dataclass
class Sequence:
    prompt: List[int]
    params: SamplingParams
    depth: int  # drafts per round; 0 = plain decoding
    cache: List[Any]
    head_cache: Optional[Any]
    rng: Rng
    history: TokenHistory
    stats: DecodeStats
    # The last sampled token: committed to the output, not yet forwarded.
    primary: Optional[int] = None
    # Backbone hiddens whose head-KV entries are still owed, and the token that
    # follows each of them (the head's entry at p is f(H[p], emb(x[p+1]))).
    pending_hidden: Optional[mx.array] = None
    pending_tokens: List[int] = field(default_factory=list)
    output: List[int] = field(default_factory=list)  # tokens returned to the client
    committed: List[int] = field(default_factory=list)  # every token a step emitted (before stop trimming)
    cached_tokens: int = 0  # prompt tokens whose state came from a snapshot
    prefilled: int = 0  # prompt tokens forwarded so far (after the cached ones)
    last_logits: Optional[mx.array] = None  # logits at the last prefilled position
    # Prompt lengths at which prefill stops for a prompt-cache snapshot (e.g. where the
    # generation prompt starts: an agent's next turn shares everything before it).
    checkpoints: tuple = ()

    def cache_tokens(self) -> List[int]:
        """The tokens the backbone caches hold now (all but the primary)."""
        return self.prompt + self.committed[:-1]

    # True when the model has an MTP head: the head's KV and owed pairs are kept
    # up to date even while not drafting, so drafting can start in any round.
    tracks_head: bool = False

    @property
    def uses_mtp(self) -> bool:
        return self.depth > 0


def new_sequence(model, prompt: List[int], params: SamplingParams, depth: int, prompt_cache=None,
                 checkpoints: tuple = ()) -> Sequence:
    """A fresh sequence; with `prompt_cache`, starts from the longest reusable snapshot."""
    if not prompt:
        raise ValueError("the prompt must contain at least one token")
    depth = depth if model.has_mtp else 0
    seq = Sequence(
        tracks_head=model.has_mtp,
        prompt=list(prompt),
        params=params,
        depth=depth,
        cache=model.make_cache(),
        head_cache=model.make_head_cache() if model.has_mtp else None,
        rng=Rng(params.seed),
        history=TokenHistory.start(model.vocab_size, prompt) if params.has_penalties else TokenHistory(model.vocab_size),
        stats=DecodeStats(depth=depth, prompt_tokens=len(prompt)),
        checkpoints=tuple(checkpoints),
    )
    snap = prompt_cache.lookup(prompt, needs_head=seq.tracks_head) if prompt_cache is not None else None
    if snap is not None:
        seq.cache, head_cache, seq.pending_hidden = snap.restore()
        if seq.tracks_head:
            seq.head_cache = head_cache
        else:
            seq.pending_hidden = None
        seq.cached_tokens = seq.stats.cached_tokens = len(snap.tokens)
    return seq

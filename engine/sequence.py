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
    output: List[int] = field(default_factory=list)

    @property
    def uses_mtp(self) -> bool:
        return self.depth > 0 and self.head_cache is not None


def new_sequence(model, prompt: List[int], params: SamplingParams, depth: int) -> Sequence:
    if not prompt:
        raise ValueError("the prompt must contain at least one token")
    depth = depth if model.has_mtp else 0
    return Sequence(
        prompt=list(prompt),
        params=params,
        depth=depth,
        cache=model.make_cache(),
        head_cache=model.make_head_cache() if depth > 0 else None,
        rng=Rng(params.seed),
        history=TokenHistory.start(model.vocab_size, prompt) if params.has_penalties else TokenHistory(model.vocab_size),
        stats=DecodeStats(depth=depth, prompt_tokens=len(prompt)),
    )

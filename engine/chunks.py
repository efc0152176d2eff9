"""What a request receives as rounds commit tokens: `GenerationChunk`s."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import mlx.core as mx

from .sampling import normalize
from .stats import DecodeStats


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: List[tuple] = field(default_factory=list)  # [(token, logprob)], best first


@dataclass
class GenerationChunk:
    token_ids: List[int]
    text: str
    finish_reason: Optional[str]
    stats: DecodeStats
    logprobs: Optional[List[TokenLogprob]] = None


# What a token the sampling filters removed (log-probability -inf) reports: JSON has
# no infinity, and OpenAI-compatible servers (vLLM) use this floor.
LOGPROB_FLOOR = -9999.0


def token_logprobs(tokens: List[int], rows: mx.array, top_n: int) -> List[TokenLogprob]:
    """Log-probabilities of the emitted tokens under the target distribution (the
    one sampled from: after penalties, temperature and the top-k/top-p/min-p filters)."""
    rows = normalize(rows[: len(tokens)])  # greedy rows come unnormalized
    rows = mx.where(mx.isnan(rows), LOGPROB_FLOOR, mx.maximum(rows, LOGPROB_FLOOR))  # JSON has no NaN either
    chosen = rows[mx.arange(len(tokens)), mx.array(tokens)]
    if top_n > 0:
        top_idx = mx.argsort(-rows, axis=-1)[:, :top_n]
        top_val = mx.take_along_axis(rows, top_idx, axis=-1)
        mx.eval(chosen, top_idx, top_val)
        tops = [list(zip(i, v)) for i, v in zip(top_idx.tolist(), top_val.tolist())]
    else:
        tops = [[] for _ in tokens]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(tokens, chosen.tolist(), tops)]

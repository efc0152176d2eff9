"""The sampling pipeline, shared by plain decoding, drafting and verification.

Exactness of speculative sampling needs the draft distribution q and the
target distribution p to come from the same pipeline the plain sampler uses:
penalties (with the drafted prefix counted in the history), temperature,
top-k, top-p, min-p. The filters are mlx-lm's own.

How a token is drawn from a row of log-probabilities, by request:
- greedy: the argmax;
- seeded (`seed` given): argmax(log p + g), with g Gumbel noise that is a pure
  function of (seed, output position) (Gumbel-max: an exact draw from p). The
  token at a position then depends only on the seed and the distribution there,
  never on how rounds were cut, what shared the batch, or whether MTP was on:
  a seeded request is reproducible everywhere. Drafts use the same noise, and
  verification accepts a draft when the target draw with that noise equals it;
- unseeded: a categorical draw from a per-request key stream, and rejection
  sampling for drafts (higher acceptance than the coupling above).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

import mlx.core as mx
from mtp_serve.models.mlx_lm_compat import apply_min_p, apply_top_k, apply_top_p

from .grammar import Constraint, apply_mask


# Temperatures below this decode greedily (as vLLM does): dividing fp32 logits by a
# smaller one overflows to inf, and the pipeline would return NaN.
GREEDY_BELOW = 1e-5
# Repetition penalties outside this range overflow fp32 logits the same way.
REPETITION_PENALTY_RANGE = (1e-6, 1e6)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None
    max_tokens: int = 256
    stop: tuple = ()
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # number of top alternatives to report; 0 = only the chosen token
    constraint: Optional[Constraint] = None  # a grammar the output must match (engine/grammar.py)
    copy_drafts: bool = True  # speculation may also draft tokens copied from the context (engine/context_drafts.py)

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        lo, hi = REPETITION_PENALTY_RANGE
        if not lo <= self.repetition_penalty <= hi:
            raise ValueError(f"repetition_penalty must be in [{lo:g}, {hi:g}]")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


MASK64 = (1 << 64) - 1


def position_key(seed: int, position: int) -> mx.array:
    """A PRNG key per (seed, output position): splitmix64 of both, so nearby seeds
    and positions give unrelated keys."""
    z = ((seed & MASK64) * 0x9E3779B97F4A7C15 + (position + 1) * 0xD1B54A32D192ED03) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return mx.random.key(z ^ (z >> 31))


def position_noise(seed: int, start: int, n: int, vocab: int) -> mx.array:
    """Gumbel noise [n, V] for output positions start .. start+n-1 of a seeded request."""
    return mx.stack([mx.random.gumbel((vocab,), key=position_key(seed, start + i)) for i in range(n)])


def coupled(params: "SamplingParams") -> bool:
    """Seeded sampling: tokens drawn with per-position noise (see the module doc)."""
    return not params.greedy and params.seed is not None


def random_seed() -> int:
    return int.from_bytes(os.urandom(8), "little")


class Rng:
    """A per-request stream of PRNG keys for unseeded sampling (from a random seed,
    or a given one: ranks serving one request together start from the same)."""

    def __init__(self, seed: Optional[int] = None):
        self._key = mx.random.key(random_seed() if seed is None else seed)

    def next(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub


@dataclass
class TokenHistory:
    """What the penalties look at: prompt tokens seen, and counts of generated tokens."""

    vocab_size: int
    prompt_seen: Optional[mx.array] = None  # [V] float 0/1
    output_counts: Optional[mx.array] = None  # [V] float
    _pending: list = field(default_factory=list)

    @classmethod
    def start(cls, vocab_size: int, prompt: Sequence[int]) -> "TokenHistory":
        seen = mx.zeros((vocab_size,), mx.float32)
        if len(prompt):
            seen[mx.array(list(prompt))] = 1.0
        return cls(vocab_size, seen, mx.zeros((vocab_size,), mx.float32))

    def add(self, tokens: Sequence[int]) -> None:
        if len(tokens) and self.output_counts is not None:
            self.output_counts = self.output_counts.at[mx.array(list(tokens))].add(1.0)


def apply_penalties(logits: mx.array, params: SamplingParams, history: TokenHistory, appended: Optional[mx.array]) -> mx.array:
    """logits [T, V]; `appended` [A] are drafted tokens not yet in `history`.

    The rows are the last T positions: row i counts appended[:A-T+1+i] as
    generated (a verify of [x, d1..dK] has T=K+1, A=K; the draft of d_{j+1}
    has T=1, A=j).
    """
    counts = history.output_counts[None]
    if appended is not None and appended.size:
        T, A = logits.shape[0], appended.shape[0]
        onehot = (appended[:, None] == mx.arange(history.vocab_size)[None]).astype(mx.float32)
        prefix = mx.concatenate([mx.zeros((1, history.vocab_size)), mx.cumsum(onehot, axis=0)], axis=0)
        counts = counts + prefix[A + 1 - T :]
    if params.repetition_penalty != 1.0:
        seen = (counts > 0) | (history.prompt_seen[None] > 0)
        penalized = mx.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = mx.where(seen, penalized, logits)
    if params.frequency_penalty:
        logits = logits - params.frequency_penalty * counts
    if params.presence_penalty:
        logits = logits - params.presence_penalty * (counts > 0)
    return logits


def filtered_logprobs(logits: mx.array, params: SamplingParams) -> mx.array:
    """Temperature, then top-k, top-p, min-p; returns normalized log-probabilities [T, V]."""
    logprobs = logits / params.temperature if not params.greedy else logits
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    vocab = logprobs.shape[-1]
    if 0 < params.top_k < vocab:
        logprobs = apply_top_k(logprobs, params.top_k)
    if params.top_p < 1.0:
        # As an array, not a float: mx.compile bakes float arguments into the kernel it builds,
        # so every top_p value a client sends would compile (seconds on g++) a kernel of its own.
        logprobs = apply_top_p(logprobs, mx.array(params.top_p, mx.float32))
    if params.min_p > 0:
        logprobs = apply_min_p(logprobs, params.min_p)
    return logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)


def target_logprobs(
    logits: mx.array, params: SamplingParams, history: TokenHistory, appended: Optional[mx.array] = None,
    allowed: Optional[mx.array] = None,
) -> mx.array:
    """The full pipeline over logits [T, V] (fp32): what the sampler draws from.
    `allowed` [T, V] (a grammar's masks) removes tokens first.

    Greedy requests get the (penalized) logits unnormalized: the argmax is all
    they need, and filters never remove the argmax. `normalize` them to report
    log-probabilities.
    """
    logits = apply_mask(logits.astype(mx.float32), allowed)
    if params.has_penalties:
        logits = apply_penalties(logits, params, history, appended)
    if params.greedy:
        return logits
    return filtered_logprobs(logits, params)


def normalize(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def choose(logprobs: mx.array, params: SamplingParams, rng: Rng, noise: Optional[mx.array] = None) -> mx.array:
    """One token per row: argmax when greedy, argmax(log p + noise) for a seeded
    request (its position noise), else a draw from the distribution."""
    if params.greedy:
        return mx.argmax(logprobs, axis=-1)
    if noise is not None:
        return mx.argmax(logprobs + noise, axis=-1)
    return mx.random.categorical(logprobs, key=rng.next())

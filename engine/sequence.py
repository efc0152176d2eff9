"""A request's whole decoding state, and what a round's result does to it.

Lifecycle (`Sequence.status`):

    PREFILLING --prefill done--> RUNNING --stop/length--> FINISHED
         \\________________ cancel ______________/--> CANCELLED

Cache ownership, one owner at a time: while PREFILLING the sequence owns its
caches (`seq.caches`); when it starts RUNNING it hands them to the `Batch`
(`take_caches`), which merges them with the other rows' and drops them when the
row leaves (a snapshot of them is a copy: `Batch.row_caches`).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, List, Optional, Tuple

import mlx.core as mx

from .chunks import GenerationChunk, token_logprobs
from .context_drafts import ContextIndex, CopyCap
from .grammar import RowGrammar
from .image_prompt import ImagePrompt
from .sampling import Rng, SamplingParams, TokenHistory
from .stats import DecodeStats
from .stopping import StopChecker

# (emitted tokens, target log-probability rows for them [n, V] or None)
Emitted = Tuple[List[int], Optional[mx.array]]


class Status(enum.Enum):
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"


@dataclass
class RowCaches:
    """One row's model state: backbone caches (one per layer) and the MTP head's KV."""

    backbone: List[Any]
    head: Optional[Any]


@dataclass
class OwedPairs:
    """Head entries not computed yet: the head's entry at position p is
    f(H[p], emb(x[p+1])); `hidden` holds those H[p] and `tokens` those x[p+1].
    The last pair is (H[x-1], x) for the primary x: running the head over the
    pairs yields the first draft."""

    hidden: Optional[mx.array] = None  # [1, n, H]
    tokens: List[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, hidden: mx.array, tokens: List[int]) -> None:
        self.hidden = hidden if self.hidden is None else mx.concatenate([self.hidden, hidden], axis=1)
        self.tokens = self.tokens + tokens

    def drop_first(self, n: int) -> None:
        self.hidden, self.tokens = self.hidden[:, n:], self.tokens[n:]


@dataclass
class RowAcceptance:
    """This row's own acceptance per draft position, conditional on reaching it
    (a_j = P(draft j accepted | drafts 1..j-1 accepted)), as moving averages."""

    rates: List[float]  # starts from the model-wide estimate (the policy's), one per position
    idle_rounds: int = 0  # rounds since the row last drafted (its estimates age)
    failed_probes: int = 0  # drafting rounds in a row, after idling, that accepted nothing

    def observe(self, depth: int, accepted: int, weight: float, start: Callable[[int], float]) -> None:
        """Record a round that drafted `depth` and accepted `accepted`; a position never
        estimated before starts from `start(position)`."""
        if depth == 0:
            self.idle_rounds += 1
            return
        if self.idle_rounds:
            self.failed_probes = self.failed_probes + 1 if accepted == 0 else 0
        self.idle_rounds = 0
        ema_update(self.rates, depth, accepted, weight, start)

    def expected_tokens(self, depth: int, prior: float) -> float:
        """1 + a1 + a1*a2 + ...: tokens a round with `depth` drafts emits on average."""
        total, run = 1.0, 1.0
        for j in range(depth):
            run *= self.rates[j] if j < len(self.rates) else prior
            total += run
        return total


def ema_update(rates: List[float], depth: int, accepted: int, weight: float, start: Callable[[int], float]) -> None:
    """Moving averages of conditional acceptance per draft position, from one round."""
    for j in range(min(depth, accepted + 1)):  # positions the round reached
        if j >= len(rates):
            rates.append(start(j))
        rates[j] += weight * ((1.0 if j < accepted else 0.0) - rates[j])


@dataclass(eq=False)
class Sequence:
    key: Hashable
    prompt: List[int]
    params: SamplingParams
    max_depth: int  # drafts per round this request allows; 0 = plain decoding
    rng: Rng
    history: TokenHistory
    stats: DecodeStats
    stops: StopChecker
    acceptance: RowAcceptance
    caches: Optional[RowCaches]  # None while a Batch owns them
    status: Status = Status.PREFILLING
    # The last sampled token: committed to the output, not yet forwarded.
    primary: Optional[int] = None
    owed: OwedPairs = field(default_factory=OwedPairs)
    tracks_head: bool = False  # the model has a head: its KV is kept current even at depth 0
    output: List[int] = field(default_factory=list)  # tokens returned to the client
    committed: List[int] = field(default_factory=list)  # every token a round emitted (before stop trimming)
    cached_tokens: int = 0  # prompt tokens whose state came from a snapshot
    prefilled: int = 0  # prompt tokens forwarded so far (after the cached ones)
    last_logits: Optional[mx.array] = None  # logits at the last prefilled position
    # Prompt lengths at which prefill stops for a prompt-cache snapshot.
    checkpoints: tuple = ()
    grammar: Optional[RowGrammar] = None  # the matcher of a constrained request, at the output so far
    images: Optional[ImagePrompt] = None  # the prompt's images (vision-language models)
    context: Optional[ContextIndex] = None  # prompt and committed tokens indexed for copy drafts (built on first use)
    copy_cap: CopyCap = field(default_factory=CopyCap)
    copy_order: int = 0  # the n-gram length the row's last copy matched
    started: float = field(default_factory=time.perf_counter)  # phase start, for stats

    @property
    def finished(self) -> bool:
        return self.status in (Status.FINISHED, Status.CANCELLED)

    @property
    def tokens_left(self) -> int:
        """Tokens the request may still emit (max_tokens less those emitted)."""
        return self.params.max_tokens - len(self.committed)

    @property
    def context_length(self) -> int:
        """Tokens the row's attention reads: its prompt and every committed token."""
        return len(self.prompt) + len(self.committed)

    @property
    def prompt_key(self) -> List[int]:
        """The prompt as the prompt cache keys it (images by their content, `ImagePrompt.key`)."""
        return self.prompt if self.images is None else self.images.key

    def cache_tokens(self) -> List[int]:
        """The prompt-cache key of what the backbone caches hold while running (all but the primary)."""
        return self.prompt_key + self.committed[:-1]

    def context_index(self) -> ContextIndex:
        """The index of the prompt and every committed token, brought up to date."""
        if self.context is None:
            self.context = ContextIndex(self.prompt)
        have = len(self.context) - len(self.prompt)
        if have < len(self.committed):
            self.context.extend(self.committed[have:])
        return self.context

    def take_caches(self) -> RowCaches:
        """Hand the caches over (to a batch); the sequence no longer owns them."""
        caches, self.caches = self.caches, None
        if caches is None:
            raise RuntimeError(f"request {self.key!r}: its caches are owned elsewhere")
        return caches

    def start_from(self, n: int, caches: RowCaches, owed_hidden: Optional[mx.array]) -> None:
        """Before prefill: start from a prompt-cache snapshot of the first n prompt tokens."""
        self.caches = RowCaches(caches.backbone, caches.head if self.tracks_head else None)
        if self.tracks_head:
            self.owed.hidden = owed_hidden
        self.cached_tokens = self.stats.cached_tokens = n
        if self.images is not None:  # caches that keep per-token positions (qwen4_exp's indexer) get them back
            for c in self.caches.backbone:
                if hasattr(c, "place_positions"):
                    c.place_positions(self.images.positions[:, :n])

    def apply(self, emitted: Emitted) -> GenerationChunk:
        """What a step's tokens do to the request: committed, stop-checked (kept
        tokens only count), history and stats updated. Returns what the client gets."""
        tokens, lp_rows = emitted
        self.committed += tokens
        kept, text = self.stops.feed(tokens)
        self.output += kept
        self.history.add(kept)
        self.stats.generated_tokens += len(kept)
        now = time.perf_counter()
        if self.status is Status.PREFILLING:
            self.stats.prefill_s = now - self.started
            self.started = now
        else:
            self.stats.decode_s = now - self.started
        logprobs = None
        if self.params.logprobs is not None and kept:
            logprobs = token_logprobs(kept, lp_rows, self.params.logprobs)
        if self.stops.finish_reason:
            self.status = Status.FINISHED
        return GenerationChunk(kept, text, self.stops.finish_reason, self.stats, logprobs)


def new_sequence(model, tokenizer, key: Hashable, prompt: List[int], params: SamplingParams, max_depth: int,
                 checkpoints: tuple = (), prior_acceptance: Optional[List[float]] = None,
                 grammar: Optional[RowGrammar] = None, images: tuple = ()) -> Sequence:
    """A fresh sequence with empty caches; `grammar`: the matcher of `params.constraint`;
    `images`: the prompt's prepared images, in order (its image-pad runs)."""
    if not prompt:
        raise ValueError("the prompt must contain at least one token")
    image_prompt = None
    if images:
        if getattr(model, "vision", None) is None:
            raise ValueError("this model has no vision tower: it cannot take images")
        image_prompt = ImagePrompt(prompt, images, model.vision)
        checkpoints = tuple(n for n in checkpoints if not image_prompt.inside(n))
    max_depth = max_depth if model.has_mtp else 0
    return Sequence(
        key=key,
        tracks_head=model.has_mtp,
        prompt=list(prompt),
        params=params,
        max_depth=max_depth,
        rng=Rng(),
        history=TokenHistory.start(model.vocab_size, prompt) if params.has_penalties else TokenHistory(model.vocab_size),
        stats=DecodeStats(depth=max_depth, prompt_tokens=len(prompt)),
        stops=StopChecker(tokenizer, params),
        acceptance=RowAcceptance(list(prior_acceptance or [])),
        caches=RowCaches(model.make_cache(), model.make_head_cache() if model.has_mtp else None),
        checkpoints=tuple(checkpoints),
        grammar=grammar,
        images=image_prompt,
    )

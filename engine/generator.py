"""One generator for both paths: prompt tokens in, committed tokens and stats out.

    for chunk in generate(model, tokenizer, prompt_ids, params, depth=2): ...

`depth=0` (or a model without an MTP head) decodes plainly; otherwise each
step is one MTP round that commits 1..depth+1 tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, List, Optional

import mlx.core as mx

from mtp_serve.models.mtp_model import MTPModel

from .prompt_cache import PromptCache, checkpoint_saver, sequence_snapshot
from .sampling import SamplingParams, normalize
from .sequence import Sequence, new_sequence
from .speculative import Emitted, mtp_round, plain_step, prefill
from .stats import DecodeStats
from .stopping import StopChecker


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
    rows = mx.maximum(normalize(rows[: len(tokens)]), LOGPROB_FLOOR)  # greedy rows come unnormalized
    chosen = rows[mx.arange(len(tokens)), mx.array(tokens)]
    if top_n > 0:
        top_idx = mx.argsort(-rows, axis=-1)[:, :top_n]
        top_val = mx.take_along_axis(rows, top_idx, axis=-1)
        mx.eval(chosen, top_idx, top_val)
        tops = [list(zip(i, v)) for i, v in zip(top_idx.tolist(), top_val.tolist())]
    else:
        tops = [[] for _ in tokens]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(tokens, chosen.tolist(), tops)]


def decode_step(model: MTPModel, seq: Sequence) -> Emitted:
    return mtp_round(model, seq) if seq.uses_mtp else plain_step(model, seq)


def run_sequence(model: MTPModel, tokenizer, seq: Sequence, prompt_cache=None) -> Iterator[GenerationChunk]:
    """Drive `seq` to completion, yielding committed tokens; one model step per `next()`.

    With `prompt_cache`, snapshots are stored after the prompt and at the end.
    """
    stops = StopChecker(tokenizer, seq.params)
    stats = seq.stats
    t0 = time.perf_counter()
    step = lambda: prefill(model, seq, on_checkpoint=checkpoint_saver(prompt_cache))  # noqa: E731
    first = True
    while True:
        tokens, lp_rows = step()
        seq.committed += tokens
        if first:
            stats.prefill_s = time.perf_counter() - t0
            t0, first, step = time.perf_counter(), False, (lambda: decode_step(model, seq))
            if prompt_cache is not None:
                prompt_cache.store(sequence_snapshot(seq, seq.prompt))
        kept, text = stops.feed(tokens)
        seq.output += kept
        seq.history.add(kept)
        stats.generated_tokens += len(kept)
        stats.decode_s = time.perf_counter() - t0
        logprobs = None
        if seq.params.logprobs is not None and kept:
            logprobs = token_logprobs(kept, lp_rows, seq.params.logprobs)
        if stops.finish_reason and prompt_cache is not None:
            prompt_cache.store(sequence_snapshot(seq, seq.cache_tokens()))
        yield GenerationChunk(kept, text, stops.finish_reason, stats, logprobs)
        if stops.finish_reason:
            return


def generate(
    model: MTPModel,
    tokenizer,
    prompt: List[int],
    params: SamplingParams,
    depth: int = 0,
    prompt_cache: Optional[PromptCache] = None,
    checkpoints: tuple = (),
) -> Iterator[GenerationChunk]:
    seq = new_sequence(model, prompt, params, depth, prompt_cache, checkpoints)
    return run_sequence(model, tokenizer, seq, prompt_cache)

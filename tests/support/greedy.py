"""Greedy decoding of a loaded model, single and batched, for the identity tests."""

from __future__ import annotations

from typing import List, Tuple

from mtp_serve.engine.generator import generate
from mtp_serve.engine.policy import DepthPolicy
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.engine.scheduler import Scheduler


def greedy(lm, prompt: List[int], depth: int, tokens: int, **generate_kw) -> Tuple[List[int], object]:
    """`tokens` greedy tokens (EOS ignored) at a fixed depth, and the last chunk's stats."""
    out, stats = [], None
    for chunk in generate(lm.model, lm.tokenizer, prompt, SamplingParams(max_tokens=tokens, ignore_eos=True), depth,
                          **generate_kw):
        out += chunk.token_ids
        stats = chunk.stats
    return out, stats


def batched_greedy(lm, prompts: List[List[int]], depth: int, tokens: int) -> List[List[int]]:
    """The prompts decoded together in one batch, at a fixed depth: each row's tokens."""
    sched = Scheduler(lm.model, lm.tokenizer, max_batch_size=4, prefill_chunk=16,
                      policy=DepthPolicy(max_depth=depth, fixed=True))
    for i, p in enumerate(prompts):
        sched.add(i, p, SamplingParams(max_tokens=tokens, ignore_eos=True), depth)
    out = {i: [] for i in range(len(prompts))}
    while sched.has_work():
        for key, chunk in sched.step():
            assert not isinstance(chunk, Exception), chunk
            out[key] += chunk.token_ids
    return [out[i] for i in range(len(prompts))]

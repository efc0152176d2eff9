"""logit_bias moves the sampler (greedy included), and MTP stays exact under it: the
bias is part of the pipeline both the drafts and the verify are scored with."""

import pytest

from mtp_serve.engine.generator import generate
from mtp_serve.engine.sampling import SamplingParams

PROMPT = [3, 4, 5, 6, 7]


def tokens(lm, params, depth):
    out, drafted = [], 0
    for c in generate(lm.model, lm.tokenizer, PROMPT, params, depth):
        out += c.token_ids
        if c.finish_reason:
            drafted = sum(c.stats.drafted)
    return out, drafted


def test_a_large_bias_forces_its_token_greedy_and_sampled(loaded):
    lm = loaded("qwen3_5", agreeable=True)
    for kw in ({}, {"temperature": 1.0, "seed": 5}, {"temperature": 1.0}):
        out, _ = tokens(lm, SamplingParams(max_tokens=12, ignore_eos=True, logit_bias=((77, 100.0),), **kw), 2)
        assert out == [77] * 12, kw


def test_a_negative_bias_removes_the_greedy_choice(loaded):
    lm = loaded("qwen3_5", agreeable=True)
    plain, _ = tokens(lm, SamplingParams(max_tokens=12, ignore_eos=True), 0)
    banned = sorted(set(plain))
    out, _ = tokens(lm, SamplingParams(max_tokens=12, ignore_eos=True, logit_bias=tuple((t, -100.0) for t in banned)), 2)
    assert not set(out) & set(banned)


@pytest.mark.parametrize("kw", [{}, {"temperature": 0.8, "seed": 11}], ids=["greedy", "seeded"])
def test_mtp_output_with_a_bias_equals_plain_decoding(kw, loaded):
    """Small biases that change which tokens win without forcing one: the speculative
    output (drafts accepted and rejected) equals plain decoding's token for token."""
    lm = loaded("qwen3_5", agreeable=True)
    plain, _ = tokens(lm, SamplingParams(max_tokens=40, ignore_eos=True), 0)
    bias = tuple((t, -3.0) for t in sorted(set(plain))[:3]) + ((9, 2.0), (40, 1.5))
    params = SamplingParams(max_tokens=40, ignore_eos=True, logit_bias=bias, **kw)
    want, _ = tokens(lm, params, 0)
    got, drafted = tokens(lm, params, 2)
    assert want != tokens(lm, SamplingParams(max_tokens=40, ignore_eos=True, **kw), 0)[0], "the bias changed nothing"
    assert drafted > 0
    assert got == want

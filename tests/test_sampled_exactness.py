"""Sampled MTP output has the plain sampler's distribution, for both samplers:
unseeded requests (rejection sampling of the drafts) and seeded ones (per-position
noise, which also makes them reproducible whatever the depth or the batch).

Two-sample chi-square per output position over 1,000 short samples each, at
temperature 1 with top-k and top-p, with penalties and min-p, and with a logit bias, on a model whose head is accepted often
enough that acceptance, rejection-with-correction and bonus tokens all occur. The reference is
plain unseeded sampling, one sample set per model and pipeline, which the seeded and the unseeded
MTP samples, and the negative control, are each compared against.
"""

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chi2_contingency

from mtp_serve.engine.generator import generate
from mtp_serve.engine.prompt_cache import PromptCache
from mtp_serve.engine.sampling import SamplingParams, TokenHistory, target_logprobs

pytestmark = pytest.mark.distribution  # chi-square runs of minutes (conftest.py: test tiers)

N_SAMPLES = 1000
N_POS = 4  # the round after the first token may emit the other 3: at depth 2 it drafts 2 (positions 1, 2)
PROMPT = [11, 22, 33, 44, 55, 66]


def sample_many(lm, depth, seed0, params_kw, n=N_SAMPLES):
    """n samples; seeds seed0, seed0+1, ... (None: unseeded requests)."""
    cache = PromptCache(max_bytes=1 << 20)  # the prompt's snapshot stays (in use), the replies' go
    list(generate(lm.model, lm.tokenizer, PROMPT[:-1], SamplingParams(max_tokens=1, ignore_eos=True), depth, cache))
    seqs, drafted, accepted = [], 0, 0
    for i in range(n):
        params = SamplingParams(max_tokens=N_POS, ignore_eos=True, seed=None if seed0 is None else seed0 + i, **params_kw)
        out = []
        for chunk in generate(lm.model, lm.tokenizer, PROMPT, params, depth, cache):
            out += chunk.token_ids
        seqs.append(out)
        drafted += sum(chunk.stats.drafted)
        accepted += sum(chunk.stats.accepted)
    return seqs, (accepted, drafted)


_PLAIN = {}


def plain_samples(lm, family, sampling):
    """Plain unseeded samples under SAMPLING[sampling]: the reference, drawn once per model and pipeline."""
    if (family, sampling) not in _PLAIN:
        _PLAIN[family, sampling] = sample_many(lm, 0, None, SAMPLING[sampling])[0]
    return _PLAIN[family, sampling]


def chi2_pvalue(a, b):
    keys = sorted(set(a) | set(b))
    table = [[a.count(k) for k in keys], [b.count(k) for k in keys]]
    return chi2_contingency(table)[1] if len(keys) > 1 else 1.0


SAMPLING = {
    "topk-topp": {"temperature": 1.0, "top_k": 3, "top_p": 0.95},
    # Penalties see the drafted prefix as generated history; min-p filters after temperature.
    "penalties-minp": {"temperature": 1.0, "min_p": 0.02, "presence_penalty": 0.5, "frequency_penalty": 1.0,
                       "repetition_penalty": 1.2},
    # The bias is added before everything else, in the drafts' pipeline as in the target's.
    "logit-bias": {"temperature": 1.0, "top_k": 5, "logit_bias": ((9, 3.0), (40, 2.0), (77, 2.5), (100, -1.0))},
}
# qwen4_exp (minutes a case on the 2-core machine) with the first pipeline, unseeded: its own
# backbone and caches under rejection sampling. Its seeded sampler is checked below by equality,
# which implies the distribution the qwen3_5 cases check; the pipelines do not depend on the family.
CASES = [("qwen3_5", name, seeded) for name in SAMPLING for seeded in (False, True)] + [("qwen4_exp", "topk-topp", False)]


@pytest.mark.parametrize("family,sampling,seeded", CASES,
                         ids=[f"{'seeded' if d else 'rejection'}-{f}-{n}" for f, n, d in CASES])
def test_mtp_sampling_matches_plain_distribution(family, sampling, seeded, loaded):
    params_kw = SAMPLING[sampling]
    lm = loaded(family, agreeable=True)
    plain = plain_samples(lm, family, sampling)
    mtp, (accepted, drafted) = sample_many(lm, 2, 10**6 if seeded else None, params_kw)
    assert accepted >= 50 and drafted - accepted >= 50, f"{accepted}/{drafted} accepted: accept and reject paths must both run"
    for pos in range(N_POS):
        p = chi2_pvalue([s[pos] for s in plain], [s[pos] for s in mtp])
        assert p > 0.001, f"position {pos}: distributions differ (p={p:.2g})"
    # Pairs of consecutive tokens (the second is drafted after the first within a round).
    p = chi2_pvalue([tuple(s[1:3]) for s in plain], [tuple(s[1:3]) for s in mtp])
    assert p > 0.001, f"joint distribution of positions 1-2 differs (p={p:.2g})"
    if seeded:  # the same seed reproduces the same sample, with MTP on or off
        assert sample_many(lm, 2, 10**6, params_kw, n=20)[0] == mtp[:20]
        assert sample_many(lm, 0, 10**6, params_kw, n=20)[0] == mtp[:20]


def test_seeded_mtp_sampling_equals_seeded_plain_on_qwen4_exp(loaded):
    """Seeded samples are the same with MTP on or off (so in the plain sampler's distribution),
    with drafts both accepted and rejected along the way."""
    lm = loaded("qwen4_exp", agreeable=True)
    params_kw = SAMPLING["topk-topp"]
    mtp, (accepted, drafted) = sample_many(lm, 2, 10**6, params_kw, n=120)
    assert accepted >= 10 and drafted - accepted >= 10, f"{accepted}/{drafted} accepted"
    assert sample_many(lm, 0, 10**6, params_kw, n=120)[0] == mtp


def test_rejection_sampler_detects_a_wrong_distribution(loaded):
    """The test above has power: MTP samples at another temperature, against the same plain
    reference, are caught."""
    lm = loaded("qwen3_5", agreeable=True)
    plain = plain_samples(lm, "qwen3_5", "topk-topp")
    wrong, _ = sample_many(lm, 2, 10**6, {**SAMPLING["topk-topp"], "temperature": 0.5}, n=600)
    assert min(chi2_pvalue([s[p] for s in plain], [s[p] for s in wrong]) for p in range(N_POS)) < 0.001


def test_verify_and_draft_rows_count_the_drafted_prefix():
    """Row i of a verify over [x, d1..dK] is scored exactly as a plain step would
    score it after d1..di were generated (penalties included); so is draft j+1."""
    V, drafts = 40, [3, 3, 7]
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((len(drafts) + 1, V)).astype(np.float32)
    logits[:, drafts] += 4.0  # likely tokens, so the penalties move what the filters keep
    logits = mx.array(logits)
    history = TokenHistory.start(V, [1, 2, 3])
    history.add([5, 3])
    params = SamplingParams(temperature=0.7, top_k=12, min_p=0.02, presence_penalty=0.5, frequency_penalty=0.3,
                            repetition_penalty=1.2)
    verify = target_logprobs(logits, params, history, mx.array(drafts))
    for i in range(len(drafts) + 1):
        plain = TokenHistory(V, history.prompt_seen, history.output_counts)
        plain.add(drafts[:i])
        want = target_logprobs(logits[i : i + 1], params, plain)[0]
        assert mx.allclose(verify[i], want, atol=1e-6).item(), f"verify row {i}"
        draft_row = target_logprobs(logits[i : i + 1], params, history, mx.array(drafts[:i]) if i else None)[0]
        assert mx.allclose(draft_row, want, atol=1e-6).item(), f"draft {i + 1}"

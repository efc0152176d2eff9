"""Drafts copied from the context (engine/context_drafts.py) keep decoding exact.

Prompts are built so copies fire: a prompt P, the model's own plain greedy continuation G of
it, then P again, so after the second P the context holds exactly what plain decoding writes
next (greedy copies are accepted whole), and agreeable models' outputs that repeat themselves
copy from their own output. Every test asserts that copies were drafted and accepted.

- greedy: copies on == plain greedy, on every synthetic family, 4- and 8-bit bodies and 8-bit
  KV, single and batched beside rows drafting from the head and rows decoding plainly;
- a chain of 40 copied tokens rejected at the 36th rolls the GatedDeltaNet states, KV and the
  head's pairs back exactly (what follows, from the head and plain, equals plain decoding);
- seeded sampling: the same seed gives the same tokens with copies on and off;
- unseeded sampling: a chi-square test against plain sampling, with copies drafted and both
  accepted and rejected, and a negative control (a wrong residual on rejection) that fails it;
- a request with `copy_drafts` off, and a scheduler with `copy_max=0`, never copy.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from scipy.stats import chi2_contingency

from mtp_serve.engine import speculative
from mtp_serve.engine.batch import Batch
from mtp_serve.engine.prefill import prefill
from mtp_serve.engine.sequence import new_sequence
from mtp_serve.engine.speculative import CertainDrafts, run_round
from mtp_serve.engine.context_drafts import PRIOR_RATE, RATE_EMA, ContextIndex, CopyCap
from mtp_serve.engine.policy import DepthPolicy
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.engine.scheduler import Scheduler
from mtp_serve.models.caches import FULL_KV, KVSetting
from mtp_serve.testing.quantized import QUANT_TEXT, quantize_loaded
from mtp_serve.testing.synthetic import MLX_LM_FAMILIES

P = [5, 17, 99, 3, 42, 7, 250, 11, 64, 30]
N = 48


def run(lm, prompt, params, depth=2, copy_max=32, cap=None):
    """Tokens and stats of one request; `cap`: the row's starting copy limit."""
    sched = Scheduler(lm.model, lm.tokenizer, max_batch_size=1, prefill_chunk=None,
                      policy=DepthPolicy(max_depth=depth, fixed=True), copy_max=copy_max)
    sched.add(0, prompt, params, depth)
    if cap is not None:
        sched.seqs[0].copy_cap.limit = cap
    out, stats = [], None
    while sched.has_work():
        for _, chunk in sched.step():
            assert not isinstance(chunk, Exception), chunk
            out += chunk.token_ids
            stats = chunk.stats
    return out, stats


def plain(lm, prompt, n=N, **kw):
    return run(lm, prompt, SamplingParams(max_tokens=n, ignore_eos=True, **kw), depth=0, copy_max=0)[0]


STARTS = [P, [7, 7, 8, 9, 100, 101], [60, 61, 62, 63, 64, 65, 66], [200, 3, 200, 4, 200, 5], list(range(120, 140))]


def copying_prompt(lm, n=24):
    """A start S, plain decoding's continuation G of S, then S again: the first start after
    which plain decoding repeats G's opening (this model's output there follows its context)."""
    for start in STARTS:
        follows = plain(lm, start, n)
        prompt = start + follows + start
        if plain(lm, prompt, 4) == follows[:4]:
            return prompt
    return P + plain(lm, P, n) + P


# ---------------------------------------------------------------- the index


def test_index_proposes_what_followed_the_longest_latest_match():
    index = ContextIndex([1, 2, 3, 4, 9, 7, 2, 3, 4, 5, 0, 2, 3, 4])
    assert index.propose(3) == [5, 0, 2]  # the latest earlier "2 3 4"
    index.extend([5, 0, 1])
    assert index.propose(4) == []  # "5 0 1" never occurred before
    index.extend([2, 3, 4, 9])
    assert index.propose(2) == [7, 2]  # "2 3 4 9" matched at its first occurrence
    built = ContextIndex([1, 2, 3, 4, 9, 7, 2, 3, 4, 5, 0, 2, 3, 4, 5, 0, 1, 2, 3, 4, 9])
    assert built.propose(5) == index.propose(5)  # extending equals building at once
    assert ContextIndex([4, 4, 4]).propose(3) == []  # the newest tokens are never their own match
    assert ContextIndex([4, 4, 4, 4]).propose(3) == [4]


def test_a_prompt_indexed_at_once_proposes_what_token_by_token_indexing_does():
    """The prompt's index is built in one vectorized pass; every proposal, at every order and
    after every extension, equals the token-by-token index's."""
    rng = random.Random(3)

    def more(tokens):  # new tokens or a repeat of a span: matches at every order
        if tokens and rng.random() < 0.5:
            start = rng.randrange(len(tokens))
            return tokens[start : start + rng.randrange(1, 24)]
        return [rng.randrange(40) for _ in range(rng.randrange(1, 24))]

    prompt = []
    while len(prompt) < 4000:
        prompt += more(prompt)
    built, stepped = ContextIndex(prompt), ContextIndex()
    stepped.extend(prompt)
    orders = set()
    for _ in range(300):
        assert built.match(32) == stepped.match(32)
        orders.add(built.match(32)[1])
        tokens = more(built.tokens)
        built.extend(tokens)
        stepped.extend(tokens)
    assert {0, 3, 4, 8, 16} <= orders


# ---------------------------------------------------------------- greedy identity


def assert_copies_exact(lm, label):
    prompt = copying_prompt(lm)
    ref = plain(lm, prompt)
    for depth in (0, 2):
        ours, stats = run(lm, prompt, SamplingParams(max_tokens=N, ignore_eos=True), depth=depth or 1)
        assert ours == ref, f"{label}: copies changed the greedy output"
        assert stats.copy_accepted > 0, f"{label}: no copy landed ({stats.copy_drafted} drafted)"


@pytest.mark.parametrize("family", MLX_LM_FAMILIES)
def test_greedy_copies_equal_plain_on_every_family(family, loaded):
    assert_copies_exact(loaded(family, agreeable=True), family)


@pytest.mark.parametrize("bits", [4, 8])
def test_greedy_copies_equal_plain_on_quantized_bodies(bits, checkpoint_dir):
    from mtp_serve.models.loader import load_model

    lm = load_model(str(checkpoint_dir("qwen3_5", agreeable=True, **QUANT_TEXT)))
    assert quantize_loaded(lm.model, bits, 64 if bits == 4 else 32) > 0
    assert_copies_exact(lm, f"{bits}-bit")


def test_greedy_copies_equal_plain_with_quantized_kv(loaded):
    lm = loaded("qwen3_5", agreeable=True, head_dim=32)
    lm.model.use_kv(KVSetting(8, 32))
    try:
        assert_copies_exact(lm, "8-bit KV")
    finally:
        lm.model.use_kv(FULL_KV)


def test_batched_rows_copy_beside_head_drafts_and_plain_rows(loaded):
    lm = loaded("qwen3_next", agreeable=True)
    prompts = {"copy": copying_prompt(lm), "head": [9, 8, 7, 6], "plain": list(range(40, 52))}
    depths = {"copy": 2, "head": 2, "plain": 0}
    params = SamplingParams(max_tokens=N, ignore_eos=True)
    sched = Scheduler(lm.model, lm.tokenizer, max_batch_size=8, prefill_chunk=8, policy=DepthPolicy(max_depth=2, fixed=True))
    for k, p in prompts.items():
        sched.add(k, p, params, depths[k])
    out, stats, mixed = {k: [] for k in prompts}, {}, 0
    while sched.has_work():
        for key, chunk in sched.step():
            assert not isinstance(chunk, Exception), chunk
            out[key] += chunk.token_ids
            stats[key] = chunk.stats
        if sched.last_certain.get("copy", 0) > 2 and sched.last_round.get("head", (0, 0))[0] == 2:
            mixed += 1  # one window: a long copied chain beside the head's two drafts
    for k, p in prompts.items():
        assert out[k] == plain(lm, p), k
    assert mixed > 0 and stats["copy"].copy_accepted > 0 and sum(stats["head"].drafted) > 0
    assert stats["plain"].copy_drafted == 0 and sum(stats["plain"].drafted) == 0


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_long_copied_chain_rejected_part_way_rolls_back_exactly(family, loaded):
    """One round verifies 40 copied tokens whose 36th is wrong: 35 are accepted and the
    correction emitted, the rest rolled back (GatedDeltaNet states, KV, the head's owed
    pairs); rounds after it, from the head and plain, continue exactly as plain decoding."""
    lm = loaded(family, agreeable=True)
    ref = plain(lm, P, 64)
    seq = new_sequence(lm.model, lm.tokenizer, 0, P, SamplingParams(max_tokens=64, ignore_eos=True), 2)
    emitted = prefill(lm.model, seq)
    seq.apply(emitted)
    out = list(emitted[0])
    batch = Batch()
    batch.add(seq)
    chain = ref[1:41]
    chain[35] = (chain[35] + 1) % 200
    accepted = run_round(lm.model, batch, [0], certain=CertainDrafts([chain], ["copy"]))
    assert accepted.counts == [35] and accepted.tokens[0] == ref[1:37]
    out += accepted.tokens[0]
    seq.apply(accepted.emitted(0))
    for depths in ([2], [0], [2]) * 10:
        if len(out) >= 64:
            break
        accepted = run_round(lm.model, batch, depths)
        out += accepted.tokens[0]
        seq.apply(accepted.emitted(0))
    assert out[:64] == ref


# ---------------------------------------------------------------- sampling


def test_seeded_sampling_is_the_same_with_copies_on_and_off(loaded):
    lm = loaded("qwen3_5", agreeable=True)
    prompt = copying_prompt(lm)
    for seed in (1, 2, 3):
        params = SamplingParams(max_tokens=N, ignore_eos=True, temperature=0.7, seed=seed)
        on, stats = run(lm, prompt, params, depth=2)
        off, _ = run(lm, prompt, params, depth=0, copy_max=0)
        assert on == off, seed
    assert stats.copy_drafted > 0


def test_copies_off_per_request_and_per_scheduler(loaded):
    lm = loaded("qwen3_5", agreeable=True)
    prompt = copying_prompt(lm)
    _, off = run(lm, prompt, SamplingParams(max_tokens=N, ignore_eos=True, copy_drafts=False))
    _, none = run(lm, prompt, SamplingParams(max_tokens=N, ignore_eos=True), copy_max=0)
    _, on = run(lm, prompt, SamplingParams(max_tokens=N, ignore_eos=True))
    assert off.copy_drafted == 0 and none.copy_drafted == 0 and on.copy_drafted > 0


def run_measured(lm, prompt, copy_ms: float, **policy_options):
    """Tokens and stats of one greedy request whose policy has measured the head's depth-2
    round at 10 ms and every copy window at `copy_ms` (later rounds keep measuring); the policy
    at fixed depth with its copies timed unless `policy_options` say otherwise."""
    policy = DepthPolicy(max_depth=2, **(policy_options or dict(fixed=True, timed_copies=True)))
    for w in (4, 8, 16, 32, 64):
        key = (1, 1024, w)
        policy.copy_time[key], policy.copy_samples[key], policy.copy_last[key] = copy_ms / 1e3, 10, 0
    policy.round_time[(1, 1024, 2)], policy.samples[(1, 1024, 2)] = 0.010, 10
    sched = Scheduler(lm.model, lm.tokenizer, max_batch_size=1, prefill_chunk=None, policy=policy, copy_max=32)
    sched.add(0, prompt, SamplingParams(max_tokens=N, ignore_eos=True), 2)
    run_measured.row = sched.seqs[0]
    out, stats = [], None
    while sched.has_work():
        for _, chunk in sched.step():
            out += chunk.token_ids
            stats = chunk.stats
    return out, stats


def test_copies_follow_the_measured_window_costs(loaded):
    """The scheduler copies where copy windows measured fast against the head's round, and
    leaves the same matches to the head where they measured slow; greedy output is plain's."""
    lm = loaded("qwen3_5", agreeable=True)
    prompt = copying_prompt(lm)
    fast, fast_stats = run_measured(lm, prompt, 0.001)
    slow, slow_stats = run_measured(lm, prompt, 10_000.0)
    assert fast == slow == plain(lm, prompt)
    assert fast_stats.copy_accepted > 0 and slow_stats.copy_drafted == 0 and sum(slow_stats.drafted) > 0


def test_a_fixed_policy_copies_alike_however_the_windows_measured(loaded):
    """A fixed-depth policy (tests, `--fixed-depth`) chooses copies by expected tokens alone,
    so its rounds repeat exactly whatever the machine's speed: the same drafts and acceptance
    with copy windows measured fast or slow."""
    lm = loaded("qwen3_5", agreeable=True)
    prompt = copying_prompt(lm)
    fast, fast_stats = run_measured(lm, prompt, 0.001, fixed=True)
    slow, slow_stats = run_measured(lm, prompt, 10_000.0, fixed=True)
    assert fast == slow == plain(lm, prompt)
    assert slow_stats.copy_drafted == fast_stats.copy_drafted > 0
    assert slow_stats.accepted == fast_stats.accepted and slow_stats.copy_accepted == fast_stats.copy_accepted


def test_matches_left_to_the_head_still_teach_the_row_how_its_copies_land(loaded):
    """Where copy windows measured slow the row never copies, yet each match it passed over is
    scored against what the round emitted: here the output follows the context, so the rates
    of the orders that matched rise above their priors (without it they stay at the priors)."""
    lm = loaded("qwen3_5", agreeable=True)
    _, stats = run_measured(lm, copying_prompt(lm), 10_000.0)
    rates = run_measured.row.copy_cap.rates
    assert stats.copy_drafted == 0
    assert max(rates[n] - PRIOR_RATE[n] for n in PRIOR_RATE) > 0.01, rates


def test_a_passed_over_match_counts_as_a_copy_of_the_tokens_the_round_reached():
    cap = CopyCap()
    cap.pass_over(3, [5, 6, 7, 8])
    cap.settle([5, 6, 9])  # two land, the third is not what the round emitted
    assert cap.rates[3] == pytest.approx(PRIOR_RATE[3] + RATE_EMA * (2 / 3 - PRIOR_RATE[3]))
    cap.pass_over(8, [1, 2])
    cap.settle([1, 2, 3, 4])  # both land
    assert cap.rates[8] == pytest.approx(PRIOR_RATE[8] + RATE_EMA * (1 - PRIOR_RATE[8]))
    before = dict(cap.rates)
    cap.settle([1, 2])  # nothing passed over since
    assert cap.rates == before and cap.limit == CopyCap().limit  # the length limit follows real copies only


N_SAMPLES = 800
N_POS = 4


def sample_many(lm, prompt, copy: bool, n=N_SAMPLES):
    seqs, drafted, accepted = [], 0, 0
    for _ in range(n):
        params = SamplingParams(max_tokens=N_POS + 1, ignore_eos=True, temperature=1.0, top_k=4)
        out, stats = run(lm, prompt, params, depth=1 if copy else 0, copy_max=32 if copy else 0, cap=8)
        seqs.append(tuple(out[:N_POS + 1]))
        drafted += stats.copy_drafted
        accepted += stats.copy_accepted
    return seqs, accepted, drafted


def chi2_pvalue(a, b):
    keys = sorted(set(a) | set(b))
    table = [[a.count(k) for k in keys], [b.count(k) for k in keys]]
    return chi2_contingency(table)[1] if len(keys) > 1 else 1.0


def sampled_prompt(lm):
    """The context holds the model's likeliest continuation: copies land often, not always."""
    return P + plain(lm, P, 8) + P


@pytest.fixture(scope="module")
def plain_reference(loaded):
    """Plain sampling's samples after the copy prompt: one reference for the test and its
    negative control (both compare against the same plain distribution)."""
    lm = loaded("qwen3_5", agreeable=True)
    prompt = sampled_prompt(lm)
    return lm, prompt, sample_many(lm, prompt, copy=False)[0]


def distribution_pvalues(ref, seqs):
    ps = [chi2_pvalue([s[j] for s in ref], [s[j] for s in seqs]) for j in range(1, N_POS + 1)]
    ps.append(chi2_pvalue([s[1:3] for s in ref], [s[1:3] for s in seqs]))
    return ps


@pytest.mark.distribution
def test_sampled_copies_have_the_plain_distribution(plain_reference):
    lm, prompt, ref = plain_reference
    seqs, accepted, drafted = sample_many(lm, prompt, copy=True)
    assert accepted >= 100 and drafted - accepted >= 100, f"{accepted}/{drafted}: accept and reject paths must both run"
    ps = distribution_pvalues(ref, seqs)
    assert min(ps) > 0.001, ps


def wrong_residual(drafts, p_logprobs, q_logprobs, rng):
    """Accepts as the right rule does, but on rejection draws from p itself (the rejected
    token not removed): the negative control."""
    K = drafts.shape[0]
    p = mx.exp(p_logprobs)
    p_d = p[mx.arange(K), drafts]
    u = mx.random.uniform(shape=(K,), key=rng.next())
    redraw = mx.random.categorical(p_logprobs[:K], key=rng.next())
    bonus = mx.random.categorical(p_logprobs[K], key=rng.next())
    flags = (u < p_d).tolist()
    m = 0
    while m < K and flags[m]:
        m += 1
    return m, (bonus.item() if m == K else redraw[m].item())


@pytest.mark.distribution
def test_chi_square_catches_a_wrong_residual(plain_reference, monkeypatch):
    lm, prompt, ref = plain_reference
    monkeypatch.setattr(speculative, "rejection_sample", wrong_residual)
    seqs, accepted, drafted = sample_many(lm, prompt, copy=True)
    monkeypatch.undo()
    assert drafted - accepted >= 100
    assert min(distribution_pvalues(ref, seqs)) < 0.001


# ---------------------------------------------------------------- grammar-forced tokens

NESTED = {"type": "object", "additionalProperties": False, "required": ["user", "tags"], "properties": {
    "user": {"type": "object", "additionalProperties": False, "required": ["id", "address"], "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99},
        "address": {"type": "object", "additionalProperties": False, "required": ["zip"],
                    "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
    "tags": {"type": "array", "items": {"enum": ["alpha", "beta"]}, "minItems": 1, "maxItems": 2}}}


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_grammar_forced_tokens_keep_constrained_output_and_count_as_accepted(family, loaded):
    from mtp_serve.engine.grammar import Constraint

    lm = loaded(family, agreeable=True)
    params = SamplingParams(max_tokens=80, constraint=Constraint.json_schema(NESTED))
    ref, _ = run(lm, [11, 22, 33, 44], params, depth=0, copy_max=0)
    for depth in (1, 2):
        ours, stats = run(lm, [11, 22, 33, 44], params, depth=depth)
        assert ours == ref, depth
        # '{"user":{"id":' and the keys after it: the grammar admits nothing else, so all land.
        assert stats.forced_drafted >= 10 and stats.forced_accepted == stats.forced_drafted, stats
    seeded = SamplingParams(max_tokens=80, temperature=1.0, seed=7, constraint=Constraint.json_schema(NESTED))
    on, stats = run(lm, [11, 22, 33, 44], seeded, depth=2)
    assert on == run(lm, [11, 22, 33, 44], seeded, depth=0, copy_max=0)[0] and stats.forced_accepted > 0

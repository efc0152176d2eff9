"""Continuous batching with per-sequence MTP: each request's output equals its
single-stream output, whatever shares its batch and whenever it arrives."""

import pytest
from scipy.stats import chi2_contingency

from mtp_serve.engine.context_drafts import MAX_COPY
from mtp_serve.engine.generator import generate
from mtp_serve.engine.policy import DepthPolicy
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.engine.scheduler import Scheduler


def single_stream(lm, prompt, params, depth):
    toks, text, finish = [], "", None
    for c in generate(lm.model, lm.tokenizer, prompt, params, depth):
        toks += c.token_ids
        text += c.text
        finish = c.finish_reason
    return toks, text, finish


def drive(lm, requests, depth, *, arrivals=None, cancel=None, max_batch=8, prefill_chunk=4, policy=None,
          copy_max=MAX_COPY):
    """requests: {key: (prompt, params)}; arrivals: {key: step}; cancel: {key: step}."""
    sched = Scheduler(lm.model, lm.tokenizer, max_batch_size=max_batch, prefill_chunk=prefill_chunk,
                      policy=policy or DepthPolicy(max_depth=depth, fixed=True), copy_max=copy_max)
    arrivals = arrivals or {k: 0 for k in requests}
    cancel = cancel or {}
    out = {k: ([], "", None) for k in requests}
    mixed_rounds, step = 0, 0
    while step == 0 or sched.has_work() or any(a >= step for a in arrivals.values()):
        for k, a in arrivals.items():
            if a == step:
                prompt, params = requests[k]
                sched.add(k, prompt, params, depth)
        for k, c in cancel.items():
            if c == step:
                sched.cancel(k)
        for key, chunk in sched.step():
            assert not isinstance(chunk, Exception), chunk
            toks, text, _ = out[key]
            out[key] = (toks + chunk.token_ids, text + chunk.text, chunk.finish_reason)
        accepted = [m for _, m in sched.last_round.values()]
        if len(accepted) > 1 and len(set(accepted)) > 1:
            mixed_rounds += 1
        step += 1
        assert step < 5000
    return out, mixed_rounds, sched


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_batched_greedy_equals_single_stream(depth, loaded):
    lm = loaded("qwen3_5", agreeable=True)
    prompts = {"a": [3, 4, 5], "b": list(range(40, 75)), "c": [9] * 12, "d": [100, 101], "e": list(range(200, 220))}
    max_tokens = {"a": 40, "b": 25, "c": 48, "d": 33, "e": 40}
    # A stop string the reference output is known to contain: the request must stop there.
    ref_d = single_stream(lm, prompts["d"], SamplingParams(max_tokens=max_tokens["d"], ignore_eos=True), depth)[1]
    requests = {}
    for k, p in prompts.items():
        stop = (ref_d[12:14],) if k == "d" else ()
        requests[k] = (p, SamplingParams(max_tokens=max_tokens[k], ignore_eos=True, stop=stop))
    arrivals = {"a": 0, "b": 0, "c": 3, "d": 7, "e": 12}
    out, mixed_rounds, sched = drive(lm, requests, depth, arrivals=arrivals, cancel={"e": 20})
    for k, (prompt, params) in requests.items():
        ref = single_stream(lm, prompt, params, depth)
        if k == "e":  # cancelled mid-stream: what it got is a prefix of the reference
            assert out[k][2] is None and 0 < len(out[k][0]) < len(ref[0])
            assert out[k][0] == ref[0][: len(out[k][0])]
            continue
        assert out[k] == ref, f"request {k} differs from its single-stream output"
    assert out["d"][2] == "stop" and len(out["d"][0]) < max_tokens["d"]
    assert mixed_rounds > 0, "no round had rows accepting different numbers of drafts"
    assert not sched.has_work() and not sched.batch.rows and sched.batch.caches is None and not sched.seqs


def test_rows_draft_their_own_depths_in_one_batch(loaded):
    """Rows asking depths 0, 1, 2 and 3 share every round (the window is 4 wide):
    each row's output is its single-stream output, and its stats count its own drafts
    (the head's drafts alone: no copies from the context)."""
    lm = loaded("qwen3_5", agreeable=True)
    depths = {"d0": 0, "d1": 1, "d2": 2, "d3": 3}
    prompts = {"d0": [3, 4, 5], "d1": list(range(40, 60)), "d2": [9] * 12, "d3": [100, 101, 7]}
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    sched = Scheduler(lm.model, lm.tokenizer, max_batch_size=8, prefill_chunk=64, policy=DepthPolicy(max_depth=3, fixed=True),
                      copy_max=0)
    for k, p in prompts.items():
        sched.add(k, p, params, depths[k])
    out, stats, windows, rounds = {k: [] for k in prompts}, {}, set(), {k: [] for k in prompts}
    while sched.has_work():
        left = {k: params.max_tokens - len(t) for k, t in out.items()}
        for key, chunk in sched.step():
            out[key] += chunk.token_ids
            stats[key] = chunk.stats
        for k, (d, _) in sched.last_round.items():
            rounds[k].append(d)
            assert d == min(depths[k], left[k] - 1)  # its own depth (fewer where max_tokens is near)
        if len(sched.last_round) == 4:
            windows.add(max(d for d, _ in sched.last_round.values()))
    assert windows == {3}
    for k, d in depths.items():
        ref, ref_stats = single_stream_stats(lm, prompts[k], params, d)
        assert out[k] == ref, k
        st = stats[k]
        assert st.depth == d and len(st.drafted) == d
        assert len(rounds[k]) == st.backbone_passes
        assert st.drafted == [sum(r > j for r in rounds[k]) for j in range(d)]  # counts its own drafts
        assert st.accepted == ref_stats.accepted  # the same acceptance per position as alone
        if d:
            assert 0 < sum(st.accepted) < sum(st.drafted)


def single_stream_stats(lm, prompt, params, depth):
    toks, stats = [], None
    for c in generate(lm.model, lm.tokenizer, prompt, params, depth, copy_max=0):
        toks += c.token_ids
        stats = c.stats
    return toks, stats


def test_isolation_same_output_whatever_the_neighbours(loaded):
    lm = loaded("qwen3_5", agreeable=True)
    target = ([21, 22, 23, 24], SamplingParams(max_tokens=30, ignore_eos=True))
    alone, _, _ = drive(lm, {"t": target}, 2)
    for neighbours in ([[1, 2]], [[7] * 30, [8, 9, 10]], [list(range(50, 90)), [5], [6, 6, 6]]):
        reqs = {"t": target}
        reqs.update({f"n{i}": (p, SamplingParams(max_tokens=17 + i, ignore_eos=True)) for i, p in enumerate(neighbours)})
        out, _, _ = drive(lm, reqs, 2)
        assert out["t"] == alone["t"]


def test_sampled_greedy_and_plain_rows_share_a_batch(loaded):
    """Greedy rows stay exact beside a sampled row and a plain (depth 0) row, which
    drafts nothing while its neighbours draft."""
    lm = loaded("qwen3_5", agreeable=True)
    greedy = ([30, 31, 32], SamplingParams(max_tokens=30, ignore_eos=True))
    plain = ([50, 51, 52, 53], SamplingParams(max_tokens=30, ignore_eos=True))
    sampled = ([40, 41], SamplingParams(max_tokens=30, ignore_eos=True, temperature=1.0, seed=3))
    sched = Scheduler(lm.model, lm.tokenizer, policy=DepthPolicy(max_depth=2, fixed=True))
    for key, (prompt, params), depth in (("g", greedy, 2), ("p", plain, 0), ("s", sampled, 2)):
        sched.add(key, prompt, params, depth)
    out, stats = {"g": [], "p": [], "s": []}, {}
    while sched.has_work():
        for key, chunk in sched.step():
            out[key] += chunk.token_ids
            stats[key] = chunk.stats
    assert out["g"] == single_stream(lm, *greedy, 2)[0]
    assert out["p"] == single_stream(lm, *plain, 0)[0]
    assert len(out["s"]) == 30
    assert sum(stats["p"].drafted) == 0 and sum(stats["g"].drafted) > 0 and sum(stats["s"].drafted) > 0


def test_adaptive_policy_explores_and_stays_exact(loaded):
    lm = loaded("qwen3_5", agreeable=True)
    reqs = {k: ([k * 3 + 1, k * 3 + 2], SamplingParams(max_tokens=40, ignore_eos=True)) for k in range(4)}
    policy = DepthPolicy(max_depth=3)
    out, _, _ = drive(lm, reqs, 3, policy=policy, copy_max=0)  # the head's window costs are what it explores
    for k, (p, params) in reqs.items():
        assert out[k][0] == single_stream(lm, p, params, 3)[0]
    tried = {k for (_, _, k) in policy.samples}
    assert tried == {0, 1, 2, 3}, policy.summary()


@pytest.mark.distribution
def test_batched_sampling_matches_plain_distribution(loaded):
    """The distribution test with the sequence under test batched beside another."""
    lm = loaded("qwen3_5", agreeable=True)
    n, n_pos, prompt = 600, 4, [11, 22, 33, 44, 55, 66]  # 4: at depth 2 the first round drafts 2
    kw = dict(temperature=1.0, top_k=3, top_p=0.95, max_tokens=n_pos, ignore_eos=True)
    plain = [single_stream(lm, prompt, SamplingParams(seed=i, **kw), 0)[0] for i in range(n)]
    batched = []
    for i in range(n):
        reqs = {"t": (prompt, SamplingParams(seed=10**6 + i, **kw)),
                "n": ([7, 8, 9], SamplingParams(seed=i, temperature=1.0, max_tokens=5, ignore_eos=True))}
        out, _, _ = drive(lm, reqs, 2, prefill_chunk=64)
        batched.append(out["t"][0])
    for pos in range(n_pos):
        a, b = [s[pos] for s in plain], [s[pos] for s in batched]
        keys = sorted(set(a) | set(b))
        p = chi2_contingency([[a.count(k) for k in keys], [b.count(k) for k in keys]])[1]
        assert p > 0.001, f"position {pos}: p={p:.2g}"


@pytest.mark.parametrize("family", ["qwen3_6_moe", "qwen3_next", "qwen4_exp"])
def test_batched_moe_families_equal_single_stream(family, loaded):
    """MoE layers (and Qwen3-Next's GatedDeltaNet layout) through the batched, compiled path;
    qwen4_exp's batched backbone (stacked GatedDeltaNet and PLE states, attention on each row's
    own indexed cache) with rows joining, leaving and rolling back apart."""
    lm = loaded(family, agreeable=True)
    reqs = {k: (p, SamplingParams(max_tokens=30, ignore_eos=True))
            for k, p in {"a": [3, 4, 5], "b": list(range(40, 70)), "c": [9] * 12}.items()}
    out, mixed_rounds, _ = drive(lm, reqs, 2, arrivals={"a": 0, "b": 0, "c": 4})
    for k, (prompt, params) in reqs.items():
        assert out[k][0] == single_stream(lm, prompt, params, 2)[0], k
    assert mixed_rounds > 0


def test_seeded_sampling_is_the_same_alone_batched_and_at_any_depth(loaded):
    """A seeded request's tokens depend on its seed only: not on MTP, the depth, the
    policy's choices or what shares its batch (per-position noise, see sampling.py)."""
    lm = loaded("qwen3_5", agreeable=True)
    target = ([21, 22, 23, 24], SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, top_p=0.9, seed=1234))
    alone = single_stream(lm, *target, 0)[0]
    for depth in (1, 2, 3):
        assert single_stream(lm, *target, depth)[0] == alone, depth
    neighbours = {f"n{i}": ([5 + i, 6], SamplingParams(max_tokens=25 + i, ignore_eos=True, temperature=0.8 * i))
                  for i in range(3)}
    for depth, policy in ((2, None), (3, DepthPolicy(max_depth=3))):  # fixed depth, then the measured policy
        out, _, _ = drive(lm, {"t": target, **neighbours}, depth, policy=policy)
        assert out["t"][0] == alone, depth

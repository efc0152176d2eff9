"""Pipelined plain decoding (the next step's pass started before the current step's tokens
reach the host) emits exactly what the unpipelined loop emits: tokens, text, finish reasons
and log-probabilities, greedy and sampled, alone and in a batch, through stops, cancellations,
grammars and rows that join, leave or draft; and the pass it takes back leaves the caches
as they were."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mtp_serve.engine.grammar import Constraint
from mtp_serve.engine.policy import DepthPolicy
from mtp_serve.engine.sampling import Rng, SamplingParams
from mtp_serve.engine.scheduler import Scheduler
from mtp_serve.models.caches import FULL_KV, KVSetting, before_step, steps_back, undo_step


def drive(lm, requests, *, pipeline, arrivals=None, cancel=None, cancel_mid=None, max_batch=8):
    """requests: {key: (prompt, params, depth)}; arrivals/cancel: {key: step}; cancel_mid:
    {key: step}, cancelled while that step runs (after its first result, as a client that
    disconnects mid-step). Unseeded rows draw from a generator seeded by their key, so both
    loops see the same random stream."""
    sched = Scheduler(lm.model, lm.tokenizer, max_batch_size=max_batch, prefill_chunk=8,
                      policy=DepthPolicy(max_depth=3, fixed=True), copy_max=0, pipeline=pipeline)
    arrivals = arrivals or {k: 0 for k in requests}
    cancel, cancel_mid = cancel or {}, cancel_mid or {}
    out = {k: ([], "", None, []) for k in requests}
    step = 0
    while step == 0 or sched.has_work() or any(a >= step for a in arrivals.values()):
        for k, a in arrivals.items():
            if a == step:
                prompt, params, depth = requests[k]
                sched.add(k, prompt, params, depth)
                sched.seqs[k].rng = Rng(sum(map(ord, k)))
        for k, c in cancel.items():
            if c == step:
                sched.cancel(k)
        for key, chunk in sched.step():
            for k, c in cancel_mid.items():
                if c == step:
                    sched.cancel(k)
            assert not isinstance(chunk, Exception), chunk
            toks, text, _, lps = out[key]
            lp = [(t.token, t.logprob, list(t.top)) for t in chunk.logprobs or []]
            out[key] = (toks + chunk.token_ids, text + chunk.text, chunk.finish_reason, lps + lp)
        step += 1
        assert step < 3000
    assert not sched.has_work() and sched.batch.caches is None and sched._pending is None
    return out, sched


def both(lm, requests, **kw):
    plain, _ = drive(lm, requests, pipeline=False, **kw)
    piped, sched = drive(lm, requests, pipeline=True, **kw)
    assert sched.launched > 0, "no round started the next step's pass"
    return plain, piped, sched


def test_pipelined_single_rows_equal_unpipelined_greedy_penalized_seeded_and_sampled(loaded):
    lm = loaded("qwen3_5", agreeable=True)
    requests = {
        "greedy": ([3, 4, 5], SamplingParams(max_tokens=30, ignore_eos=True, logprobs=2), 0),
        "penalized": ([6, 7], SamplingParams(max_tokens=30, ignore_eos=True, repetition_penalty=1.3), 0),
        "seeded": ([8, 9, 10], SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.9, seed=5, logprobs=1), 0),
        "sampled": ([11, 12], SamplingParams(max_tokens=30, ignore_eos=True, temperature=1.0, top_p=0.9), 0),
    }
    for key, request in requests.items():
        plain, piped, sched = both(lm, {key: request})
        assert piped == plain, key
        assert len(piped[key][0]) == 30
        assert sched.undone == 0  # a row at its last token starts no pass: nothing to take back


def test_pipelined_batch_with_stops_cancellation_grammar_and_drafting_rows_equals_unpipelined(loaded):
    """Rows join mid-stream, one stops on a stop string, one is cancelled, one is under a
    grammar, one drafts (depth 2: its rounds are not plain until it leaves)."""
    lm = loaded("qwen3_5", agreeable=True)
    ref, _ = drive(lm, {"d": ([100, 101], SamplingParams(max_tokens=30, ignore_eos=True), 0)}, pipeline=False)
    requests = {
        "a": ([3, 4, 5], SamplingParams(max_tokens=40, ignore_eos=True, logprobs=1), 0),
        "b": (list(range(40, 60)), SamplingParams(max_tokens=25, ignore_eos=True, temperature=0.8, seed=3), 0),
        "c": ([9] * 12, SamplingParams(max_tokens=45, ignore_eos=True, temperature=1.0), 0),
        "d": ([100, 101], SamplingParams(max_tokens=30, ignore_eos=True, stop=(ref["d"][1][10:12],)), 0),
        "e": (list(range(200, 215)), SamplingParams(max_tokens=40, ignore_eos=True), 0),
        "g": ([13, 14], SamplingParams(max_tokens=30, temperature=1.0, seed=9,
                                       constraint=Constraint("regex", r"[a-f]{3,8}(-[0-9]{2})+")), 0),
        "m": ([20, 21, 22], SamplingParams(max_tokens=12, ignore_eos=True), 2),
    }
    arrivals = {"a": 0, "b": 0, "m": 0, "c": 3, "d": 6, "e": 10, "g": 14}
    plain, piped, sched = both(lm, requests, arrivals=arrivals, cancel={"e": 22}, cancel_mid={"c": 17})
    assert piped == plain
    assert plain["d"][2] == "stop" and len(plain["d"][0]) < 30
    assert plain["e"][2] is None and 0 < len(plain["e"][0]) < 40  # cancelled mid-stream
    assert plain["c"][2] is None and 0 < len(plain["c"][0]) < 45
    assert sched.undone > 0  # passes were started and taken back (joins, the stop, the cancel)


@pytest.mark.parametrize("kv", [FULL_KV, KVSetting(8, 32)], ids=["full-kv", "kv8"])
@pytest.mark.parametrize("rows", [1, 3])
def test_undo_step_restores_every_cache(loaded, rows, kv):
    """One step forward and back: every layer's arrays and offsets as before, and the next
    step's logits those of a loop that never took the step (full and 8-bit KV caches)."""
    lm = loaded("qwen3_5", agreeable=True, head_dim=32)  # (the KV group size divides it)
    lm.model.use_kv(kv)
    try:
        _step_and_undo(lm, rows)
    finally:
        lm.model.use_kv(FULL_KV)


def _stepped(lm, rows):
    """An unpipelined plain loop of `rows` rows, a few steps in."""
    sched = Scheduler(lm.model, lm.tokenizer, max_batch_size=rows, prefill_chunk=None,
                      policy=DepthPolicy(max_depth=0, fixed=True), pipeline=False)
    for i in range(rows):
        sched.add(i, [5 + i, 6, 7 + 2 * i], SamplingParams(max_tokens=50, ignore_eos=True), 0)
    for _ in range(rows + 3):
        list(sched.step())
    return sched


def _step_and_undo(lm, rows):
    sched = _stepped(lm, rows)
    cache = sched.batch.cache
    assert steps_back(cache)
    tokens = mx.array([[s.primary] for s in sched.batch.rows])

    def snapshot():
        mx.eval([c.state for c in cache])
        return [(getattr(c, "offset", None), [a for _, a in tree_flatten(c.state) if isinstance(a, mx.array)])
                for c in cache]

    before = snapshot()
    saved = before_step(cache)
    mx.eval(lm.model.forward(mx.array([[1]] * rows), cache)[1])
    undo_step(cache, saved, rows)
    after = snapshot()
    for (o1, a1), (o2, a2) in zip(before, after):
        assert mx.array_equal(o1, o2) if isinstance(o1, mx.array) else o1 == o2
        assert len(a1) == len(a2) > 0
        assert all(mx.array_equal(x, y) for x, y in zip(a1, a2))
    assert mx.array_equal(lm.model.forward(tokens, cache)[1], _fresh_logits(lm, sched, tokens, rows))


def _fresh_logits(lm, sched, tokens, rows):
    """The same step from a loop that never took the extra one."""
    return lm.model.forward(tokens, _stepped(lm, rows).batch.cache)[1]

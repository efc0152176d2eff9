"""The depth policy: each row drafts what pays for itself at the measured costs.

Unit tests drive `DepthPolicy` with measured-looking round costs and per-row
acceptance; the last test runs it in the real scheduler with a row whose drafts
are always wrong."""

from dataclasses import dataclass, field

import pytest

import mtp_serve.engine.speculative as speculative
from mtp_serve.engine.context_drafts import CopyCap
from mtp_serve.engine.policy import REPROBE_EVERY, ROW_REPROBE_EVERY, DepthPolicy, context_bucket, window_bucket
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.engine.scheduler import Scheduler
from mtp_serve.engine.sequence import RowAcceptance

COST = {0: 0.010, 1: 0.012, 2: 0.015}  # seconds per round of 4 rows, by the longest row's depth


@dataclass
class Row:
    """What the policy reads of a running sequence."""
    max_depth: int = 2
    tokens_left: int = 1 << 20
    context_length: int = 100
    acceptance: RowAcceptance = field(default_factory=lambda: RowAcceptance([]))
    copy_cap: CopyCap = field(default_factory=CopyCap)


def simulate(policy, rows, acceptance, rounds, rng):
    """`acceptance[i](round)`: row i's chance that a draft is accepted. Returns depths per round."""
    chosen = []
    for r in range(rounds):
        depths = policy.depths(rows)
        K = max(depths)
        first = policy.samples.get((4, 1024, K), 0) == 0
        accepted = []
        for i, d in enumerate(depths):
            m = 0
            while m < d and rng.random() < acceptance[i](r):
                m += 1
            accepted.append(m)
        # the first round of each depth is slow (allocation, kernel compilation)
        policy.observe(rows, depths, accepted, COST[K] * (50 if first else 1))
        chosen.append(depths)
    return chosen


def test_measured_best_depth_ignoring_warm_up_rounds():
    import random

    rng = random.Random(0)
    good = DepthPolicy(max_depth=2)
    chosen = simulate(good, [Row() for _ in range(4)], [lambda r: 0.9] * 4, 60, rng)
    assert all(d == [2] * 4 for d in chosen[-10:]), chosen[-10:]  # 1 + .9 + .81 tokens for 1.5x a plain round
    bad = DepthPolicy(max_depth=2)
    chosen = simulate(bad, [Row() for _ in range(4)], [lambda r: 0.05] * 4, 300, rng)
    assert all(d == [0] * 4 for d in chosen[-5:]), chosen[-5:]  # drafting never pays at 5% acceptance
    later = [max(d) for d in chosen[30:]]
    assert 0 < sum(1 for k in later if k) < len(later) // 4  # ... but rows re-probe now and then


def test_a_failing_row_drops_to_zero_alone_and_recovers():
    import random

    rng = random.Random(1)
    policy = DepthPolicy(max_depth=2)
    rows = [Row() for _ in range(4)]
    # Row 3's drafts are always rejected for 150 rounds, then accepted again.
    acceptance = [lambda r: 0.9] * 3 + [lambda r: 0.0 if r < 150 else 0.95]
    chosen = simulate(policy, rows, acceptance, 260, rng)
    middle = chosen[100:150]
    assert sum(d[3] == 0 for d in middle) >= 0.8 * len(middle), middle  # the failing row stops drafting
    # The others keep their depth (but for the rare round that re-measures another depth's cost).
    assert sum(d[:3] == [2, 2, 2] for d in middle) >= 0.9 * len(middle), middle
    assert sum(d[3] > 0 for d in middle) >= 1  # it re-probes
    assert all(d[3] == 2 for d in chosen[-20:]), chosen[-20:]  # and recovers once its drafts are accepted again


def window_cost(context: int, K: int) -> float:
    """A round's seconds when a verify window's attention grows with the context: at depth K the
    window reads the cache for K+1 positions (40 ms per 8k keys each), a plain step for one.
    At 80% acceptance depth 2 pays below ~4.5k tokens of context, depth 1 below ~7k; above, both
    cost more than they bring."""
    return 0.010 + 0.001 * K + (K + 1) * 0.040 * context / 8192


def test_drafts_where_its_context_pays_and_not_where_it_does_not():
    """Round costs measured per context bucket: the same row drafts at 1k tokens of context,
    stops drafting at 64k, where every depth measured slower than plain steps, and drafts
    again at once back at 1k."""
    import random

    rng = random.Random(2)
    policy = DepthPolicy(max_depth=2)
    row = Row(context_length=1000)
    chosen = {}
    for context in (1000, 64000, 1000):  # back to a short context: its own costs are still there
        row.context_length = context
        picks = []
        for r in range(200):
            d = policy.depths([row])[0]
            m = 0
            while m < d and rng.random() < 0.8:
                m += 1
            policy.observe([row], [d], [m], window_cost(context, d) * (50 if r == 0 else 1))
            picks.append(d)
        chosen.setdefault(context, []).append(picks)
        pays = [(1 + 0.8 + 0.64 * (K == 2)) / window_cost(context, K) > 1 / window_cost(context, 0) for K in (1, 2)]
        assert pays == [context < 4096] * 2
    drafted = lambda picks: sum(d > 0 for d in picks) / len(picks)  # noqa: E731  (rare rounds re-measure plain)
    assert drafted(chosen[1000][0][-100:]) >= 0.95, chosen[1000][0]
    assert drafted(chosen[64000][0][-150:]) <= 0.15, chosen[64000][0]  # plain, but for re-probes (1 round in 16)
    assert drafted(chosen[1000][1][:20]) >= 0.9, chosen[1000][1]  # back at 1k: drafts at once, on 1k's costs
    assert {k[1] for k in policy.round_time} == {1024, 32768}
    assert context_bucket(1000) == 1024 and context_bucket(32000) == 16384 and context_bucket(32768) == 32768


def test_where_no_depth_could_pay_rows_stop_re_probing():
    """Costs where even a draft always accepted loses (a round at depth K slower than K+1 plain
    steps): the row drafts only in the rounds that re-measure a stale cost, 1 in 64."""
    import random

    rng = random.Random(3)
    policy = DepthPolicy(max_depth=2)
    row = Row(context_length=50000)
    picks = []
    for r in range(400):
        d = policy.depths([row])[0]
        m = sum(1 for _ in range(d) if rng.random() < 0.9)
        policy.observe([row], [d], [m], (0.010 * (1 + 2.2 * d)) * (50 if r == 0 else 1))
        picks.append(d)
    assert policy.hopeless((1, 32768), 2)
    late = picks[100:]
    assert 0 < sum(d > 0 for d in late) <= len(late) / 32, late


def test_a_batch_round_is_costed_at_its_longest_rows_context():
    policy = DepthPolicy(max_depth=2)
    rows = [Row(context_length=900), Row(context_length=20000)]
    policy.observe(rows, [2, 2], [0, 0], 0.5)
    assert set(policy.samples) == {(2, 16384, 2)}


def measured(copy_ms: dict, head_ms=(10.0, 11.0, 13.0)):
    """A policy and a row (batch 1, 1k context) after rounds of the head at K = 0, 1, 2 (every
    draft landing) and copy rounds of window buckets `copy_ms` (each bucket's first round slow)."""
    policy, row = DepthPolicy(max_depth=2), Row()
    for K, ms in enumerate(head_ms):
        for r in range(4):
            policy.observe([row], [K], [K], ms * (50 if r == 0 else 1) / 1e3)
    for w, ms in copy_ms.items():
        for r in range(4):
            policy.observe([row], [0], [0], None)
            policy.observe_copies([row], [w - 1], [0], ms * (50 if r == 0 else 1) / 1e3)
    row.acceptance = RowAcceptance([0.9, 0.9])  # the head emits 2.71 tokens a round at depth 2
    return policy, row


def test_copy_window_costs_are_measured_per_window_bucket():
    policy, _ = measured({8: 30.0, 32: 90.0})
    assert [window_bucket(n) for n in (1, 3, 4, 5, 9, 17, 33)] == [4, 4, 4, 8, 16, 32, 64]
    assert policy.copy_time == pytest.approx({(1, 1024, 8): 0.030, (1, 1024, 32): 0.090})  # warm-up rounds not counted
    # unmeasured windows: the longest measured one no longer than them (the head's K+1 = 3 below 4)
    assert policy.window_seconds((1, 1024), 4) == pytest.approx(0.013)
    assert policy.window_seconds((1, 1024), 5) == pytest.approx(0.030)
    assert policy.window_seconds((1, 1024), 12) == pytest.approx(0.030)
    assert policy.window_seconds((1, 1024), 40) == pytest.approx(0.090)


def test_a_copy_length_measured_slower_than_the_head_is_not_chosen():
    """Copies of a 16-token match (each lands with chance 0.95) emit more tokens than the head's
    two drafts, but every copy window measured slower per token than the head's round: the head drafts."""
    policy, row = measured({4: 20.0, 8: 40.0, 16: 60.0, 32: 100.0})
    head = policy.head_round_rate(row, 2, (1, 1024))
    assert head == pytest.approx(2.71 / 0.013)
    assert row.copy_cap.expected_tokens(16, 20) > 3 * policy.expected_tokens(row, 2)
    assert policy.copy_length(row, 16, 20, 2, (1, 1024)) == 0


def test_a_copy_length_measured_faster_than_the_head_is_chosen():
    """The same, but windows of 9-16 tokens measured fast: the row copies 15 tokens (the longest
    of that bucket), not the 20 available (a 32-token window is slower per token)."""
    policy, row = measured({4: 20.0, 8: 40.0, 16: 25.0, 32: 100.0})
    assert policy.copy_length(row, 16, 20, 2, (1, 1024)) == 15
    assert policy.copy_length(row, 16, 6, 2, (1, 1024)) == 0  # ... where no more than 6 are there to copy


def test_copies_beat_plain_decoding_or_do_not_happen():
    """A row at depth 0 (the head does not pay) copies only where the copy outruns plain steps."""
    policy, row = measured({4: 40.0, 8: 80.0, 16: 100.0, 32: 320.0})
    assert policy.copy_length(row, 3, 20, 0, (1, 1024)) == 0  # at most 2.2 tokens for 4 plain steps' time
    assert policy.copy_length(row, 16, 20, 0, (1, 1024)) == 15  # 11.2 tokens for 10 plain steps' time


def test_a_window_measured_slow_long_ago_is_tried_again():
    policy, row = measured({4: 20.0, 8: 40.0, 16: 60.0, 32: 100.0})
    assert policy.copy_length(row, 16, 20, 2, (1, 1024)) == 0
    for _ in range(REPROBE_EVERY + 1):
        policy.observe([row], [2], [2], 0.013)
    assert policy.copy_length(row, 16, 20, 2, (1, 1024)) == 20  # costed as the head's window until measured again


def test_a_window_never_measured_here_is_costed_from_mtp_tunes_measurement():
    """No copy round ran yet: without mtp-tune's costs the row copies all 20 tokens (the 21-token
    window costed as the head's 3-token one); with them (a 32-token window at 50 plain steps,
    16 at 2) it copies 15; once the 32-token bucket is measured here, that measurement decides."""
    policy, row = measured({})
    assert policy.copy_length(row, 16, 20, 2, (1, 1024)) == 20
    policy.window_prior = {4: 1.2, 8: 1.5, 16: 2.0, 32: 50.0}
    assert policy.window_seconds((1, 1024), 21) == pytest.approx(0.5)  # 50 plain steps of 10 ms
    assert policy.copy_length(row, 16, 20, 2, (1, 1024)) == 15
    for r in range(2):
        policy.observe_copies([row], [20], [0], 0.020 * (50 if r == 0 else 1))
    assert policy.copy_length(row, 16, 20, 2, (1, 1024)) == 20


def test_cap_is_the_servers_depth_and_requests_lower_it():
    policy = DepthPolicy(max_depth=5, fixed=True)
    assert policy.depths([Row(max_depth=8), Row(max_depth=3), Row(max_depth=0)]) == [5, 3, 0]


def test_no_row_drafts_past_its_max_tokens(demo_model, monkeypatch):
    """Near max_tokens a row drafts at most the tokens it may still emit, less one (a round
    emits its drafts and one more), so the last rounds compute no drafts to throw away."""
    lm = demo_model
    seen = []
    real_draft = speculative.draft

    def draft(model, batch, depths, certain=None):
        seen.extend((s.key, s.tokens_left, d) for s, d in zip(batch.rows, depths))
        return real_draft(model, batch, depths, certain)

    monkeypatch.setattr(speculative, "draft", draft)
    sched = Scheduler(lm.model, lm.tokenizer, policy=DepthPolicy(max_depth=4, fixed=True), copy_max=0)
    limits = {"a": 3, "b": 7, "c": 40}
    for key, n in limits.items():
        sched.add(key, lm.tokenizer.encode("def main(argv):\n    "), SamplingParams(max_tokens=n, ignore_eos=True), 4)
    out = {key: [] for key in limits}
    while sched.has_work():
        for key, chunk in sched.step():
            out[key] += chunk.token_ids
    assert {key: len(t) for key, t in out.items()} == limits
    assert all(d == min(4, left - 1) for _, left, d in seen), seen
    assert ("a", 2, 1) in seen, seen  # after its first token, "a" may emit 2 more: one draft


@pytest.mark.slow
def test_scheduler_sends_a_row_with_wrong_drafts_to_depth_zero(demo_model, monkeypatch):
    """Real rounds on the demo model (its head is accepted ~90% of the time): one row's
    head proposals are replaced by a token the backbone never picks in code (a head
    that is always wrong for that row); the policy stops that row from drafting while
    the other rows keep drafting, and keeps re-probing it."""
    lm = demo_model
    never = lm.tokenizer.convert_tokens_to_ids("<tool_response>")
    real_draft = speculative.draft

    def draft(model, batch, depths, certain=None):
        drafts = real_draft(model, batch, depths, certain)
        bad = [i for i, s in enumerate(batch.rows) if s.key == "bad" and depths[i]]
        if bad:
            drafts.tokens[bad[0]] = never
        return drafts

    class ModelledCosts(DepthPolicy):
        """Round times from COST instead of the wall clock: the machine's load must not decide."""

        def observe(self, rows, depths, accepted, seconds):
            super().observe(rows, depths, accepted, COST[max(depths)])

    monkeypatch.setattr(speculative, "draft", draft)
    sched = Scheduler(lm.model, lm.tokenizer, policy=ModelledCosts(max_depth=2), copy_max=0)  # the head's drafts alone
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    prompts = {"a": "import os\nimport sys\n\ndef main(argv):\n    ", "b": "class Stack:\n    def __init__(self):\n",
               "bad": "def read_config(path):\n    with open(path) as f:\n"}
    for key, text in prompts.items():
        sched.add(key, lm.tokenizer.encode(text), params, 2)
    history = []
    while sched.has_work():
        for _ in sched.step():
            pass
        if len(sched.last_round) == 3:
            history.append({key: d for key, (d, _) in sched.last_round.items()})
    late = history[30:]  # after the policy has measured the costs of each depth
    assert len(late) > 2 * ROW_REPROBE_EVERY
    assert sum(h["bad"] == 0 for h in late) >= 0.8 * len(late), late
    assert sum(h["a"] > 0 and h["b"] > 0 for h in late) >= 0.8 * len(late), late
    assert any(h["bad"] > 0 for h in late)  # re-probes stay on

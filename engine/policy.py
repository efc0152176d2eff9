"""How many tokens each row drafts, from costs measured on this machine and each
row's own acceptance.

A round over B rows whose longest row drafts K costs t(B, C, K) (K head steps and
one verify of K+1 tokens per row, padding included), measured on the running
machine: moving averages per batch-size bucket, context bucket C and K. C is the
longest row's context length rounded down to a power of two (1k at least): a
window's attention over the cache grows with it (at 22k tokens of context a verify
window of the demo model cost ~2 plain steps where at 1k it cost ~1.2), so a depth
that pays at 1k may not at 22k; each bucket measures its own costs. A row with conditional
acceptances a_1, a_2, ... (its own, per draft position) emits on average
E(K) = 1 + a_1 + a_1 a_2 + ... tokens per round at depth K.

Each row prefers the depth that would maximise its own tokens per second,
E(K) / t(B, K), K = 0 included. The round's window is the longest preference.
Rows draft up to it (the window is paid for anyway) unless their drafts
practically never land: those stay at 0, so they never drag their neighbours
down, and re-probe now and then so they recover when their acceptance returns. Every K is tried a few times per (batch, context) bucket before its cost is
trusted (its first round, which pays for allocation and kernel tracing, is not
counted), and a depth not chosen for a while is measured again.

A row that could copy drafts from its context (engine/context_drafts.py) copies the
length L that maximises its own tokens per second, E_copy(L) / w(B, C, L+1), where
w is the measured time of a copy round whose window holds L+1 tokens (per window
bucket 4, 8, 16, 32, 64), and only where that beats the head's rate at the depth
chosen above (depth 0: plain decoding, so a copy never runs slower than plain).
A window bucket never measured yet is costed from mtp-tune's measurement of it (in plain
steps, `window_costs` in the model's mtp_serve.json) times this bucket's plain step; without
one, or once a measurement is old, as the longest measured window no longer than it, copies'
or the head's: an underestimate, so one round tries it and measures it.

One policy serves one row and many: a single stream is a batch of one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from .context_drafts import MIN_COPY
from .sequence import Sequence, ema_update

COST_EMA = 0.2
ROW_EMA = 0.15  # weight of one round in a row's acceptance estimate
PROBE_WEIGHT = 0.5  # ... and of a re-probe after a row sat at depth 0
PRIOR_EMA = 0.05  # weight of one row's round in the model-wide acceptance
PROBES = 2  # measured rounds per (bucket, K) before its cost is used
REPROBE_EVERY = 64  # rounds of a bucket after which an unchosen depth is measured again
ROW_REPROBE_EVERY = 16  # rounds a row stays at depth 0 before it drafts once more (doubling after each failure)
MIN_CONTEXT_BUCKET = 1024  # shorter contexts share one cost estimate (attention is a small part there)
PRIOR_ACCEPTANCE = 0.5  # per position, before anything was observed
RIDE_MIN_ACCEPTANCE = 0.1  # a row below this first-draft acceptance stays out of an open window


def batch_bucket(b: int) -> int:
    """1, 2, 4, 8, ...: rounds of similar batch size share their cost estimate."""
    n = 1
    while n < b:
        n *= 2
    return n


def window_bucket(n: int) -> int:
    """4, 8, 16, 32, 64, ...: verify windows of n tokens round up to a power of two (4 at least)."""
    w = 4
    while w < n:
        w *= 2
    return w


def context_bucket(n: int) -> int:
    """1024, 2048, 4096, ...: the power of two n rounds down to (1024 at least)."""
    c = MIN_CONTEXT_BUCKET
    while c * 2 <= n:
        c *= 2
    return c


Bucket = Tuple[int, int]  # (batch bucket, context bucket)


def round_bucket(rows: List[Sequence]) -> Bucket:
    """The cost bucket of a round over these rows: its batch size and its longest row's context."""
    return batch_bucket(len(rows)), context_bucket(max(s.context_length for s in rows))


@dataclass
class DepthPolicy:
    max_depth: int = 2  # the server's --mtp-depth: no row drafts more
    fixed: bool = False  # every row drafts its cap (tests, benchmarks)
    # Copy lengths from measured window costs; False: every copy a row is expected to emit more
    # from than from the head (no choice follows timing, so a run repeats exactly, chunks included).
    # None: timed unless `fixed` (a fixed policy's rounds never depend on the machine's speed).
    timed_copies: Optional[bool] = None
    round_time: Dict[Tuple[int, int, int], float] = field(default_factory=dict)  # (batch, context, K) -> seconds
    samples: Dict[Tuple[int, int, int], int] = field(default_factory=dict)  # rounds seen, the warm-up one included
    last_round: Dict[Tuple[int, int, int], int] = field(default_factory=dict)  # bucket round count when last run
    rounds: Dict[Bucket, int] = field(default_factory=dict)  # rounds per (batch, context) bucket
    prior: List[float] = field(default_factory=list)  # model-wide acceptance per position: new rows start here
    copy_time: Dict[Tuple[int, int, int], float] = field(default_factory=dict)  # (batch, context, window bucket) -> s
    copy_samples: Dict[Tuple[int, int, int], int] = field(default_factory=dict)
    copy_last: Dict[Tuple[int, int, int], int] = field(default_factory=dict)  # `ticks` when last measured
    ticks: int = 0  # rounds observed, of every kind
    # Window bucket -> cost in plain steps measured by mtp-tune (engine/window_costs.py): a
    # bucket's copy rounds are costed from it until the bucket is measured here.
    window_prior: Dict[int, float] = field(default_factory=dict)

    @classmethod
    def serving(cls, max_depth: int, fixed: bool, window_costs: Iterable[Tuple[int, float]] = ()) -> "DepthPolicy":
        """The policy mtp-serve and mtp-generate run: `fixed` (--fixed-depth) also chooses copies
        by expected tokens, not timing, so a run repeats exactly; copy windows start from
        mtp-tune's `window_costs` (the model card's)."""
        return cls(max_depth=max_depth, fixed=fixed, window_prior=dict(window_costs))

    def __post_init__(self) -> None:
        if self.timed_copies is None:
            self.timed_copies = not self.fixed

    def request_cap(self, seq: Sequence) -> int:
        """The most a request ever drafts per round: its own limit within the server's."""
        return max(0, min(seq.max_depth, self.max_depth))

    def cap(self, seq: Sequence) -> int:
        """This round's cap. A round emits at most depth + 1 tokens: near max_tokens, deeper
        drafts would be thrown away."""
        return max(0, min(self.request_cap(seq), seq.tokens_left - 1))

    def depths(self, rows: List[Sequence]) -> List[int]:
        """Drafts per row for the next round."""
        caps = [self.cap(s) for s in rows]
        top = max(caps)
        if self.fixed or top == 0:
            return caps
        bucket = round_bucket(rows)
        for K in range(top + 1):  # costs not measured yet: every row takes part
            if self.samples.get((*bucket, K), 0) < PROBES + 1:
                return [min(c, K) for c in caps]
        prefs = [self.preferred(s, c, bucket) for s, c in zip(rows, caps)]
        open_ = any(prefs)
        hopeless = self.hopeless(bucket, top)
        wants = [p > 0 or (c > 0 and not hopeless and (open_ and self._rides(s) or self._probe_due(s, open_)))
                 for s, c, p in zip(rows, caps, prefs)]
        window = max(max(prefs), 1)
        now = self.rounds.get(bucket, 0)
        stale = [K for K in range(top + 1) if now - self.last_round.get((*bucket, K), 0) > REPROBE_EVERY]
        if stale:  # measure an old cost estimate again (with the rows that draft anyway)
            if stale[0] == 0:
                return [0] * len(rows)
            if hopeless:  # the machine may have become quieter: one round in REPROBE_EVERY tells
                return [min(c, stale[0]) for c in caps]
            if any(wants):
                window = stale[0]
        return [min(c, window) if w else 0 for c, w in zip(caps, wants)]

    def hopeless(self, bucket: Bucket, top: int) -> bool:
        """Whether no depth could pay here even if every draft landed: K+1 tokens in a round
        slower than K+1 plain steps (long contexts, where the window's attention dominates).
        Rows then stop re-probing their acceptance; only the stale-cost rounds draft."""
        plain = self.round_time[(*bucket, 0)]
        return all((K + 1) * plain <= self.round_time[(*bucket, K)] for K in range(1, top + 1))

    def _rides(self, seq: Sequence) -> bool:
        """Once another row opened the window, its padding positions are computed anyway:
        a row drafts into them unless its drafts practically never land."""
        return seq.acceptance.expected_tokens(1, self.prior_at(0)) - 1 >= RIDE_MIN_ACCEPTANCE

    @staticmethod
    def _probe_due(seq: Sequence, window_open: bool) -> bool:
        """An idle row drafts again to re-measure itself: cheaply when other rows draft
        anyway; when its draft would open the window alone, less often after each failure."""
        a = seq.acceptance
        return a.idle_rounds >= (ROW_REPROBE_EVERY if window_open else ROW_REPROBE_EVERY << min(a.failed_probes, 4))

    def preferred(self, seq: Sequence, cap: int, bucket: Bucket) -> int:
        """The depth that maximises this row's own tokens per second at this batch size and context."""
        return max(range(cap + 1), key=lambda K: self.expected_tokens(seq, K) / self.round_time[(*bucket, K)])

    def expected_tokens(self, seq: Sequence, K: int) -> float:
        return seq.acceptance.expected_tokens(K, self.prior_at(K))

    def prior_at(self, j: int) -> float:
        return self.prior[j] if j < len(self.prior) else PRIOR_ACCEPTANCE

    def start_rates(self) -> List[float]:
        """Acceptance a new row starts from: what rows of this model showed so far."""
        return list(self.prior)

    def observe(self, rows: List[Sequence], depths: List[int], accepted: List[int], seconds: Optional[float]) -> None:
        """Record a round: its wall time (None: not a sample of the head's window costs),
        and each row's drafts accepted."""
        self.ticks += 1
        for s, d, m in zip(rows, depths, accepted):
            # A re-probe after an idle stretch counts for more: a row recovers in one round.
            weight = PROBE_WEIGHT if s.acceptance.idle_rounds >= ROW_REPROBE_EVERY else ROW_EMA
            s.acceptance.observe(d, m, weight, self.prior_at)
            ema_update(self.prior, d, m, PRIOR_EMA, lambda j: PRIOR_ACCEPTANCE)
        if seconds is None:
            return
        K = max(depths)
        bucket = round_bucket(rows)
        key = (*bucket, K)
        n = self.samples.get(key, 0)
        if n == 1:  # the first measured round (round 0 was the warm-up)
            self.round_time[key] = seconds
        elif n > 1:
            self.round_time[key] += COST_EMA * (seconds - self.round_time[key])
        self.samples[key] = n + 1
        self.rounds[bucket] = self.rounds.get(bucket, 0) + 1
        self.last_round[key] = self.rounds[bucket]

    def head_round_rate(self, seq: Sequence, depth: int, bucket: Bucket) -> Optional[float]:
        """Expected tokens per second of a round in which the row drafts `depth` from the head
        (None while that round time is not measured)."""
        t = self.round_time.get((*bucket, depth))
        return None if t is None else self.expected_tokens(seq, depth) / t

    def window_seconds(self, bucket: Bucket, n: int) -> Optional[float]:
        """Time of a round whose verify window holds n tokens: the measured copy-window cost of
        its bucket where fresh; for a bucket never measured here, mtp-tune's cost of it times
        this bucket's plain step; else the longest measured window no longer than it (copies'
        or the head's K+1), else the shortest measured. None before any is measured."""
        return self._window_costs(bucket)(n)

    def _window_costs(self, bucket: Bucket) -> Callable[[int], Optional[float]]:
        """`window_seconds` of one bucket for any n, its measurements gathered once."""
        fresh = {k[2]: t for k, t in self.copy_time.items()
                 if k[:2] == bucket and self.ticks - self.copy_last[k] <= REPROBE_EVERY}
        plain = self.round_time.get((*bucket, 0))
        prior = {w: c * plain for w, c in self.window_prior.items()
                 if plain is not None and (*bucket, w) not in self.copy_samples}
        known = sorted([(m, t) for m, t in fresh.items()]
                       + [(k[2] + 1, t) for k, t in self.round_time.items() if k[:2] == bucket])

        def seconds(n: int) -> Optional[float]:
            w = window_bucket(n)
            if w in fresh:
                return fresh[w]
            if w in prior:
                return prior[w]
            if not known:
                return None
            below = [t for m, t in known if m <= n]
            return below[-1] if below else known[0][1]

        return seconds

    def copy_length(self, seq: Sequence, order: int, available: int, depth: int, bucket: Bucket) -> int:
        """How many of `available` copied tokens (a match of `order`) the row drafts this round:
        the length with the most expected tokens per second, if that beats the head's drafts
        at `depth`; 0 where it does not (the head or plain decoding pays more). Before the
        round times are measured: all of them, if they are expected to emit more tokens."""
        if available < MIN_COPY:
            return 0
        c = seq.copy_cap.rates[order]
        head = self.head_round_rate(seq, depth, bucket)
        window = self._window_costs(bucket) if self.timed_copies else (lambda n: None)
        expected, term, best, rate = 1.0, 1.0, 0, head
        for L in range(1, available + 1):
            term *= c
            expected += term  # E_copy(L) = 1 + c + ... + c^L
            t = window(L + 1)
            if t is None or head is None:
                more = seq.copy_cap.expected_tokens(order, available) > self.expected_tokens(seq, depth)
                return available if more else 0
            if L >= MIN_COPY and expected / t > rate:
                best, rate = L, expected / t
        return best

    def observe_copies(self, rows: List[Sequence], lengths: List[int], depths: List[int], seconds: float) -> None:
        """A round with copied or forced drafts: its time is a sample of the cost of its window
        (the longest chain, or the longest head draft, plus one), its first one not counted."""
        key = (*round_bucket(rows), window_bucket(max(lengths + depths) + 1))
        n = self.copy_samples.get(key, 0)
        if n == 1 or (n > 1 and self.ticks - self.copy_last[key] > REPROBE_EVERY):  # first or stale: start over
            self.copy_time[key] = seconds
        elif n > 1:
            self.copy_time[key] += COST_EMA * (seconds - self.copy_time[key])
        self.copy_samples[key] = n + 1
        self.copy_last[key] = self.ticks

    def summary(self) -> dict:
        return {
            "acceptance_per_position": [round(a, 3) for a in self.prior],
            "round_ms": {f"B{b}/C{c}/K{k}": round(t * 1e3, 2) for (b, c, k), t in sorted(self.round_time.items())},
            "copy_round_ms": {f"B{b}/C{c}/W{w}": round(t * 1e3, 2) for (b, c, w), t in sorted(self.copy_time.items())},
        }

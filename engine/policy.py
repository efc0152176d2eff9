"""How deep batched rounds draft, chosen from costs measured on this machine.

A round with K drafts over B rows costs t(B, K) (K head steps plus one
verify of K+1 tokens per row) and yields, per row, 1 + a1 + a1*a2 + ... +
a1*..*aK tokens in expectation, where a_j is the observed acceptance at draft
position j. The policy picks the K that maximizes B * E[tokens] / t(B, K),
K = 0 (plain batched decoding) included, so drafting is used only where it
pays. Round times are measured on the running machine (exponential moving
averages per batch-size bucket and K); each (bucket, K) is tried a few times
before the estimates are trusted (its first round, which pays for allocation
and kernel compilation, is not counted), and every depth is re-measured now
and then so an estimate cannot go stale.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

EMA = 0.2
PROBES = 2  # measured rounds per (bucket, K) before its estimate is used
REPROBE_EVERY = 64  # rounds of a bucket after which an unchosen depth is measured again
PRIOR_ACCEPTANCE = 0.5


def batch_bucket(b: int) -> int:
    """1, 2, 4, 8, ...: rounds of similar batch size share their cost estimate."""
    n = 1
    while n < b:
        n *= 2
    return n


@dataclass
class DepthPolicy:
    max_depth: int = 3
    fixed: bool = False  # always draft max_depth (tests, benchmarks)
    round_time: Dict[Tuple[int, int], float] = field(default_factory=dict)
    samples: Dict[Tuple[int, int], int] = field(default_factory=dict)  # rounds seen, the warm-up one included
    last_round: Dict[Tuple[int, int], int] = field(default_factory=dict)  # bucket round count when last run
    rounds: Dict[int, int] = field(default_factory=dict)  # rounds per bucket
    accepted: List[float] = field(default_factory=list)  # per draft position, EMA of acceptance

    def acceptance(self, j: int) -> float:
        return self.accepted[j] if j < len(self.accepted) else PRIOR_ACCEPTANCE

    def expected_tokens(self, K: int) -> float:
        total, run = 1.0, 1.0
        for j in range(K):
            run *= self.acceptance(j)
            total += run
        return total

    def choose(self, batch_size: int, limit: int) -> int:
        """Depth for the next batched round; `limit` caps it (the rows' own depths)."""
        top = min(self.max_depth, limit)
        if self.fixed or top <= 0:
            return max(top, 0)
        bucket = batch_bucket(batch_size)
        now = self.rounds.get(bucket, 0)
        for K in range(top + 1):  # explore before exploiting, and re-measure stale depths
            if self.samples.get((bucket, K), 0) < PROBES + 1 or now - self.last_round[(bucket, K)] > REPROBE_EVERY:
                return K
        return max(range(top + 1), key=lambda K: self.expected_tokens(K) / self.round_time[(bucket, K)])

    def observe(self, batch_size: int, K: int, seconds: float, accepted_per_position: List[Tuple[int, int]]) -> None:
        """Record a round: its wall time, and (accepted, drafted) counts per draft position."""
        bucket = batch_bucket(batch_size)
        key = (bucket, K)
        n = self.samples.get(key, 0)
        if n == 1:  # the first measured round (round 0 was the warm-up)
            self.round_time[key] = seconds
        elif n > 1:
            self.round_time[key] = (1 - EMA) * self.round_time[key] + EMA * seconds
        self.samples[key] = n + 1
        self.rounds[bucket] = self.rounds.get(bucket, 0) + 1
        self.last_round[key] = self.rounds[bucket]
        for j, (acc, drafted) in enumerate(accepted_per_position):
            if drafted == 0:
                continue
            rate = acc / drafted
            if j < len(self.accepted):
                self.accepted[j] = (1 - EMA) * self.accepted[j] + EMA * rate
            else:
                self.accepted.append(rate)

    def summary(self) -> dict:
        return {
            "acceptance_per_position": [round(a, 3) for a in self.accepted],
            "round_ms": {f"B{b}/K{k}": round(t * 1e3, 2) for (b, k), t in sorted(self.round_time.items())},
        }

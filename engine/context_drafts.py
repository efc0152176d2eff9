"""Drafts copied from the context: the tokens that followed an earlier occurrence of the
sequence's most recent tokens, in its own prompt or output.

Agents' replies repeat their context: a file rewritten with a small edit, an edit call's
old text, paths and identifiers in tool arguments. Where the last few tokens occurred
before, what followed them there is a good guess at what follows now, often for dozens
of tokens; the verify window checks the whole guess in one backbone pass.

    index = ContextIndex(prompt)
    index.extend(new_tokens)         # as tokens are committed (no rescan)
    drafts = index.propose(limit=32) # [] where the recent tokens never occurred before

The index maps every n-gram (n in ORDERS) to where it last ended. Proposals come from the
longest order that matches, at its most recent earlier occurrence. A copied draft comes
with certainty (its draft distribution is a point mass), which the round's acceptance
rules handle exactly: greedy and seeded rows accept it while it equals the target's own
choice; other sampled rows accept it with the target's probability of it and, on
rejection, draw from the target with it removed.

`CopyCap` is a row's record of its copies: per matched order, the chance that the next
copied token lands given the ones before it did (a moving average from a prior that trusts
long matches more), which gives the tokens a copy is expected to emit; and a length limit
that doubles while whole copies land and falls to what landed when one is cut short.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

# n-gram lengths matched, longest first; two tokens recur by chance too often to be worth a window
ORDERS = (16, 8, 4, 3)
MIN_COPY = 2  # tokens: shorter proposals are left to the MTP head
# P(a copied token lands | the ones before it did), before a row has copied, by matched order
PRIOR_RATE = {16: 0.95, 8: 0.9, 4: 0.75, 3: 0.6}
RATE_EMA = 0.3  # weight of one copy in a row's rate
RATE_RECOVERY = 0.02  # per round without copying, a rate moves back this far towards its prior
MAX_COPY = 32  # most tokens a row copies in one round (the default of the server's --copy-drafts)


class ContextIndex:
    def __init__(self, tokens: Sequence[int] = ()):
        self.tokens: List[int] = []
        # n -> key of an n-gram -> where it last ended (a collision costs a wrong guess, never a wrong token)
        self._last: Dict[int, Dict[int, int]] = {n: {} for n in ORDERS}
        self._build(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def _build(self, tokens: Sequence[int]) -> None:
        """Index a whole prompt at once: every order's keys in numpy (a long agent prompt is
        indexed in milliseconds, not the ~0.1 s per 1k tokens of a token-by-token extend)."""
        toks = np.asarray(tokens, dtype=np.uint64)
        ends = len(toks) - 1  # the newest token's n-grams stay out, as `extend` keeps them
        for n, last in self._last.items():
            if ends >= n:
                keys = np.zeros(ends - n + 1, dtype=np.uint64)
                for i in range(n):
                    keys = keys * _MULT + toks[i : ends - n + 1 + i]
                last.update(zip(keys.tolist(), range(n - 1, ends)))  # later ends overwrite earlier ones
        self.tokens = [int(t) for t in tokens]

    def extend(self, tokens: Sequence[int]) -> None:
        """Append committed tokens. The n-grams that end at the newest token stay out of
        the index until the next token arrives, so a lookup of the current suffix finds
        an earlier occurrence, never itself."""
        toks = self.tokens
        for t in tokens:
            end = len(toks) - 1  # the previous newest token: its n-grams go in now
            if end >= 0:
                for n, last in self._last.items():
                    if end + 1 >= n:
                        last[_key(toks, end + 1 - n, end + 1)] = end
            toks.append(int(t))

    def propose(self, limit: int) -> List[int]:
        """Up to `limit` tokens that followed the longest earlier match of the newest tokens."""
        return self.match(limit)[0]

    def match(self, limit: int) -> Tuple[List[int], int]:
        """`propose`'s tokens and the order (n-gram length) that matched (0: none)."""
        toks = self.tokens
        if limit <= 0:
            return [], 0
        for n in ORDERS:
            if len(toks) < n:
                continue
            end = self._last[n].get(_key(toks, len(toks) - n, len(toks)))
            if end is not None:
                return toks[end + 1 : end + 1 + limit], n
        return [], 0


_MULT = np.uint64(0x100000001B3)  # an n-gram's key: its tokens as a polynomial in this, mod 2**64
_MASK = (1 << 64) - 1


def _key(toks: List[int], start: int, stop: int) -> int:
    """The key `_build` computes in numpy for toks[start:stop], in Python integers."""
    k, m = 0, int(_MULT)
    for t in toks[start:stop]:
        k = (k * m + t) & _MASK
    return k


@dataclass
class CopyCap:
    """A row's copies so far: how likely each matched order's copies land, and a length limit."""

    limit: int = 8
    rates: Dict[int, float] = field(default_factory=lambda: dict(PRIOR_RATE))
    # This round's match that the row did not copy (its order and tokens), to be checked
    # against what the round emits: a row learns its rates without paying a window for them.
    passed: Optional[Tuple[int, List[int]]] = None

    def expected_tokens(self, order: int, length: int) -> float:
        """Tokens a round copying `length` tokens of a match of `order` emits on average
        (its landed copies and the token after them)."""
        c = self.rates[order]
        return sum(c**j for j in range(length + 1))

    def idle(self) -> None:
        """A round without copying: each rate drifts back towards its prior (so a row whose
        copies once failed tries again later)."""
        for n, prior in PRIOR_RATE.items():
            self.rates[n] += RATE_RECOVERY * (prior - self.rates[n])

    def pass_over(self, order: int, chain: List[int]) -> None:
        """A round that could have copied `chain` (a match of `order`) and drafts otherwise."""
        self.passed = (order, chain)

    def settle(self, emitted: List[int]) -> None:
        """After the round: the passed-over match scored against the tokens it emitted, as if
        it had been copied (a copied token lands with the probability that the target emits
        it, so this is the same evidence a copy gives, for the tokens the round reached)."""
        if self.passed is None:
            return
        (order, chain), self.passed = self.passed, None
        compared = min(len(chain), len(emitted))
        landed = next((j for j in range(compared) if chain[j] != emitted[j]), compared)
        self._update_rate(order, compared, landed)

    def observe(self, order: int, drafted: int, accepted: int, most: int = MAX_COPY) -> None:
        self._update_rate(order, drafted, accepted)
        if accepted == drafted:
            self.limit = min(most, self.limit * 2)
        else:
            self.limit = max(MIN_COPY, min(most, accepted + 1))

    def _update_rate(self, order: int, drafted: int, accepted: int) -> None:
        if order in self.rates and drafted > 0:  # (0: a chain the scheduler did not match, e.g. given to the round directly)
            trials = accepted + (accepted < drafted)  # the landed ones, and the one that did not
            self.rates[order] += RATE_EMA * (accepted / trials - self.rates[order])

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

`CopyCap` is a row's adaptive length limit: it doubles while whole copies are accepted,
falls to what was accepted when a copy is cut short, and backs off from copying for a
while after copies that land nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

# n-gram lengths matched, longest first; two tokens recur by chance too often to be worth a window
ORDERS = (16, 8, 4, 3)
MIN_COPY = 2  # tokens: shorter proposals are left to the MTP head
MAX_COPY = 32  # most tokens a row copies in one round (the default of the server's --copy-drafts)


class ContextIndex:
    def __init__(self, tokens: Sequence[int] = ()):
        self.tokens: List[int] = []
        # n -> hash of an n-gram -> where it last ended (a collision costs a wrong guess, never a wrong token)
        self._last: Dict[int, Dict[int, int]] = {n: {} for n in ORDERS}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

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
                        last[hash(tuple(toks[end + 1 - n : end + 1]))] = end
            toks.append(int(t))

    def propose(self, limit: int) -> List[int]:
        """Up to `limit` tokens that followed the longest earlier match of the newest tokens."""
        toks = self.tokens
        if limit <= 0:
            return []
        for n in ORDERS:
            if len(toks) < n:
                continue
            end = self._last[n].get(hash(tuple(toks[-n:])))
            if end is not None:
                return toks[end + 1 : end + 1 + limit]
        return []


@dataclass
class CopyCap:
    """A row's copy length limit, adapted to how its copies fare."""

    limit: int = 8
    backoff: int = 0  # rounds left without copying
    misses: int = 0  # copies in a row that landed nothing

    def ready(self) -> bool:
        if self.backoff > 0:
            self.backoff -= 1
            return False
        return True

    def observe(self, drafted: int, accepted: int, most: int = MAX_COPY) -> None:
        if accepted == drafted:
            self.limit = min(most, self.limit * 2)
            self.misses = 0
        elif accepted == 0:
            self.misses += 1
            self.limit = max(MIN_COPY, self.limit // 2)
            self.backoff = 1 << min(self.misses, 6)  # 2, 4, ... 64 rounds
        else:
            self.limit = max(MIN_COPY, min(most, accepted + 1))
            self.misses = 0

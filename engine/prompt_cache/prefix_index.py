"""Find the longest stored token prefix of a prompt without comparing whole prompts.

Entries (snapshots in memory, snapshot files on disk) are bucketed by the
name of their last full token block (`snapshot.block_hashes`; "" for none),
and within a bucket told apart by their tail tokens. A lookup walks the
prompt's block names from the longest down and stops at the first bucket
holding an entry that matches: O(prompt blocks) hash probes plus a few short
tail comparisons, whatever the number of entries.
"""

from __future__ import annotations

from typing import Callable, Dict, Generic, List, Optional, Protocol, TypeVar

import numpy as np

from .snapshot import BLOCK_TOKENS


class Entry(Protocol):
    n: int
    chain: List[str]
    tail: np.ndarray


E = TypeVar("E", bound=Entry)


class PrefixIndex(Generic[E]):
    def __init__(self) -> None:
        self._buckets: Dict[str, List[E]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @staticmethod
    def _bucket(chain: List[str], k: int) -> str:
        return chain[k - 1] if k else ""

    def add(self, e: E) -> None:
        self._buckets.setdefault(self._bucket(e.chain, len(e.chain)), []).append(e)
        self._count += 1

    def remove(self, e: E) -> None:
        key = self._bucket(e.chain, len(e.chain))
        bucket = self._buckets[key]
        bucket.remove(e)
        if not bucket:
            del self._buckets[key]
        self._count -= 1

    def longest_prefix(self, tokens: np.ndarray, chain: List[str], max_n: int,
                       accept: Callable[[E], bool] = lambda e: True) -> Optional[E]:
        """The longest accepted entry of at most `max_n` tokens that is a prefix of
        `tokens` (whose block names are `chain`)."""
        for k in range(min(len(chain), max_n // BLOCK_TOKENS), -1, -1):
            best = None
            for e in self._buckets.get(self._bucket(chain, k), ()):
                if (e.n <= max_n and (best is None or e.n > best.n) and len(e.chain) == k
                        and np.array_equal(tokens[k * BLOCK_TOKENS : e.n], e.tail) and accept(e)):
                    best = e
            if best is not None:
                return best
        return None

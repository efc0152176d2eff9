"""Sequences decoding together: their caches merged along the batch axis.

Rows join (prefilled alone, then merged) and leave (filtered out) between
rounds. Each row keeps its own acceptance: after a batched verify, the
GatedDeltaNet state is selected per row, and each row's attention KV drops
its own rejected tail (`RollbackBatchKVCache.trim_rows`: the dropped entries
become masked holes, nothing is copied). The MTP head's cache is batched the
same way.
"""

from __future__ import annotations

from typing import Any, List, Optional

import mlx.core as mx
from mtp_serve.models.caches import RollbackBatchKVCache, SpeculativeGDNCache

from .sequence import Sequence


def _merge_gdn(caches: List[SpeculativeGDNCache]) -> SpeculativeGDNCache:
    merged = SpeculativeGDNCache()
    merged.cache = [mx.concatenate([c[i] for c in caches], axis=0) for i in range(2)]
    return merged


def merge_caches(per_row: List[List[Any]]) -> List[Any]:
    """Single-sequence caches (one list per row) -> batched caches."""
    out = []
    for layer_caches in zip(*per_row):
        if isinstance(layer_caches[0], SpeculativeGDNCache):
            out.append(_merge_gdn(list(layer_caches)))
        else:
            out.append(RollbackBatchKVCache.merge(list(layer_caches)))
    return out


def extend_caches(batch: List[Any], other: List[Any]) -> None:
    for a, b in zip(batch, other):
        a.extend(b)


def filter_caches(batch: List[Any], keep: List[int]) -> None:
    idx = mx.array(keep)
    for c in batch:
        c.filter(idx)


def extract_caches(batch: List[Any], i: int) -> List[Any]:
    return [c.extract(i) for c in batch]


def trim_rows(batch: List[Any], rejected: List[int]) -> None:
    """Drop `rejected[i]` trailing KV entries of row i (attention caches only)."""
    if max(rejected) == 0:
        return
    for c in batch:
        if isinstance(c, RollbackBatchKVCache):
            c.trim_rows(rejected)


class Batch:
    """The rows of a batched decode and their batched caches."""

    def __init__(self, seqs: List[Sequence]):
        self.seqs: List[Sequence] = []
        self.cache: Optional[List[Any]] = None
        self.head_cache: Optional[List[Any]] = None  # one-element list, like `cache`
        for s in seqs:
            self.add(s)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def uses_mtp(self) -> bool:
        return self.head_cache is not None

    def add(self, seq: Sequence) -> None:
        """Take over a prefilled sequence's caches."""
        cache = merge_caches([seq.cache])
        head = merge_caches([[seq.head_cache]]) if seq.head_cache is not None else None
        if self.cache is None:
            self.cache, self.head_cache = cache, head
        else:
            extend_caches(self.cache, cache)
            if self.head_cache is not None and head is not None:
                extend_caches(self.head_cache, head)
            else:
                self.head_cache = None
        seq.cache = seq.head_cache = None  # the batch owns them now
        self.seqs.append(seq)

    def remove(self, seqs: List[Sequence]) -> None:
        keep = [i for i, s in enumerate(self.seqs) if s not in seqs]
        if not keep:
            self.seqs, self.cache, self.head_cache = [], None, None
            return
        filter_caches(self.cache, keep)
        if self.head_cache is not None:
            filter_caches(self.head_cache, keep)
        self.seqs = [self.seqs[i] for i in keep]

    def release(self, seq: Sequence) -> Sequence:
        """Hand a row back to single-sequence decoding with its own caches."""
        i = self.seqs.index(seq)
        seq.cache = extract_caches(self.cache, i)
        if self.head_cache is not None:
            seq.head_cache = self.head_cache[0].extract(i)
        self.remove([seq])
        return seq

"""The running rows and the caches they decode with, for 1..B rows.

One row keeps its own single-sequence caches (mlx-lm's KVCache: no masks, no
per-row bookkeeping, the fastest form for one stream). From two rows on, the
caches are merged along the batch axis: attention KV in `RollbackBatchKVCache`
(each row drops its own rejected tail as masked holes, nothing is copied),
GatedDeltaNet state stacked per row, the MTP head's KV batched the same way.
Rows join (prefilled alone, then merged) and leave (filtered out) between
rounds; when the batch shrinks to one row, that row's caches are squeezed back
to the single form. The round code (`speculative.py`) is the same for both
forms: the cache operations it uses accept either.
"""

from __future__ import annotations

from typing import Any, List, Optional

import mlx.core as mx

from mtp_serve.models.caches import SpeculativeGDNCache, merge_kv
from mtp_serve.models.qwen4_exp_mtp import holds_rows, merge_rows
from mtp_serve.models.rope_positions import RopePositions

from .image_prompt import row_delta
from .sequence import RowCaches, Sequence, Status


def _merge_layer(caches: List[Any]) -> Any:
    if isinstance(caches[0], SpeculativeGDNCache):
        merged = SpeculativeGDNCache()
        merged.cache = [mx.concatenate([c[i] for c in caches], axis=0) for i in range(2)]
        return merged
    return merge_kv(caches)


def _merge(rows: List[RowCaches]) -> RowCaches:
    layers = [list(layer) for layer in zip(*(r.backbone for r in rows))]
    if holds_rows(rows[0].backbone):  # qwen4_exp: its backbone runs row by row
        backbone = merge_rows(layers)
    else:
        backbone = [_merge_layer(layer) for layer in layers]
    head = _merge_layer([r.head for r in rows]) if rows[0].head is not None else None
    return RowCaches(backbone, head)


def _extract(caches: RowCaches, i: int) -> RowCaches:
    return RowCaches([c.extract(i) for c in caches.backbone], caches.head.extract(i) if caches.head is not None else None)


class Batch:
    def __init__(self) -> None:
        self.rows: List[Sequence] = []
        self.caches: Optional[RowCaches] = None  # single form (1 row) or merged (2+ rows)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def cache(self) -> List[Any]:
        return self.caches.backbone

    @property
    def head_cache(self) -> Optional[Any]:
        return self.caches.head

    @property
    def rope(self) -> Optional[RopePositions]:
        """The rows' RoPE shift (rows of prompts with images), None when every row has none."""
        return row_delta(self.rows)

    def add(self, seq: Sequence) -> None:
        """A prefilled sequence joins; the batch owns its caches from now on."""
        caches = seq.take_caches()
        if not self.rows:
            self.caches = caches
        elif len(self.rows) == 1:
            self.caches = _merge([self.caches, caches])
        else:
            new = _merge([caches])
            for a, b in zip(self.caches.backbone, new.backbone):
                a.extend(b)
            if new.head is not None:
                self.caches.head.extend(new.head)
        seq.status = Status.RUNNING
        self.rows.append(seq)

    def row_caches(self, seq: Sequence) -> RowCaches:
        """A row's caches as single-sequence caches (a copy when merged; the
        live ones in the single form: take a snapshot before the next round)."""
        if len(self.rows) == 1:
            return self.caches
        return _extract(self.caches, self.rows.index(seq))

    def remove(self, seq: Sequence) -> None:
        """A row leaves; its caches are dropped."""
        i = self.rows.index(seq)
        self.rows.pop(i)
        if not self.rows:
            self.caches = None
        elif len(self.rows) == 1:
            self.caches = _extract(self.caches, 1 - i)  # back to the single form
        else:
            keep = mx.array([j for j in range(len(self.rows) + 1) if j != i])
            for c in self.caches.backbone:
                c.filter(keep)
            if self.caches.head is not None:
                self.caches.head.filter(keep)

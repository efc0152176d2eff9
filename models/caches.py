"""Caches that let a verify pass be rolled back without re-running the backbone.

A speculative verify forwards T = K+1 tokens. Attention layers roll back by
trimming KV (mlx-lm's `KVCache.trim`; in a batch, `RollbackBatchKVCache`
per row). GatedDeltaNet layers carry a recurrent state and a conv window that
cannot be trimmed, so during a verify the GDN layer records the whole conv
input and the window's per-position states (in WY form, see
`gated_delta_window`), and the commit keeps the state for the accepted length
(vLLM's per-position state slots, SGLang's intermediate state caches), computing
only that one.
"""

from __future__ import annotations

from typing import Any, List, Optional

import mlx.core as mx
import numpy as np

from .mlx_lm_compat import ArraysCache, BatchKVCache, KVCache


class SpeculativeGDNCache(ArraysCache):
    """ArraysCache([conv_window, ssm_state]) that can capture a verify window.

    While capturing, the layer records the whole conv input and the window's
    per-position states (an object whose `after(n)` gives the state after n
    positions, computed only for the n a commit keeps).
    """

    def __init__(self, left_padding: Optional[List[int]] = None):
        super().__init__(size=2, left_padding=left_padding)
        self.capturing = False
        self.conv_input: Optional[mx.array] = None  # [B, kernel-1+T, C]
        self.window: Optional[Any] = None  # WindowStates or StackedStates

    def record(self, conv_input: mx.array, window: Any) -> None:
        self.conv_input = conv_input
        self.window = window

    def select(self, accepted_tokens: mx.array | int) -> None:
        """Keep the state after `accepted_tokens` verify positions (1..T).

        `accepted_tokens` is an int, or an int array [B] for per-row selection.
        """
        if self.window is None:
            raise RuntimeError("select() without a captured verify pass")
        n_keep = self.conv_input.shape[1] - self.window.length
        if isinstance(accepted_tokens, int):
            n = accepted_tokens
            self[0] = mx.contiguous(self.conv_input[:, n : n + n_keep])
        else:
            pos = (accepted_tokens.astype(mx.int32)[:, None] + mx.arange(n_keep)[None])[..., None]
            self[0] = mx.take_along_axis(self.conv_input, pos, axis=1)
        self[1] = self.window.after(accepted_tokens)
        self.release()

    def release(self) -> None:
        self.conv_input = None
        self.window = None

    def extract(self, idx):
        cache = SpeculativeGDNCache()
        cache.cache = [c[idx : idx + 1] for c in self.cache]
        return cache


class RollbackBatchKVCache(BatchKVCache):
    """mlx-lm's BatchKVCache whose rows can each drop their last n entries.

    Rows of a batch share one write index, so a row that rolls back more than
    the others cannot simply move its end. Instead of shifting the row's whole
    KV along the buffer (mlx-lm's right-padding roll: a copy of the entire
    cache per rollback, ruinous at long context), the dropped entries become
    holes: masked out of attention, their position freed for the row's next
    tokens (RoPE positions come from the per-row `offset`, not the buffer
    index). Data never moves. What every row drops moves the write index back;
    the rest stays as holes until the row leaves (`extract` squeezes them out of
    a row handed back to single-sequence decoding), so the buffer runs ahead of
    the longest row by the other rows' extra rollbacks, not by the rejected total.
    """

    def __init__(self, left_padding: List[int]):
        super().__init__(left_padding)
        self.holes: Optional[mx.array] = None  # [B, _idx] bool, True where an entry was rolled back

    @classmethod
    def merge(cls, caches: List[KVCache]) -> "RollbackBatchKVCache":
        merged = super().merge(caches)
        return merged if isinstance(merged, cls) else cls([0] * len(caches))  # all empty: mlx-lm returns its own class

    def _holes_or_none(self, n: int) -> Optional[mx.array]:
        """Holes over buffer positions [0, n) (positions past _idx are never holes)."""
        if self.holes is None:
            return None
        h = self.holes[:, :n]
        return mx.pad(h, [(0, 0), (0, n - h.shape[1])]) if h.shape[1] < n else h

    def trim_rows(self, rejected: List[int]) -> None:
        """Drop the last `rejected[i]` entries of row i."""
        common = min(rejected)
        if common:  # what every row drops: just move the write index back
            self.trim(common)
        rest = mx.array([r - common for r in rejected])
        if max(rejected) == common:
            return
        pos = mx.arange(self._idx)[None]
        dropped = pos >= (self._idx - rest)[:, None]
        self.holes = dropped if self.holes is None else (self._holes_or_none(self._idx) | dropped)
        self.offset = self.offset - rest

    def trim(self, n: int) -> int:
        n = super().trim(n)
        if self.holes is not None:
            self.holes = self.holes[:, : self._idx]
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        mask = super().make_mask(N, return_array=return_array, **kwargs)
        holes = self._holes_or_none(self._idx)
        if holes is not None:
            mask = mask & ~mx.pad(holes, [(0, 0), (0, N)])[:, None, None, :]
        return mask

    def filter(self, batch_indices) -> None:
        idx_before = self._idx
        if self.holes is not None:
            self.holes = self._holes_or_none(self._idx)[batch_indices]
        super().filter(batch_indices)
        if self.holes is not None:
            self.holes = self.holes[:, idx_before - self._idx :]  # the shift `filter` applied to the buffer

    def extend(self, other: "RollbackBatchKVCache") -> None:
        max_idx = max(self._idx, other._idx)
        if self.holes is not None or getattr(other, "holes", None) is not None:
            def aligned(c):  # right-aligned at max_idx, as `extend` aligns the buffers
                h = c._holes_or_none(c._idx) if getattr(c, "holes", None) is not None else None
                if h is None:
                    h = mx.zeros((c.offset.shape[0], c._idx), dtype=mx.bool_)
                return mx.pad(h, [(0, 0), (max_idx - c._idx, 0)])

            self.holes = mx.concatenate([aligned(self), aligned(other)])
        super().extend(other)

    def extract(self, idx: int) -> KVCache:
        if self.holes is None:
            return super().extract(idx)
        mx.eval(self.left_padding, self.holes)
        pad = self.left_padding.tolist()[idx]
        keep = np.nonzero(~np.array(self._holes_or_none(self._idx)[idx])[pad:])[0] + pad
        keep = mx.array(keep.astype(np.int32))
        cache = KVCache()
        cache.keys = mx.contiguous(self.keys[idx : idx + 1, :, keep])
        cache.values = mx.contiguous(self.values[idx : idx + 1, :, keep])
        cache.offset = cache.keys.shape[2]
        return cache


def set_capture(cache: List[Any], on: bool) -> None:
    for c in cache:
        if isinstance(c, SpeculativeGDNCache):
            c.capturing = on


def trim_per_row(cache: Any, rejected: List[int]) -> None:
    """Drop the last `rejected[i]` entries of row i of an attention cache: a batched
    one per row (holes), a single-sequence one (one row) by moving its end."""
    if isinstance(cache, RollbackBatchKVCache):
        cache.trim_rows(rejected)
    elif rejected[0]:
        cache.trim(rejected[0])


def keep_verified(cache: List[Any], kept: List[int], width: int) -> None:
    """After a captured verify of `width` tokens per row, keep the first `kept[i]`
    of row i: GatedDeltaNet state after them, attention KV trimmed to them."""
    select = kept[0] if len(kept) == 1 else mx.array(kept)
    rejected = [width - k for k in kept]
    for c in cache:
        if isinstance(c, SpeculativeGDNCache):
            c.select(select)
        else:
            trim_per_row(c, rejected)

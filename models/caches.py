"""Caches that let a verify pass be rolled back without re-running the backbone.

A speculative verify forwards T = K+1 tokens. Attention layers roll back by
trimming KV (mlx-lm's `KVCache.trim`; in a batch, `RollbackBatchKVCache`
per row). GatedDeltaNet layers carry a recurrent state and a conv window that
cannot be trimmed, so during a verify the GDN layer records the whole conv
input and what gives the window's per-position states (on the native kernel its
last state and its inputs, to step an earlier one again: `gdn.ReplayStates`; else
every position's state, `gdn.StackedStates`), and the commit keeps the state for the
accepted length (vLLM's per-position state slots, SGLang's intermediate state
caches), computing only that one.

Attention KV is kept at the compute dtype or, with `KVSetting(bits, group_size)`
(`--kv-bits`), quantized as mlx-lm's QuantizedKVCache keeps it: each entry's
keys and values as a (packed, scales, biases) triple, groups along the head
dimension, so every entry is quantized on its own and a window of T entries
stores the same bits as T single steps. `QuantizedKVCache` is the single-row
form, `RollbackBatchQuantizedKVCache` the batched one (the same holes as
`RollbackBatchKVCache`); trims move an index, never requantize.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from .mlx_lm_compat import ArraysCache, BatchKVCache, KVCache
from .mlx_lm_compat import QuantizedKVCache as _MlxQuantizedKVCache

KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class KVSetting:
    """The precision of attention KV: the compute dtype (`bits` None), or `bits`-bit
    integers in groups of `group_size` along the head dimension, each group with
    its own scale and bias (mlx-lm's QuantizedKVCache layout)."""

    bits: Optional[int] = None
    group_size: int = 64

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def tag(self) -> str:
        """Short name: in prompt-cache keys, disk fingerprints and metrics."""
        return f"q{self.bits}g{self.group_size}" if self.quantized else "full"

    def __str__(self) -> str:
        return f"{self.bits}-bit, groups of {self.group_size}" if self.quantized else "full precision"

    def check(self, head_dims: Sequence[int]) -> None:
        """Raises ValueError unless every attention layer (head dims given) can hold it."""
        if not self.quantized:
            return
        if self.bits not in KV_BITS:
            raise ValueError(f"--kv-bits must be one of {', '.join(map(str, KV_BITS))} (got {self.bits})")
        if self.group_size not in KV_GROUP_SIZES:
            raise ValueError(f"--kv-group-size must be one of {', '.join(map(str, KV_GROUP_SIZES))} (got {self.group_size})")
        bad = sorted({d for d in head_dims if d % self.group_size})
        if bad:
            raise ValueError(f"--kv-group-size {self.group_size} does not divide the attention head dimension {bad[0]}")

    def bytes_per_vector(self, dim: int, itemsize: int) -> int:
        """Bytes one key or value vector of `dim` values takes (compute dtype of `itemsize` bytes)."""
        if not self.quantized:
            return dim * itemsize
        return dim * self.bits // 8 + 2 * (dim // self.group_size) * itemsize  # packed values, scales and biases

    def make(self) -> Any:
        """An empty single-row attention cache at this setting."""
        return QuantizedKVCache(self.group_size, self.bits) if self.quantized else KVCache()

    @classmethod
    def of(cls, cache: Any) -> "KVSetting":
        """The setting an attention cache holds its KV at."""
        bits = getattr(cache, "bits", None)
        return cls(bits, cache.group_size) if bits is not None else FULL_KV


FULL_KV = KVSetting()


def kv_map(fn: Callable[[mx.array], mx.array], part: Any) -> Any:
    """`fn` over a KV part: an array (full precision) or a quantized triple."""
    return tuple(fn(a) for a in part) if isinstance(part, tuple) else fn(part)


def kv_arrays(part: Any) -> List[mx.array]:
    return list(part) if isinstance(part, tuple) else [part]


def kv_nbytes(part: Any) -> int:
    return sum(a.nbytes for a in kv_arrays(part)) if part is not None else 0


def kv_length(part: Any) -> int:
    """Entries (positions) a KV part holds along the sequence axis."""
    return kv_arrays(part)[0].shape[2]


def kv_concatenate(parts: List[Any]) -> Any:
    if isinstance(parts[0], tuple):
        return tuple(mx.concatenate([p[i] for p in parts], axis=2) for i in range(len(parts[0])))
    return mx.concatenate(parts, axis=2)


class QuantizedKVCache(_MlxQuantizedKVCache):
    """mlx-lm's QuantizedKVCache, with the size and byte count the engine reads.
    Its `trim` moves the offset back; the next update overwrites the entries."""

    def size(self) -> int:
        return self.offset

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else kv_nbytes(self.keys) + kv_nbytes(self.values)


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
        self.window: Optional[Any] = None  # ReplayStates or StackedStates

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
        return self._single(lambda x: mx.contiguous(x[idx : idx + 1, :, keep]))

    def _single(self, take: Callable[[mx.array], mx.array]) -> Any:
        """A single-row cache holding take(keys), take(values)."""
        cache = KVCache()
        cache.keys, cache.values = take(self.keys), take(self.values)
        cache.offset = cache.keys.shape[2]
        return cache


class _QuantizedBatchKV(BatchKVCache):
    """BatchKVCache's storage for quantized KV: keys and values are (packed, scales,
    biases) triples [B, H, S, *], written with `mx.quantize` per entry. The same
    bookkeeping (offsets, left padding, write index) as mlx-lm's full-precision one."""

    def __init__(self, left_padding: List[int], group_size: int = 64, bits: int = 8):
        super().__init__(left_padding)
        self.group_size, self.bits = group_size, bits

    def _empty(self, B: int, H: int, n: int, dim: int, dtype: mx.Dtype):
        per_int = 32 // self.bits
        return (mx.zeros((B, H, n, dim // per_int), mx.uint32), mx.zeros((B, H, n, dim // self.group_size), dtype),
                mx.zeros((B, H, n, dim // self.group_size), dtype))

    def update_and_fetch(self, keys, values):
        prev, (B, H, T, Dk), Dv = self._idx, keys.shape, values.shape[3]
        if self.keys is None or prev + T > self.keys[0].shape[2]:
            n = (self.step + T - 1) // self.step * self.step
            new_k, new_v = self._empty(B, H, n, Dk, keys.dtype), self._empty(B, H, n, Dv, values.dtype)
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys, self.values = (kv_map(lambda x: x[..., :prev, :], p) for p in (self.keys, self.values))
                self.keys, self.values = kv_concatenate([self.keys, new_k]), kv_concatenate([self.values, new_v])
            else:
                self.keys, self.values = new_k, new_v
        self.offset = self.offset + T
        self._idx += T
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for i in range(3):
            self.keys[i][..., prev : self._idx, :] = qk[i]
            self.values[i][..., prev : self._idx, :] = qv[i]
        return self.keys_and_values()

    def keys_and_values(self):
        return tuple(kv_map(lambda x: x[..., : self._idx, :], p) for p in (self.keys, self.values))

    def filter(self, batch_indices) -> None:
        if self.keys is not None:
            self.keys, self.values = (kv_map(lambda x: x[batch_indices], p) for p in (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        min_left_pad = min(self.left_padding.tolist())  # shift left to drop common padding, as mlx-lm does
        if min_left_pad > 0:
            if self.keys is not None:
                self.keys, self.values = (kv_map(lambda x: x[..., min_left_pad:, :], p) for p in (self.keys, self.values))
            self._idx -= min_left_pad
            self.left_padding -= min_left_pad

    def extend(self, other: "_QuantizedBatchKV") -> None:
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        max_idx = max(self._idx, other._idx)
        max_size = max(kv_length(c.keys) for c in (self, other) if c.keys is not None)
        like = self if self.keys is not None else other

        def pad(c):  # right-justified at max_idx, all max_size long
            k, v = c.keys, c.values
            if k is None:
                k, v = (kv_map(lambda x: mx.zeros((c.offset.shape[0], x.shape[1], 0, x.shape[3]), x.dtype), p)
                        for p in (like.keys, like.values))
            left = max_idx - c._idx
            right = max_size - kv_length(k) - left
            if right < 0:
                k, v = (kv_map(lambda x: x[..., :right, :], p) for p in (k, v))
                right = 0
            if left or right:
                k, v = (kv_map(lambda x: mx.pad(x, [(0, 0), (0, 0), (left, right), (0, 0)]), p) for p in (k, v))
            return k, v, c.offset, c.left_padding + left

        (k1, v1, o1, l1), (k2, v2, o2, l2) = pad(self), pad(other)
        cat = lambda a, b: tuple(mx.concatenate([x, y]) for x, y in zip(a, b))  # noqa: E731
        self.keys, self.values = cat(k1, k2), cat(v1, v2)
        self.offset, self.left_padding = mx.concatenate([o1, o2]), mx.concatenate([l1, l2])
        self._idx = max_idx

    def extract(self, idx: int) -> Any:
        mx.eval(self.left_padding)
        pad = self.left_padding.tolist()[idx]
        return self._single(lambda x: mx.contiguous(x[idx : idx + 1, :, pad : self._idx]))

    def _single(self, take: Callable[[mx.array], mx.array]) -> Any:
        cache = QuantizedKVCache(self.group_size, self.bits)
        cache.keys, cache.values = kv_map(take, self.keys), kv_map(take, self.values)
        cache.offset = kv_length(cache.keys)
        return cache

    @classmethod
    def merge(cls, caches: List[Any]) -> "_QuantizedBatchKV":
        group_size, bits = caches[0].group_size, caches[0].bits
        lengths = [c.size() for c in caches]
        max_length = max(lengths)
        padding = [max_length - n for n in lengths]
        cache = cls(padding, group_size, bits)
        if max_length == 0:
            return cache
        some = next(c for c in caches if c.keys is not None)
        B = len(caches)
        keys = tuple(mx.zeros((B, x.shape[1], max_length, x.shape[3]), x.dtype) for x in some.keys)
        values = tuple(mx.zeros((B, x.shape[1], max_length, x.shape[3]), x.dtype) for x in some.values)
        for i, (p, c) in enumerate(zip(padding, caches)):
            if c.keys is None:
                continue
            for j in range(3):
                keys[j][i : i + 1, :, p : p + c.offset] = c.keys[j][..., : c.offset, :]
                values[j][i : i + 1, :, p : p + c.offset] = c.values[j][..., : c.offset, :]
        cache.keys, cache.values = keys, values
        cache.offset += max_length
        cache._idx = max_length
        return cache

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else kv_nbytes(self.keys) + kv_nbytes(self.values)


class RollbackBatchQuantizedKVCache(RollbackBatchKVCache, _QuantizedBatchKV):
    """RollbackBatchKVCache (per-row rollback as masked holes) over quantized KV."""

    def __init__(self, left_padding: List[int], group_size: int = 64, bits: int = 8):
        _QuantizedBatchKV.__init__(self, left_padding, group_size, bits)
        self.holes = None

    _single = _QuantizedBatchKV._single


def merge_kv(caches: List[Any]) -> RollbackBatchKVCache:
    """Single-row attention caches (all at one setting) merged into a batched one."""
    if isinstance(caches[0], _MlxQuantizedKVCache):
        return RollbackBatchQuantizedKVCache.merge(caches)
    return RollbackBatchKVCache.merge(caches)


def set_capture(cache: List[Any], on: bool) -> None:
    for c in cache:
        if isinstance(c, SpeculativeGDNCache):
            c.capturing = on


def trim_per_row(cache: Any, rejected: List[int]) -> None:
    """Drop the last `rejected[i]` entries of row i of an attention cache: a batched
    one per row (holes), a single-sequence one (one row) by moving its end."""
    if isinstance(cache, RollbackBatchKVCache) or hasattr(cache, "trim_rows"):  # (or qwen4_exp's RowsKVCache)
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


def steps_back(cache: List[Any]) -> bool:
    """Whether `undo_step` can take one decode step back out of these backbone caches
    (attention KV drops its last entry; GatedDeltaNet layers get their arrays back)."""
    return all(isinstance(c, (SpeculativeGDNCache, KVCache, _MlxQuantizedKVCache, RollbackBatchKVCache)) for c in cache)


def before_step(cache: List[Any]) -> List[Optional[List[mx.array]]]:
    """What `undo_step` needs: each GatedDeltaNet layer's arrays (a step assigns new ones;
    MLX arrays are immutable, so keeping the references is free)."""
    return [list(c.cache) if isinstance(c, SpeculativeGDNCache) else None for c in cache]


def undo_step(cache: List[Any], saved: List[Optional[List[mx.array]]], rows: int) -> None:
    """Take back one decode step of `rows` rows taken after `before_step` gave `saved`."""
    for c, arrays in zip(cache, saved):
        if arrays is not None:
            c.cache = list(arrays)
        else:
            trim_per_row(c, [1] * rows)

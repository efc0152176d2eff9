"""Caches that let a verify pass be rolled back without re-running the backbone.

A speculative verify forwards T = K+1 tokens. Attention layers roll back by
trimming KV (mlx-lm's `KVCache.trim`). GatedDeltaNet layers carry a recurrent
state and a conv window that cannot be trimmed, so during a verify the GDN
layer records its state after every position plus the whole conv input
(`SpeculativeGDNCache.capture`), and the commit keeps the entry for the
accepted length (vLLM's per-position state slots, SGLang's intermediate
state caches).
"""

from __future__ import annotations

from typing import Any, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache


class SpeculativeGDNCache(ArraysCache):
    """ArraysCache([conv_window, ssm_state]) that can capture per-position state."""

    def __init__(self, left_padding: Optional[List[int]] = None):
        super().__init__(size=2, left_padding=left_padding)
        self.capturing = False
        self.conv_input: Optional[mx.array] = None  # [B, kernel-1+T, C]
        self.states: Optional[mx.array] = None  # [B, T, Hv, Dv, Dk]

    def record(self, conv_input: mx.array, states: mx.array) -> None:
        self.conv_input = conv_input
        self.states = states

    def select(self, accepted_tokens: mx.array | int) -> None:
        """Keep the state after `accepted_tokens` verify positions (1..T).

        `accepted_tokens` is an int, or an int array [B] for per-row selection.
        """
        if self.states is None:
            raise RuntimeError("select() without a captured verify pass")
        n_keep = self.conv_input.shape[1] - self.states.shape[1]
        if isinstance(accepted_tokens, int):
            n = accepted_tokens
            self[0] = mx.contiguous(self.conv_input[:, n : n + n_keep])
            self[1] = self.states[:, n - 1]
        else:
            n = accepted_tokens.astype(mx.int32)
            pos = (n[:, None] + mx.arange(n_keep)[None])[..., None]
            self[0] = mx.take_along_axis(self.conv_input, pos, axis=1)
            idx = (n - 1).reshape(-1, 1, 1, 1, 1)
            self[1] = mx.take_along_axis(self.states, idx, axis=1).squeeze(1)
        self.release()

    def release(self) -> None:
        self.conv_input = None
        self.states = None

    def extract(self, idx):
        cache = SpeculativeGDNCache()
        cache.cache = [c[idx : idx + 1] for c in self.cache]
        return cache


def set_capture(cache: List[Any], on: bool) -> None:
    for c in cache:
        if isinstance(c, SpeculativeGDNCache):
            c.capturing = on


def commit_verify(cache: List[Any], accepted_tokens: int, verified_tokens: int) -> None:
    """Roll a single-sequence cache back to `accepted_tokens` of a verify of `verified_tokens`."""
    for c in cache:
        if isinstance(c, SpeculativeGDNCache):
            c.select(accepted_tokens)
        elif verified_tokens > accepted_tokens:
            c.trim(verified_tokens - accepted_tokens)


def cache_offset(cache: List[Any]) -> int:
    for c in cache:
        if isinstance(c, KVCache):
            return c.offset
    raise ValueError("cache has no attention layer")

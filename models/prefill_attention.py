"""Causal attention for long inputs on CPU, one block of queries at a time.

MLX's `scaled_dot_product_attention` has no fused kernel on the CPU backend:
it materialises the whole [heads, L, S] score matrix, masks it, and runs a
softmax whose `exp` costs ~13 ns an element (see fast_math.py). For a
prefill chunk of 1,024 queries over 8,192 cached keys that is 32M scores per
attention layer, 128 MB written and read several times, and half of the last
chunk's scores computed only to be masked away.

Here queries go in blocks of `rows` positions. Block [a, a+n) sees every key
before it unmasked (the "past": one matmul, no mask) and an n x n diagonal
tile with the causal mask; no score above the diagonal is computed except
inside that tile. Each block's scores are sized to stay in the L2 cache, so
the max, exp, sum and value product passes read them from cache, and the exp
is `fast_math.exp_shifted`. The softmax is normalised after the value
product (out = (e @ v) / sum(e)): the same values as mlx-lm's path up to fp32
rounding.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .fast_math import exp_shifted

# Scores per block (all heads): 4 MiB of fp32. Measured on the demo model's shapes
# (2,048 queries, 4 heads over 2 KV heads): 64 rows over 4,096 keys 0.163 s
# against 0.174 at 32 and 0.302 at 128; 32 rows over 8,192 keys 0.374 s against
# 0.420 at 16 and 0.775 at 128 (the score tiles leave the cache).
BLOCK_SCORES = 1 << 20
MIN_ROWS, MAX_ROWS = 16, 256
# The keys all of a block's queries see are split at a multiple of KEY_STEP: the
# part before goes through `exp_shifted.fixed`, whose compiled shapes are then
# bounded by the context length / KEY_STEP; the rest, with the diagonal, through
# the shapeless `exp_shifted.anyshape`.
KEY_STEP = 512


def block_rows(heads: int, keys: int, budget: int = BLOCK_SCORES) -> int:
    """Queries per block: as many as keep heads * rows * keys within `budget`."""
    rows = budget // max(1, heads * keys)
    return max(MIN_ROWS, min(MAX_ROWS, rows - rows % MIN_ROWS))


def causal_attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, rows: Optional[int] = None
) -> mx.array:
    """softmax(scale q k^T + causal mask) v, the queries being the last L keys' positions.

    q [B, H, L, D]; k, v [B, Hk, S, D] with S >= L and H a multiple of Hk
    (grouped-query attention: query heads h*r .. h*r+r-1 read key head h).
    The `mask="causal"` contract of `mx.fast.scaled_dot_product_attention`.
    Returns [B, H, L, D].

    Scores are laid out [keys, queries] (k @ q^T): the softmax reductions then
    run over the second-to-last axis, which MLX's CPU reductions do ~5x faster
    than over the last one (measured: row max 1.2 ns a score, column max 0.24).
    """
    B, H, L, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    r = H // Hk
    start = S - L  # position of the first query
    rows = rows or block_rows(B * H, S)
    qt = (q * scale).reshape(B, Hk, r, L, D).transpose(0, 1, 4, 2, 3)  # [B, Hk, D, r, L]
    outs = []
    for a in range(0, L, rows):
        n = min(rows, L - a)
        end = start + a + n  # the block's queries see keys [0, end) up to the causal mask
        p = (start + a) // KEY_STEP * KEY_STEP if n == rows else 0  # keys [0, p): no mask
        w = end - p
        qb = qt[..., a : a + n].reshape(B, Hk, D, r * n)
        # keys [p, end): key p + j is visible to query start + a + i iff j <= start + a - p + i
        mask = (mx.arange(w)[:, None] <= mx.arange(start + a - p, end - p)[None])[:, None, :]
        sd = mx.where(mask, (k[:, :, p:end] @ qb).reshape(B, Hk, w, r, n), -mx.inf)
        m = sd.max(-3, keepdims=True)  # [B, Hk, 1, r, n]
        if p:
            sp = (k[:, :, :p] @ qb).reshape(B, Hk, p, r, n)
            m = mx.maximum(m, sp.max(-3, keepdims=True))
        ed = mx.where(mask, exp_shifted.anyshape(sd, m), 0.0)
        denom = ed.sum(-3)
        out = ed.reshape(B, Hk, w, r * n).swapaxes(-1, -2) @ v[:, :, p:end]
        if p:
            ep = exp_shifted.fixed(sp, m)
            denom = denom + ep.sum(-3)
            out = mx.addmm(out, ep.reshape(B, Hk, p, r * n).swapaxes(-1, -2), v[:, :, :p])
        outs.append(out.reshape(B, Hk, r, n, D) / denom[..., None])
        # One block at a time: evaluated together, MLX interleaves the blocks'
        # operations and their score tiles leave the cache (measured 1.2-1.9x slower).
        mx.eval(outs[-1])
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
    return out.reshape(B, H, L, D)

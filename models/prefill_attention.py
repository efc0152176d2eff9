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

Blocks are per key head (with the query heads that read it), and independent:
MLX's CPU backend runs each stream's operations on one thread, so the
blocks of a wave go to one stream per core, with OpenBLAS on one thread
(the max, exp and sum passes, otherwise on one core, then run on all of
them: 512 queries over 8,192 keys of the demo model took 88-93 ms as one
stream of all-head blocks, 48 ms on two streams). Neither the blocks nor OpenBLAS's threads depend on the
number of cores, so the result is the same, bit for bit, on any machine
(unless the user fixed OPENBLAS_NUM_THREADS).
"""

from __future__ import annotations

import os
import threading
from typing import List, Optional

import mlx.core as mx

from mtp_serve.backend import blas_threads, blas_threads_adjustable

from .fast_math import exp_shifted

# Scores per block (one key head's queries): 4 MiB of fp32, about one core's L2.
# Measured on the demo model's shapes (512 queries over 8,192 keys, 4 query heads
# over 2 key heads, two streams): 2 MiB 52 ms, 4 MiB 48 ms, 8 MiB 111 ms (the
# score tiles leave the cache).
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
    rows = rows or block_rows(B * r, S)
    qt = (q * scale).reshape(B, Hk, r, L, D).transpose(0, 1, 4, 2, 3)  # [B, Hk, D, r, L]
    blocks = [(h, a) for a in range(0, L, rows) for h in range(Hk)]
    streams = _streams(len(blocks))
    outs = {}
    mx.eval(qt, k, v)  # (the layer's projections, on every core, before BLAS goes to one thread)
    # Products on one OpenBLAS thread however many streams run (OpenBLAS's bits depend on its threads).
    with blas_threads(1):
        for w in range(0, len(blocks), len(streams)):
            wave = blocks[w : w + len(streams)]
            for (h, a), stream in zip(wave, streams):
                with mx.stream(stream):
                    outs[h, a] = _block(qt[:, h : h + 1], k[:, h : h + 1], v[:, h : h + 1], S - L, a, min(rows, L - a), rows)
            # One wave at a time: evaluated together, MLX interleaves the blocks'
            # operations and their score tiles leave the cache (measured 1.2-1.9x slower).
            mx.eval([outs[b] for b in wave])
    heads = [mx.concatenate([outs[h, a] for a in range(0, L, rows)], axis=3) for h in range(Hk)]
    return mx.concatenate(heads, axis=1).reshape(B, H, L, D)


def full_attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """softmax(scale q k^T) v without a mask (a vision tower's attention over an image's
    patches), in the same blocks and streams as `causal_attention`. q, k, v [B, H, L, D]."""
    B, H, L, D = q.shape
    rows = block_rows(B, L)
    qt = (q * scale).swapaxes(-1, -2)  # [B, H, D, L]: scores [keys, queries], see causal_attention
    blocks = [(h, a) for a in range(0, L, rows) for h in range(H)]
    streams = _streams(len(blocks))
    outs = {}
    mx.eval(qt, k, v)
    with blas_threads(1):
        for w in range(0, len(blocks), len(streams)):
            wave = blocks[w : w + len(streams)]
            for (h, a), stream in zip(wave, streams):
                with mx.stream(stream):
                    s = k[:, h : h + 1] @ qt[:, h : h + 1, :, a : a + rows]  # [B, 1, L, n]
                    e = exp_shifted.anyshape(s, s.max(-2, keepdims=True))
                    outs[h, a] = (e.swapaxes(-1, -2) @ v[:, h : h + 1]) / e.sum(-2)[..., None]
            mx.eval([outs[b] for b in wave])
    heads = [mx.concatenate([outs[h, a] for a in range(0, L, rows)], axis=2) for h in range(H)]
    return mx.concatenate(heads, axis=1)


def _block(qt: mx.array, k: mx.array, v: mx.array, start: int, a: int, n: int, rows: int) -> mx.array:
    """Queries [a, a+n) of one key head (qt [B, 1, D, r, L], k, v [B, 1, S, D]; the
    first query at position `start`): returns [B, 1, r, n, D]."""
    B, _, D, r, _ = qt.shape
    end = start + a + n  # the block's queries see keys [0, end) up to the causal mask
    p = (start + a) // KEY_STEP * KEY_STEP if n == rows else 0  # keys [0, p): no mask
    w = end - p
    qb = qt[..., a : a + n].reshape(B, 1, D, r * n)
    # keys [p, end): key p + j is visible to query start + a + i iff j <= start + a - p + i
    mask = (mx.arange(w)[:, None] <= mx.arange(start + a - p, end - p)[None])[:, None, :]
    sd = mx.where(mask, (k[:, :, p:end] @ qb).reshape(B, 1, w, r, n), -mx.inf)
    m = sd.max(-3, keepdims=True)  # [B, 1, 1, r, n]
    if p:
        sp = (k[:, :, :p] @ qb).reshape(B, 1, p, r, n)
        m = mx.maximum(m, sp.max(-3, keepdims=True))
    ed = mx.where(mask, exp_shifted.anyshape(sd, m), 0.0)
    denom = ed.sum(-3)
    out = ed.reshape(B, 1, w, r * n).swapaxes(-1, -2) @ v[:, :, p:end]
    if p:
        ep = exp_shifted.fixed(sp, m)
        denom = denom + ep.sum(-3)
        out = mx.addmm(out, ep.reshape(B, 1, p, r * n).swapaxes(-1, -2), v[:, :, :p])
    return out.reshape(B, 1, r, n, D) / denom[..., None]


_LOCAL = threading.local()  # MLX streams belong to the thread that made them


def _streams(blocks: int) -> List[mx.Stream]:
    """One CPU stream per core (at most one per block), the default stream first.
    One stream only where this process cannot put OpenBLAS on one thread (the
    user fixed OPENBLAS_NUM_THREADS): streams then would oversubscribe the cores."""
    n = min(blocks, os.cpu_count() or 1) if blas_threads_adjustable() else 1
    extra = getattr(_LOCAL, "streams", None)
    if extra is None:
        extra = _LOCAL.streams = []
    while len(extra) < n - 1:
        extra.append(mx.new_stream(mx.cpu))
    return [mx.default_stream(mx.cpu)] + extra[: n - 1]

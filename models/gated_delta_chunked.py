"""Chunked (WY-form) gated delta rule in plain MLX ops.

Drop-in for ``mlx_lm.models.gated_delta.gated_delta_ops`` (same arguments,
same outputs) for prefill and training where mlx-lm's Metal kernel does not
run: instead of one small step per token, the sequence is cut into chunks of
``chunk_size`` tokens, everything inside a chunk is done with matrix products,
and only a short Python loop (``T / chunk_size`` iterations, three matmuls
each) carries the state from chunk to chunk. This is the algorithm of
flash-linear-attention's ``chunk_gated_delta_rule``.

Math (one head; state ``S`` is [Dv, Dk] as in mlx-lm). Per token t::

    S_t = g_t S_{t-1} + beta_t (v_t - g_t S_{t-1} k_t) k_t^T,   y_t = S_t q_t

Inside a chunk with start state ``S0`` and positions i = 1..C, let
``b_i = sum_{j<=i} log g_j`` (log-space cumulative decay, so tiny g neither
underflows a running product nor divides by zero) and ``gam_i = exp(b_i)``.
The state after position t can be written as::

    S_t = gam_t S0 + sum_{i<=t} exp(b_t - b_i) u_i k_i^T

where the "pseudo values" u_i satisfy a unit lower-triangular system::

    (I + A) U = diag(beta) (V - diag(gam) K S0^T),
    A_ij = beta_i exp(b_i - b_j) (k_i . k_j)   for j < i, else 0.

With ``T = (I + A)^{-1}`` (the WY representation) define, in parallel for
every chunk, ``W = T diag(beta gam) K`` and ``U~ = T diag(beta) V``. The
sequential part per chunk is then only (H = S^T, [Dk, Dv])::

    U      = U~ - W H
    H_next = gam_C H + (K * exp(b_C - b))^T U

and the outputs of all chunks are computed afterwards in one batch::

    Y = (Q * gam) H + (tril(Q K^T) * exp(b_t - b_i)) U

All exponents used are ``b_t - b_i <= 0`` (t >= i) or ``b_i <= 0``.
When Hv = r * Hk, q and k are not repeated: K K^T and Q K^T are computed
once per key head and broadcast over its r value heads.
``T`` comes from LAPACK's triangular inverse on the CPU stream (with a
custom VJP, ``d(M^-1) = -M^-T dX M^-T``) or, off the CPU, from a recursive
2x2-block inversion built from matmuls; both are exact to fp32 rounding
(no Neumann-series cancellation).

Masking: a masked position (``mask[b, t] == False``) is treated as g = 1,
beta = 0, which leaves the state exactly unchanged, as the ops path does.
Its output ``y`` is 0 (as in mlx-lm's Metal kernel). The ops path instead
returns the output of the discarded update there, so outputs at masked
positions differ; outputs at unmasked positions and the final state match.

g must lie in (0, 1] as in the ops contract (g = 0 is clamped to the
smallest normal float; g > 1 is treated as 1). Only scalar gating
(g [B, T, Hv]) is supported; vectorized g [B, T, Hv, Dk]
raises ``NotImplementedError`` (callers fall back to ``gated_delta_ops``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import mlx.core as mx
import numpy as np

__all__ = ["gated_delta_chunked"]

_F32_TINY = float(np.finfo(np.float32).tiny)
_LOG2E = 1.4426950408889634
# In the chunked rule, decays below e^-30 (~1e-13) are flushed to 0, and so are
# entries of (I + A)^-1 below 1e-30. Such terms vanish next to the O(1) terms they
# are summed with in fp32, and left in place they end in denormal products: real
# checkpoints decay fast (demo model: median log g -0.4 to -17 per token), and
# denormal arithmetic made a 1,024-token chunk ~3x slower on x86 (measured).
_EXP_FLUSH = -30.0
_INV_FLUSH = 1e-30


def _exp(x: mx.array) -> mx.array:
    """exp(x) as 2**(x log2 e): same fp32 accuracy, ~3x faster than mx.exp
    on MLX's CPU backend (measured), and differentiable."""
    return mx.power(2.0, x * _LOG2E)


def _exp_flushed(x: mx.array) -> mx.array:
    """`_exp`, 0 below e^-30."""
    return mx.where(x < _EXP_FLUSH, 0.0, _exp(mx.maximum(x, _EXP_FLUSH)))


# ---------------------------------------------------------------------------
# (I + A)^{-1} for strictly lower-triangular A, batched over leading dims.
# ---------------------------------------------------------------------------


@mx.custom_function
def _tri_inv_lower_cpu(m: mx.array) -> mx.array:
    """Inverse of lower-triangular ``m`` (LAPACK trtri on the CPU stream), in
    float64: with fast decay fp32 trtri ran into denormals, ~6x slower (measured)."""
    cpu = mx.cpu
    x = mx.linalg.tri_inv(m.astype(mx.float64, stream=cpu), upper=False, stream=cpu)
    return mx.where(mx.abs(x, stream=cpu) < _INV_FLUSH, 0.0, x, stream=cpu).astype(m.dtype, stream=cpu)


@_tri_inv_lower_cpu.vjp
def _tri_inv_lower_cpu_vjp(primals, cotangent, output):
    # X = M^-1  =>  dL/dM = -X^T (dL/dX) X^T; only the lower triangle is read.
    xt = output.swapaxes(-1, -2)
    return (mx.tril(-(xt @ cotangent @ xt)),)


_BLOCK_IDX: dict = {}


def _a21_index(c: int, s: int) -> mx.array:
    """Flat indices of the lower-left s x s block of each 2s diagonal block."""
    key = (c, s)
    idx = _BLOCK_IDX.get(key)
    if idx is None:
        p = np.arange(c // (2 * s))[:, None, None]
        a = np.arange(s)[None, :, None]
        b = np.arange(s)[None, None, :]
        idx = mx.array((((2 * p + 1) * s + a) * c + 2 * p * s + b).astype(np.int32))
        _BLOCK_IDX[key] = idx
    return idx


def _unit_lower_inv_blocked(a: mx.array) -> mx.array:
    """(I + a)^{-1}, a strictly lower [..., C, C], C a power of two.

    Bottom-up 2x2 block inversion: [[X11, 0], [A21, X22]] has inverse
    [[X11^-1, 0], [-X22^-1 A21 X11^-1, X22^-1]]. log2(C) levels of batched
    matmuls; stable (no powers of A are formed).
    """
    c = a.shape[-1]
    lead = a.shape[:-2]
    flat = a.reshape(*lead, c * c)
    x = mx.ones(lead + (c, 1, 1), dtype=a.dtype)
    s = 1
    while s < c:
        x11 = x[..., 0::2, :, :]
        x22 = x[..., 1::2, :, :]
        a21 = mx.take(flat, _a21_index(c, s), axis=-1)
        if s <= 2:  # tiny blocks: broadcasting beats batched gemm calls
            t = (a21[..., :, :, None] * x11[..., None, :, :]).sum(-2)
            x21 = -(x22[..., :, :, None] * t[..., None, :, :]).sum(-2)
        else:
            x21 = -(x22 @ (a21 @ x11))
        top = mx.concatenate([x11, mx.zeros_like(x11)], axis=-1)
        bot = mx.concatenate([x21, x22], axis=-1)
        x = mx.concatenate([top, bot], axis=-2)
        s *= 2
    return x[..., 0, :, :]


def _unit_lower_inv(a: mx.array, method: Optional[str] = None) -> mx.array:
    """(I + a)^{-1} for strictly lower-triangular a [..., C, C]."""
    c = a.shape[-1]
    if method is None:
        method = "lapack" if mx.default_device() == mx.cpu else "blocked"
    if method == "blocked" and c & (c - 1) == 0:
        return _unit_lower_inv_blocked(a)
    eye = mx.eye(c, dtype=a.dtype)
    return _tri_inv_lower_cpu(a + eye)


# ---------------------------------------------------------------------------
# The chunked rule.
# ---------------------------------------------------------------------------


def _to_chunks(x: mx.array, n: int, c: int, r: Optional[int] = None) -> mx.array:
    """[B, N*C, H, D] -> [N, B, H, C, D], or with ``r`` (H = Hk * r) ->
    [N, B, Hk, r, C, D]."""
    b, _, h, d = x.shape
    if r is None:
        return x.reshape(b, n, c, h, d).transpose(1, 0, 3, 2, 4)
    return x.reshape(b, n, c, h // r, r, d).transpose(1, 0, 3, 4, 2, 5)


# Measured on 2,048 tokens (medians, alternating): demo shapes (Hk=2, Hv=4, D=64)
# 15.1 ms at 32, 20.0 at 64, 59.6 at 128; Qwen3.5-0.8B shapes (Hk=Hv=16, D=128)
# 152 ms at 32, 384 at 64. Smaller chunks keep the per-chunk products in cache.
CHUNK_SIZE = 32


def gated_delta_chunked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array] = None,
    mask: Optional[mx.array] = None,
    chunk_size: int = CHUNK_SIZE,
    *,
    inverse: Optional[str] = None,
) -> Tuple[mx.array, mx.array]:
    """Chunked gated delta rule; contract of ``gated_delta_ops``.

    Shapes:
      - q, k: [B, T, Hk, Dk] (normalized, readout scale folded into q)
      - v: [B, T, Hv, Dv], Hv a multiple of Hk
      - g: [B, T, Hv] decay factors in (0, 1] (scalar gating only)
      - beta: [B, T, Hv]
      - state: [B, Hv, Dv, Dk] or None (zeros)
      - mask: [B, T] bool or None
    Returns:
      - y: [B, T, Hv, Dv] in q.dtype (0 at masked positions)
      - state: [B, Hv, Dv, Dk] float32

    ``inverse`` picks the triangular inverse ("lapack" or "blocked"); the
    default is LAPACK on the CPU device, blocked matmuls elsewhere.
    """
    if g.ndim == 4:
        raise NotImplementedError(
            "gated_delta_chunked supports scalar gating g [B, T, Hv] only"
        )
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    out_dtype = q.dtype
    f32 = mx.float32
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=f32)
    if T == 0:
        return mx.zeros((B, 0, Hv, Dv), dtype=out_dtype), state.astype(f32)

    r = Hv // Hk  # value heads per key head (GQA-style); q, k are not repeated
    q = q.astype(f32)
    k = k.astype(f32)
    v = v.astype(f32)
    beta = beta.astype(f32)
    # log g <= 0: g > 1 lies outside the contract and is treated as 1.
    log_g = mx.minimum(mx.log(mx.maximum(g.astype(f32), _F32_TINY)), 0.0)
    if mask is not None:
        m = mask[..., None]
        beta = mx.where(m, beta, 0.0)
        log_g = mx.where(m, log_g, 0.0)

    C = int(chunk_size)
    if T < C:  # one chunk: round up to a power of two, at least 8
        C = max(8, 1 << (T - 1).bit_length())
    N = -(-T // C)
    pad = N * C - T
    if pad:
        # Padded positions: k = v = q = 0, beta = 0, log g = 0 -> no effect.
        pw = [(0, 0), (0, pad), (0, 0), (0, 0)]
        q = mx.pad(q, pw)
        k = mx.pad(k, pw)
        v = mx.pad(v, pw)
        beta = mx.pad(beta, pw[:3])
        log_g = mx.pad(log_g, pw[:3])

    # Chunked layout [N, B, Hk, r, C, ...] (chunk index first: contiguous
    # chunk slices). Key-side tensors carry a broadcast r axis of size 1, so
    # K K^T and Q K^T are computed once per key head.
    Q = mx.contiguous(_to_chunks(q, N, C))[:, :, :, None]  # [N, B, Hk, 1, C, Dk]
    K = mx.contiguous(_to_chunks(k, N, C))[:, :, :, None]
    V = _to_chunks(v, N, C, r)  # [N, B, Hk, r, C, Dv]
    bt = _to_chunks(beta[..., None], N, C, r)  # [N, B, Hk, r, C, 1]
    bcum = mx.cumsum(_to_chunks(log_g[..., None], N, C, r), axis=-2)

    # Intra-chunk decay exp(b_t - b_i) on t >= i, 0 above. b is
    # non-increasing, so min(., 0) only touches the masked upper part.
    incl = mx.tril(mx.ones((C, C), dtype=f32))
    strict = mx.tril(mx.ones((C, C), dtype=f32), -1)
    decay = _exp_flushed(mx.minimum(bcum - bcum.swapaxes(-1, -2), 0.0)) * incl

    Kt = K.swapaxes(-1, -2)
    A = (bt * (K @ Kt)) * (decay * strict)  # [N, B, Hk, r, C, C]
    P = decay * (Q @ Kt)  # output mixing within the chunk (t >= i)
    Tinv = _unit_lower_inv(A, inverse)

    gam = _exp_flushed(bcum)  # [.., C, 1]
    W = Tinv @ (K * (bt * gam))  # [.., C, Dk]
    Ut = Tinv @ (V * bt)  # [.., C, Dv]
    b_last = bcum[..., -1:, :]  # [.., 1, 1]
    Kd = K * _exp_flushed(b_last - bcum)  # [.., C, Dk]
    g_last = _exp_flushed(b_last)  # [N, B, Hk, r, 1, 1]
    Qg = Q * gam

    # Sequential over chunks: H = S^T [B, Hk, r, Dk, Dv].
    H = state.astype(f32).reshape(B, Hk, r, Dv, Dk).swapaxes(-1, -2)
    os_ = []
    us = []
    for n in range(N):
        os_.append(Qg[n] @ H)  # inter-chunk part of the output
        u = mx.addmm(Ut[n], W[n], H, alpha=-1.0)
        us.append(u)
        H = mx.addmm(g_last[n] * H, Kd[n].swapaxes(-1, -2), u)
    U = mx.stack(us, axis=0)  # [N, B, Hk, r, C, Dv]
    Y = mx.addmm(mx.stack(os_, axis=0), P, U)

    y = Y.transpose(1, 0, 4, 2, 3, 5).reshape(B, N * C, Hv, Dv)
    if pad:
        y = y[:, :T]
    if mask is not None:
        y = mx.where(mask[..., None, None], y, 0.0)
    state = mx.contiguous(H.swapaxes(-1, -2)).reshape(B, Hv, Dv, Dk)
    return y.astype(out_dtype), state

import mtp_serve  # noqa: F401  (preloads OpenBLAS before mlx.core)

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.gated_delta import gated_delta_ops, normalize_qk

from mtp_serve.models.gated_delta_chunked import _unit_lower_inv, gated_delta_chunked
from mtp_serve.models.gdn import gated_delta_steps
from mtp_serve.models.mlx_lm_compat import compute_g

RTOL = 1e-4


def _inputs(B, T, Hk, Hv, Dk, Dv, seed=0, state=True, g_scale=2.0):
    mx.random.seed(seed)
    q = mx.random.normal((B, T, Hk, Dk))
    k = mx.random.normal((B, T, Hk, Dk))
    q, k = normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    v = mx.random.normal((B, T, Hv, Dv))
    g = mx.exp(-g_scale * mx.random.uniform(shape=(B, T, Hv)))
    beta = mx.random.uniform(shape=(B, T, Hv))
    s = 0.5 * mx.random.normal((B, Hv, Dv, Dk)) if state else None
    return q, k, v, g, beta, s


def _close(a, b, rtol=RTOL):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    scale = max(np.abs(b).max(), 1e-6)
    err = np.abs(a - b).max() / scale
    assert err < rtol, f"relative max error {err:.3e}"


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("T", [1, 7, 63, 65, 130])
def test_matches_ops(T, chunk_size):
    q, k, v, g, beta, s = _inputs(2, T, 2, 4, 32, 16, seed=T)
    y0, s0 = gated_delta_ops(q, k, v, g, beta, s)
    y1, s1 = gated_delta_chunked(q, k, v, g, beta, s, chunk_size=chunk_size)
    assert y1.shape == y0.shape and y1.dtype == q.dtype
    assert s1.shape == s0.shape and s1.dtype == mx.float32
    _close(y1, y0)
    _close(s1, s0)


def test_no_state_and_equal_heads():
    q, k, v, g, beta, _ = _inputs(1, 40, 3, 3, 16, 24, seed=3, state=False)
    y0, s0 = gated_delta_ops(q, k, v, g, beta)
    y1, s1 = gated_delta_chunked(q, k, v, g, beta, chunk_size=16)
    _close(y1, y0)
    _close(s1, s0)


@pytest.mark.parametrize("inverse", ["lapack", "blocked"])
def test_inverse_methods(inverse):
    q, k, v, g, beta, s = _inputs(1, 100, 1, 2, 32, 32, seed=5)
    y0, s0 = gated_delta_ops(q, k, v, g, beta, s)
    y1, s1 = gated_delta_chunked(q, k, v, g, beta, s, chunk_size=32, inverse=inverse)
    _close(y1, y0)
    _close(s1, s0)


def test_unit_lower_inverse_ill_conditioned():
    # Nearly identical keys, beta ~ 1, no decay: (I + A) ~ all-ones lower
    # triangle. Powers of A blow up (a Neumann product would cancel
    # catastrophically); both inverses must stay exact.
    C = 64
    rng = np.random.default_rng(0)
    a = np.tril(0.98 + 0.02 * rng.random((3, C, C)), -1).astype(np.float32)
    ref = np.linalg.inv(np.eye(C) + a.astype(np.float64))
    for method in ["lapack", "blocked"]:
        x = np.array(_unit_lower_inv(mx.array(a), method))
        assert np.abs(x - ref).max() / np.abs(ref).max() < 1e-5, method


def test_extreme_decay():
    # g spans tiny (including exact 0) to exactly 1: log-space cumsum must
    # neither overflow nor produce NaN.
    q, k, v, _, beta, s = _inputs(1, 70, 2, 2, 16, 16, seed=7)
    choices = mx.array([0.0, 1e-30, 1e-6, 0.5, 0.999, 1.0])
    idx = mx.random.randint(0, 6, (1, 70, 2))
    g = choices[idx]
    y0, s0 = gated_delta_ops(q, k, v, g, beta, s)
    y1, s1 = gated_delta_chunked(q, k, v, g, beta, s, chunk_size=32)
    assert not np.isnan(np.array(y1)).any()
    _close(y1, y0)
    _close(s1, s0)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_mask_left_padding(chunk_size):
    B, T = 3, 45
    q, k, v, g, beta, s = _inputs(B, T, 2, 4, 16, 16, seed=11)
    pad = np.array([0, 5, 20])
    m = np.arange(T)[None, :] >= pad[:, None]
    m[0, 30] = False  # a hole in the middle as well
    mask = mx.array(m)
    y0, s0 = gated_delta_ops(q, k, v, g, beta, s, mask)
    y1, s1 = gated_delta_chunked(q, k, v, g, beta, s, mask, chunk_size=chunk_size)
    _close(s1, s0)  # state: masked positions leave it unchanged
    mm = m[:, :, None, None]
    _close(np.where(mm, np.array(y1), 0), np.where(mm, np.array(y0), 0))
    assert np.all(np.array(y1)[~m] == 0)  # documented: y = 0 where masked


def test_bf16_inputs():
    q, k, v, g, beta, s = _inputs(1, 33, 2, 2, 16, 16, seed=13)
    qb, kb, vb = (x.astype(mx.bfloat16) for x in (q, k, v))
    y1, s1 = gated_delta_chunked(qb, kb, vb, g, beta, s, chunk_size=16)
    assert y1.dtype == mx.bfloat16 and s1.dtype == mx.float32
    y0, s0 = gated_delta_ops(
        qb.astype(mx.float32), kb.astype(mx.float32), vb.astype(mx.float32), g, beta, s
    )
    _close(y1.astype(mx.float32), y0, rtol=1e-2)
    _close(s1, s0)


def test_vectorized_g_unsupported():
    q, k, v, g, beta, s = _inputs(1, 8, 1, 1, 16, 16)
    gv = mx.broadcast_to(g[..., None], g.shape + (16,))
    with pytest.raises(NotImplementedError):
        gated_delta_chunked(q, k, v, gv, beta, s)


def test_gradients_match_ops():
    B, T, Hk, Hv, Dk, Dv = 1, 37, 1, 2, 16, 8
    mx.random.seed(21)
    q = mx.random.normal((B, T, Hk, Dk))
    k = mx.random.normal((B, T, Hk, Dk))
    v = mx.random.normal((B, T, Hv, Dv))
    a = mx.random.normal((B, T, Hv))
    b = mx.random.normal((B, T, Hv))
    s = 0.1 * mx.random.normal((B, Hv, Dv, Dk))
    wy = mx.random.normal((B, T, Hv, Dv))
    ws = mx.random.normal((B, Hv, Dv, Dk))

    def make_loss(fn):
        def loss(q, k, v, a, b, s):
            qn, kn = normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
            g = mx.exp(-mx.exp(a))
            y, st = fn(qn, kn, v, g, mx.sigmoid(b), s)
            return (y * wy).sum() + (st * ws).sum()

        return loss

    args = (q, k, v, a, b, s)
    argnums = list(range(len(args)))
    g0 = mx.grad(make_loss(gated_delta_ops), argnums=argnums)(*args)
    for inverse in ["lapack", "blocked"]:
        fn = lambda *x: gated_delta_chunked(*x, chunk_size=16, inverse=inverse)  # noqa: E731
        g1 = mx.grad(make_loss(fn), argnums=argnums)(*args)
        for x0, x1 in zip(g0, g1):
            _close(x1, x0)


def test_correlated_keys():
    # Keys nearly parallel, beta ~ 1, g ~ 1: the worst case for the WY solve.
    B, T, H, D = 1, 128, 2, 32
    mx.random.seed(17)
    base = mx.random.normal((B, 1, H, D))
    q = mx.random.normal((B, T, H, D))
    k = base + 0.02 * mx.random.normal((B, T, H, D))
    q, k = normalize_qk(q, k, inv_scale=D**-0.5, eps=1e-6)
    v = mx.random.normal((B, T, H, D))
    g = 1.0 - 1e-3 * mx.random.uniform(shape=(B, T, H))
    beta = 0.95 + 0.05 * mx.random.uniform(shape=(B, T, H))
    y0, s0 = gated_delta_ops(q, k, v, g, beta)
    for inverse in ["lapack", "blocked"]:
        y1, s1 = gated_delta_chunked(q, k, v, g, beta, chunk_size=64, inverse=inverse)
        _close(y1, y0)
        _close(s1, s0)


@pytest.mark.parametrize("T", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("B,Hk,Hv", [(1, 2, 4), (3, 1, 1)])
def test_verify_window_is_single_steps_bit_for_bit(T, B, Hk, Hv):
    """Off the native kernel (a GPU, a CPU without it) a verify window steps token by token:
    each position's output and kept state are the bits plain decoding's one-token steps give
    (mlx-lm's `gated_delta_update`), so greedy MTP keeps plain's tokens."""
    from mlx_lm.models.gated_delta import gated_delta_update

    q, k, v, _, _, s = _inputs(B, T, Hk, Hv, 32, 16, seed=T + B)
    a, b = mx.random.normal((B, T, Hv)), mx.random.normal((B, T, Hv))
    A_log, dt_bias = mx.random.normal((Hv,)), mx.random.normal((Hv,))
    g, beta = compute_g(A_log, a, dt_bias), mx.sigmoid(b)
    y, window = gated_delta_steps(q, k, v, g, beta, s, None)
    state = s
    for t in range(T):
        y1, state = gated_delta_update(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], a[:, t:t + 1], b[:, t:t + 1],
                                       A_log, dt_bias, state, None, use_kernel=False)
        assert mx.array_equal(y[:, t], y1[:, 0]).item(), f"position {t}"
        assert mx.array_equal(window.after(t + 1), state).item(), f"state after {t + 1}"

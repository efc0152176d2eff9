"""The GatedDeltaNet recurrence of decode steps and verify windows on mtp-serve's native
CPU kernel (mtp_serve/native/gated_delta.cpp): the bits of mlx-lm's own step
op, for one token and for every position of a window, so plain decoding keeps mlx-lm's
numbers and a verify window's positions are the bits of plain steps."""

import mtp_serve  # noqa: F401  (preloads OpenBLAS before mlx.core)

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

from mtp_serve import quantized_matmul as qmm_ext
from mtp_serve.models import gdn
from mtp_serve.models.gdn import gated_delta_steps
from support.native import needs_native

pytestmark = needs_native(gdn.native_recurrence() is not None, qmm_ext.status())


def _inputs(B, T, Hk, Hv, Dk, Dv, seed):
    mx.random.seed(seed)
    q, k = normalize_qk(mx.random.normal((B, T, Hk, Dk)), mx.random.normal((B, T, Hk, Dk)),
                        inv_scale=Dk**-0.5, eps=1e-6)
    v = mx.random.normal((B, T, Hv, Dv))
    g = mx.exp(-2.0 * mx.random.uniform(shape=(B, T, Hv)))
    beta = mx.random.uniform(shape=(B, T, Hv))
    return q, k, v, g, beta, 0.5 * mx.random.normal((B, Hv, Dv, Dk))


def _same(a, b) -> bool:
    return np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("B,T,Hk,Hv,Dk,Dv", [(1, 1, 16, 16, 128, 128), (2, 4, 2, 4, 64, 32), (3, 5, 1, 3, 16, 24),
                                             (1, 8, 4, 8, 128, 128)])
@pytest.mark.parametrize("masked", [False, True])
def test_bits_of_mlx_lm_step_ops(B, T, Hk, Hv, Dk, Dv, masked):
    """Each position's output and state equal mlx-lm's step op run token by token, bit for bit
    (grouped heads, batches, masked positions that leave the state as it was)."""
    q, k, v, g, beta, s = _inputs(B, T, Hk, Hv, Dk, Dv, seed=T + 10 * B)
    mask = (mx.arange(B * T).reshape(B, T) % 3) != 1 if masked else None
    y_ref, states_ref = gated_delta_steps(q, k, v, g, beta, s, mask)  # mlx-lm's `_gated_delta_step_ops`
    ext = gdn.native_recurrence()
    y, *states = ext.gated_delta_steps(q, k, v, g, beta, s, mask, True)
    assert _same(y, y_ref)
    assert len(states) == T and all(_same(a, b) for a, b in zip(states, states_ref.arrays))
    y_last, state_last = ext.gated_delta_steps(q, k, v, g, beta, s, mask, False)
    assert _same(y_last, y_ref) and _same(state_last, states_ref.arrays[-1])


def test_window_positions_are_single_steps_bits():
    """A T-token window's position t is the bits of t one-token steps: what lets greedy MTP
    verify exactly as plain decoding steps, whatever the batch and threads."""
    ext = gdn.native_recurrence()
    q, k, v, g, beta, s = _inputs(4, 5, 16, 16, 128, 128, seed=3)
    y_win, *states = ext.gated_delta_steps(q, k, v, g, beta, s, None, True)
    state = s
    for t in range(5):
        y, state = ext.gated_delta_steps(*(a[:, t : t + 1] for a in (q, k, v, g, beta)), state, None, False)
        assert _same(y, y_win[:, t : t + 1]) and _same(state, states[t])
    y_row, state_row = ext.gated_delta_steps(*(a[2:3] for a in (q, k, v, g, beta, s)), None, False)
    assert _same(y_row, y_win[2:3]) and _same(state_row, states[-1][2:3])


def test_decode_update_matches_mlx_lm():
    """The decode path (`_native_steps`) equals mlx-lm's `gated_delta_update` from a and b, bf16 inputs too."""
    q, k, v, _, _, s = _inputs(2, 1, 2, 4, 64, 64, seed=7)
    a, b = mx.random.normal((2, 1, 4)), mx.random.normal((2, 1, 4))
    A_log, dt_bias = mx.random.normal((4,)), mx.random.normal((4,))
    for dtype in (mx.float32, mx.bfloat16):
        qd, kd, vd, ad, bd = (t.astype(dtype) for t in (q, k, v, a, b))
        y_ref, s_ref = gated_delta_update(qd, kd, vd, ad, bd, A_log, dt_bias, s)
        y, state = gdn._native_steps(gdn.native_recurrence(), qd, kd, vd, gdn.compute_g(A_log, ad, dt_bias),
                                     mx.sigmoid(bd), s, None, capture=False)
        assert y.dtype == dtype and _same(y.astype(mx.float32), y_ref.astype(mx.float32)) and _same(state, s_ref)


@pytest.mark.parametrize("masked", [False, True])
def test_replayed_states_are_the_windows_bits(masked):
    """A window keeps its last state and steps an earlier one again when a commit asks for it
    (`ReplayStates`): each accepted length, one for all rows or one per row, gives the bits of the
    window's own state at that position, and all T gives the window's last state itself."""
    B, T = 3, 4
    q, k, v, g, beta, s = _inputs(B, T, 2, 4, 64, 32, seed=11)
    mask = (mx.arange(B * T).reshape(B, T) % 5) != 3 if masked else None
    ext = gdn.native_recurrence()
    _, *states = ext.gated_delta_steps(q, k, v, g, beta, s, mask, True)
    y, window = gdn._native_steps(ext, q, k, v, g, beta, s, mask, True)
    assert isinstance(window, gdn.ReplayStates) and window.length == T
    for n in range(1, T + 1):
        assert _same(window.after(n), states[n - 1])
    assert window.after(T) is window.final
    for rows in ([2, 4, 1], mx.array([3, 1, 3]), [2, 2, 2]):
        expect = mx.concatenate([states[r - 1][i : i + 1] for i, r in enumerate(np.asarray(rows).tolist())])
        assert _same(window.after(rows), expect)
    rebuilt = gdn.ReplayStates.rebuild(s, window.arrays)
    assert _same(rebuilt.after(2), states[1])


def test_bad_inputs_are_refused():
    ext = gdn.native_recurrence()
    q, k, v, g, beta, s = _inputs(1, 2, 2, 2, 16, 16, seed=1)
    with pytest.raises(ValueError, match="float32"):
        ext.gated_delta_steps(q.astype(mx.float16), k, v, g, beta, s)
    with pytest.raises(ValueError, match="state"):
        ext.gated_delta_steps(q, k, v, g, beta, s[:, :1])
    with pytest.raises(ValueError, match="head"):
        ext.gated_delta_steps(q[..., :12], k[..., :12], v, g, beta, s[..., :12])


def test_off_without_the_extension(monkeypatch):
    """MTP_SERVE_NO_QMM (or no build) leaves the recurrence to mlx-lm's ops."""
    monkeypatch.setattr(qmm_ext, "load", lambda: None)
    assert gdn.native_recurrence() is None
    monkeypatch.setattr(gdn, "NATIVE", False)
    assert gdn.native_recurrence() is None


def test_decode_steps_and_verify_windows_run_on_it(checkpoint_dir, monkeypatch):
    """A greedy MTP decode on a synthetic Qwen3.5 checkpoint: plain steps (one token) and verify
    windows (their record kept to roll back) both take the native recurrence, and the output is
    plain decoding's. (Compiled steps call the forward when they trace it: `seen` holds traces.)"""
    from mtp_serve.engine.generator import generate
    from mtp_serve.engine.sampling import SamplingParams
    from mtp_serve.models.loader import load_model

    seen = []
    real = gdn._native_steps

    def counting(ext, q, *args):
        seen.append((q.shape[1], args[-1]))
        return real(ext, q, *args)

    monkeypatch.setattr(gdn, "_native_steps", counting)
    lm = load_model(str(checkpoint_dir("qwen3_5", agreeable=True)))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    runs = {depth: [t for c in generate(lm.model, lm.tokenizer, [5, 17, 99, 3], params, depth=depth) for t in c.token_ids]
            for depth in (0, 2)}
    assert runs[2] == runs[0]
    assert (1, False) in seen and (3, True) in seen, seen

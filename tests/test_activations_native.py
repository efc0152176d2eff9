"""Sigmoid, SiLU and SwiGLU on mtp-serve's native CPU kernel (mtp_serve/native/activations.cpp):
MLX's bits for every float32, so decode steps keep mlx-lm's numbers while the
activations cost a fraction of MLX's one-element-at-a-time exp."""

import mtp_serve  # noqa: F401  (preloads OpenBLAS before mlx.core)

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.activations import precise_swiglu, swiglu
from mlx_lm.models.gated_delta import normalize_qk as mlx_lm_normalize_qk

from mtp_serve import quantized_matmul as qmm_ext
from mtp_serve.models import activations
from support.native import needs_native

ext = activations._native(mx.zeros(1))
pytestmark = needs_native(ext is not None, qmm_ext.status())


def _values() -> mx.array:
    rng = np.random.default_rng(0)
    scaled = [rng.standard_normal(50_000) * s for s in (0.01, 1, 8, 40, 100)]
    special = [0.0, -0.0, 88.0, -88.0, 88.00001, -88.00001, 87.99999, 1e-40, -1e-40, np.inf, -np.inf, np.nan,
               0.49999997, -0.49999997, 3.4028235e38, -3.4028235e38]
    any_bits = rng.integers(0, 2**32, 100_003, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return mx.array(np.concatenate([*scaled, special, any_bits]).astype(np.float32))


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_bits_of_mlx_over_every_kind_of_float():
    """Normal ranges, the +-88 saturation edges, denormals, infinities, NaN, random bit patterns
    (odd length: the tail path too); compiled and uncompiled MLX agree with it."""
    x = _values()
    y = mx.random.normal(x.shape)
    assert x.size % 8
    assert _same(ext.sigmoid(x), mx.sigmoid(x)) and _same(ext.sigmoid(x), mx.compile(mx.sigmoid)(x))
    assert _same(ext.silu(x), nn.silu(x)) and _same(ext.silu(x), x * mx.sigmoid(x))
    assert _same(ext.swiglu(x, y), swiglu(x, y))


def test_strided_inputs():
    """Transposed and sliced inputs (taken without a contiguous copy in the graph) give MLX's bits."""
    x, y = mx.random.normal((64, 40)), mx.random.normal((40, 64))
    for a, b in [(x.T, y), (x[::3], y.T[::3]), (x.T[:, 5:], y[:, 5:])]:
        assert _same(ext.sigmoid(a), mx.sigmoid(a)) and _same(ext.silu(a), nn.silu(a))
        assert _same(ext.swiglu(a, b), swiglu(a, b))


def test_layer_swaps_keep_mlx_lm_outputs():
    """The swapped MLP and gated norm compute what mlx-lm's classes do, bit for bit."""
    from mlx_lm.models.qwen3_next import Qwen3NextMLP, Qwen3NextRMSNormGated

    mx.random.seed(0)
    mlp, norm = Qwen3NextMLP(64, 96), Qwen3NextRMSNormGated(32)
    norm.weight = mx.random.normal((32,))
    x, h, gate = mx.random.normal((2, 3, 64)), mx.random.normal((2, 3, 4, 32)), mx.random.normal((2, 3, 4, 32))
    ref_mlp, ref_norm = mlp(x), norm(h, gate)
    assert activations.install_native_activations(mlp, norm) == 2
    assert type(mlp) is activations.NativeMLP and type(norm) is activations.NativeRMSNormGated
    assert _same(mlp(x), ref_mlp) and _same(norm(h, gate), ref_norm)
    assert _same(norm(h, gate), precise_swiglu(h, gate, mx.fast.rms_norm(h, norm.weight, norm.eps)))


@pytest.mark.parametrize("n", [7, 128, 1024, 2560])
def test_rms_norm_bits_of_mx_fast(n):
    """One node with mx.fast.rms_norm's bits (its CPU fallback's three), compiled or not, with and
    without a weight, at widths whose 1/N is inexact, tiny and large magnitudes, zero rows;
    mlx-lm's normalize_qk rebuilt on it gives its bits too."""
    mx.random.seed(n)
    w = 1 + 0.1 * mx.random.normal((n,))
    for x in (mx.random.normal((3, 5, n)), 1e-4 * mx.random.normal((4, n)), 40 * mx.random.normal((1, n)).T.T,
              mx.zeros((2, n)), mx.random.normal((n, 6)).T):
        for weight, eps in ((w, 1e-6), (None, 1e-6 / 128)):
            ref = mx.fast.rms_norm(x, weight, eps)
            assert _same(ext.rms_norm(x, weight, eps), ref)
            assert _same(mx.compile(lambda a: ext.rms_norm(a, weight, eps))(x), mx.compile(lambda a: mx.fast.rms_norm(a, weight, eps))(x))
    q, k = mx.random.normal((1, 4, 2, 128)), mx.random.normal((1, 4, 2, 128))
    for ours, theirs in zip(activations.normalize_qk(q, k, inv_scale=128**-0.5, eps=1e-6),
                            mlx_lm_normalize_qk(q, k, inv_scale=128**-0.5, eps=1e-6)):
        assert _same(ours, theirs)
    norm = nn.RMSNorm(n)
    norm.weight = w
    x = mx.random.normal((2, n))
    ref = norm(x)
    assert activations.install_native_activations(norm) == 1 and type(norm) is activations.NativeRMSNorm
    assert _same(norm(x), ref)
    with pytest.raises(ValueError, match="float32"):
        ext.rms_norm(x, mx.ones(n + 1), 1e-6)


@pytest.mark.parametrize("B,L,C,K", [(1, 4, 6144, 4), (2, 11, 40, 4), (3, 5, 13, 2)])
def test_conv_silu_bits_of_the_decode_conv(B, L, C, K):
    """The GatedDeltaNet decode conv + SiLU in one node: the bits of the shifted multiply-adds and
    MLX's SiLU it replaces, channel tails and strided inputs included."""
    mx.random.seed(C)
    x, w = mx.random.normal((B, L, C)), 0.5 * mx.random.normal((C, K, 1))
    ref = nn.silu(activations.depthwise_conv(x, w))
    assert _same(ext.conv_silu(x, w), ref) and _same(activations.depthwise_conv_silu(x, w), ref)
    assert _same(ext.conv_silu(x[:, ::-1], w), nn.silu(activations.depthwise_conv(x[:, ::-1], w)))
    with pytest.raises(ValueError, match="conv silu"):
        ext.conv_silu(x[:, : K - 1], w)


@pytest.mark.parametrize("B,H,T,D,dims,base", [(1, 8, 1, 256, 64, 1e7), (1, 2, 4, 256, 64, 1e7), (2, 4, 3, 128, 128, 1e4),
                                              (3, 2, 5, 64, 32, 1e6)])
def test_rope_bits_of_mx_fast(B, H, T, D, dims, base):
    """nn.RoPE in one node: mx.fast.rope's bits (its CPU fallback: MLX's exp, sin and cos), compiled
    or not, scalar and per-row offsets, positions past 2^23 (libm's sin/cos there), partial rotary;
    the swapped nn.RoPE too, and a traditional one stays on MLX."""
    mx.random.seed(T + D)
    x = mx.random.normal((B, H, T, D))
    for off in (0, 7, 4097, 123457, 10_000_000):
        for offset in (mx.array(off, dtype=mx.int32), mx.array([off + 3 * b for b in range(B)], dtype=mx.int32)):
            ref = mx.fast.rope(x, dims, traditional=False, base=base, scale=1.0, offset=offset)
            assert _same(ext.rope(x, dims, base, 1.0, offset), ref)
            compiled = mx.compile(lambda a, o: mx.fast.rope(a, dims, traditional=False, base=base, scale=1.0, offset=o))
            assert _same(mx.compile(lambda a, o: ext.rope(a, dims, base, 1.0, o))(x, offset), compiled(x, offset))
    rope, traditional = nn.RoPE(dims, base=base), nn.RoPE(dims, traditional=True, base=base)
    ref, ref_t = rope(x, offset=5), traditional(x, offset=5)
    assert activations.install_native_activations(rope, traditional) == 2
    assert _same(rope(x, offset=5), ref) and _same(rope(x.transpose(0, 2, 1, 3).transpose(0, 2, 1, 3), offset=mx.array(5)), ref)
    assert _same(traditional(x, offset=5), ref_t)
    with pytest.raises(ValueError, match="rope"):
        ext.rope(x, dims + 1, base, 1.0, mx.array(0, dtype=mx.int32))


def test_gradients_are_mlx_ones():
    """Training through the native nodes (the tests' scripted checkpoints train a model that runs
    them) gives the gradients of MLX's own operations."""
    mx.random.seed(3)
    x, y, w = mx.random.normal((2, 3, 64)), mx.random.normal((2, 3, 64)), mx.random.normal((64,))
    conv_x, conv_w = mx.random.normal((1, 6, 16)), mx.random.normal((16, 4, 1))
    offset = mx.array(5, dtype=mx.int32)
    pairs = [
        (lambda a, b: ext.sigmoid(a) * b, lambda a, b: mx.sigmoid(a) * b),
        (lambda a, b: ext.silu(a) * b, lambda a, b: nn.silu(a) * b),
        (lambda a, b: ext.swiglu(a, b), lambda a, b: swiglu(a, b)),
        (lambda a, b: ext.rms_norm(a, b[0, 0], 1e-6, 0.5), lambda a, b: 0.5 * mx.fast.rms_norm(a, b[0, 0], 1e-6)),
        (lambda a, b: ext.rope(a[None], 32, 1e4, 1.0, offset) * b[None],
         lambda a, b: mx.fast.rope(a[None], 32, traditional=False, base=1e4, scale=1.0, offset=offset) * b[None]),
    ]
    for ours, theirs in pairs:
        g = mx.grad(lambda a, b: ours(a, b).sum(), argnums=(0, 1))(x, y)
        r = mx.grad(lambda a, b: theirs(a, b).sum(), argnums=(0, 1))(x, y)
        assert all(mx.allclose(u, v, atol=1e-5).item() for u, v in zip(g, r))
    g = mx.grad(lambda a, b: (ext.conv_silu(a, b) ** 2).sum(), argnums=(0, 1))(conv_x, conv_w)
    r = mx.grad(lambda a, b: (nn.silu(activations.depthwise_conv(a, b)) ** 2).sum(), argnums=(0, 1))(conv_x, conv_w)
    assert all(mx.allclose(u, v, atol=1e-5).item() for u, v in zip(g, r))


def test_mlx_computes_what_the_kernel_does_not_take(monkeypatch):
    """bfloat16 inputs, or the kernel off, go to MLX's own ops."""
    x = mx.random.normal((5, 7)).astype(mx.bfloat16)
    assert activations._native(x) is None and activations.silu(x).dtype == mx.bfloat16
    monkeypatch.setattr(activations, "NATIVE", False)
    assert activations._native(mx.zeros(3)) is None
    assert _same(activations.sigmoid(mx.arange(-4, 4, dtype=mx.float32)), mx.sigmoid(mx.arange(-4, 4, dtype=mx.float32)))
    with pytest.raises(ValueError, match="float32"):
        ext.swiglu(mx.zeros(4), mx.zeros(5))

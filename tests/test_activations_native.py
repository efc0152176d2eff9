"""Sigmoid, SiLU and SwiGLU on mtp-serve's native CPU kernel (mtp_serve/native/activations.cpp,
issue 23): MLX's bits for every float32, so decode steps keep mlx-lm's numbers while the
activations cost a fraction of MLX's one-element-at-a-time exp."""

import mtp_serve  # noqa: F401  (preloads OpenBLAS before mlx.core)

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.activations import precise_swiglu, swiglu

from mtp_serve.models import activations

ext = activations._native(mx.zeros(1))
pytestmark = pytest.mark.skipif(ext is None, reason="native kernel not built on this machine")


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


def test_mlx_computes_what_the_kernel_does_not_take(monkeypatch):
    """bfloat16 inputs, or the kernel off, go to MLX's own ops."""
    x = mx.random.normal((5, 7)).astype(mx.bfloat16)
    assert activations._native(x) is None and activations.silu(x).dtype == mx.bfloat16
    monkeypatch.setattr(activations, "NATIVE", False)
    assert activations._native(mx.zeros(3)) is None
    assert _same(activations.sigmoid(mx.arange(-4, 4, dtype=mx.float32)), mx.sigmoid(mx.arange(-4, 4, dtype=mx.float32)))
    with pytest.raises(ValueError, match="float32"):
        ext.swiglu(mx.zeros(4), mx.zeros(5))

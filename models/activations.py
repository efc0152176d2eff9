"""Sigmoid, SiLU, SwiGLU, RMS norm, RoPE and the GatedDeltaNet conv on mtp-serve's native
CPU kernel, with MLX's bits.

MLX's CPU sigmoid runs its exp one element at a time on x86 (13-19 ns an element, about
3.5 ms of activations a token at Qwen3.5-0.8B's shapes, a sixth of a 4-token verify
window); `mtp_serve/native/activations.cpp` computes the same operations eight lanes at
a time and gives the same bits (tests/test_activations_native.py). Where the kernel is
not built, not on the CPU, or for dtypes other than float32, MLX's own ops compute.

`mx.fast.rms_norm` and `mx.fast.rope` on CPU are their fallback graphs, three nodes a
call (~115 calls a decode step) and ~12 (12 calls); the kernel's are one node each with
the same operations in the same order.
Fewer nodes matter here: MLX spends ~5 us of the main thread on each node of a step's
graph, on a 2-core machine whose cores the quantized products keep busy.

`install_native_activations` swaps mlx-lm's MLP, RMS norm, RoPE and gated RMS norm classes
(by instance, as the GatedDeltaNet swap) and the MoE experts' SwiGLU to subclasses that call
these; their weights and names stay mlx-lm's.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from mtp_serve import quantized_matmul as qmm_ext

from .mlx_lm_compat import Qwen3NextMLP, Qwen3NextRMSNormGated, SwiGLU, precise_swiglu, swiglu as mlx_swiglu
from .quantized_layers import project

# False: MLX's ops (benchmarks compare).
NATIVE = True


def _native(*arrays: mx.array) -> Optional[Any]:
    if not NATIVE or mx.default_device() != mx.cpu or any(a.dtype != mx.float32 for a in arrays):
        return None
    ext = qmm_ext.load()
    return ext if ext is not None and hasattr(ext, "conv_silu") else None


def sigmoid(x: mx.array) -> mx.array:
    """`mx.sigmoid(x)`."""
    ext = _native(x)
    return ext.sigmoid(x) if ext is not None else mx.sigmoid(x)


def silu(x: mx.array) -> mx.array:
    """`nn.silu(x)`."""
    ext = _native(x)
    return ext.silu(x) if ext is not None else nn.silu(x)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's `swiglu(gate, x)`: silu(gate) * x."""
    ext = _native(gate, x) if gate.shape == x.shape else None
    return ext.swiglu(gate, x) if ext is not None else mlx_swiglu(gate, x)


def rms_norm(x: mx.array, weight: Optional[mx.array], eps: float, scale: float = 1.0) -> mx.array:
    """`mx.fast.rms_norm(x, weight, eps)`, times `scale` where it is not 1."""
    ext = _native(x) if weight is None else _native(x, weight)
    if ext is not None:
        return ext.rms_norm(x, weight, eps, scale)
    y = mx.fast.rms_norm(x, weight, eps)
    return y if scale == 1.0 else scale * y


def normalize_qk(q: mx.array, k: mx.array, *, inv_scale: float, eps: float) -> Tuple[mx.array, mx.array]:
    """mlx-lm's `normalize_qk` (gated_delta.py), its operations in its order, on `rms_norm`."""
    rms_eps = eps * inv_scale**2
    return rms_norm(q, None, rms_eps, inv_scale**2), rms_norm(k, None, rms_eps, inv_scale)


@partial(mx.compile, shapeless=True)
def _weighted_sum(*xw: mx.array) -> mx.array:
    """x0 * w0 + x1 * w1 + ... for arguments (x0, w0, x1, w1, ...), in one fused loop."""
    out = xw[0] * xw[1]
    for i in range(2, len(xw), 2):
        out = out + xw[i] * xw[i + 1]
    return out


def depthwise_conv(x: mx.array, weight: mx.array) -> mx.array:
    """mlx-lm's depthwise `conv1d` (no padding, weight [C, K, 1]) as K shifted
    multiply-adds: 1.6 ns an output here, MLX's CPU conv kernel 25 ns (measured)."""
    K, S = weight.shape[1], x.shape[1] - weight.shape[1] + 1
    return _weighted_sum(*(t for j in range(K) for t in (x[:, j : j + S], weight[:, j, 0])))


def depthwise_conv_silu(x: mx.array, weight: mx.array) -> mx.array:
    """`silu(depthwise_conv(x, weight))`: one node on the kernel (the taps' slices, the sum and
    the SiLU are 14 nodes a GatedDeltaNet layer otherwise)."""
    ext = _native(x, weight) if x.ndim == 3 and weight.shape[1] <= 16 else None
    return ext.conv_silu(x, weight) if ext is not None else silu(depthwise_conv(x, weight))


class NativeRMSNorm(nn.RMSNorm):
    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self["weight"], self.eps)


class NativeRoPE(nn.RoPE):
    """`nn.RoPE` (non-traditional, its default frequencies) as one node: `mx.fast.rope` on CPU is
    its fallback graph, ~12 nodes a call."""

    def __call__(self, x: mx.array, offset: Union[int, mx.array] = 0) -> mx.array:
        off = offset if isinstance(offset, mx.array) else mx.array(offset, dtype=mx.int32)
        ext = _native(x) if x.ndim == 4 and not self.traditional and off.dtype == mx.int32 and off.ndim <= 1 else None
        if ext is None:
            return super().__call__(x, offset)
        return ext.rope(x, self.dims, self.base, self.scale, off)


class NativeMLP(Qwen3NextMLP):
    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(*project(x, [self.gate_proj, self.up_proj])))


class NativeRMSNormGated(Qwen3NextRMSNormGated):
    def __call__(self, hidden_states: mx.array, gate: Optional[mx.array] = None) -> mx.array:
        x = rms_norm(hidden_states, self.weight, self.eps)
        if gate is None:
            return x.astype(hidden_states.dtype)
        if _native(hidden_states, gate, x) is None:  # mlx-lm's precise_swiglu upcasts; float32 needs none
            return precise_swiglu(hidden_states, gate, x)
        return swiglu(gate, x)


class NativeSwiGLU(SwiGLU):
    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        return swiglu(gate, x)


_REPLACEMENTS = {Qwen3NextMLP: NativeMLP, Qwen3NextRMSNormGated: NativeRMSNormGated, SwiGLU: NativeSwiGLU,
                 nn.RMSNorm: NativeRMSNorm, nn.RoPE: NativeRoPE}


def install_native_activations(*modules: Optional[nn.Module]) -> int:
    """Swap every mlx-lm MLP, RMS norm, RoPE, gated RMS norm and expert SwiGLU inside `modules`; returns the count."""
    n = 0
    for module in modules:
        if module is None:
            continue
        for _, child in module.named_modules():
            if type(child) in _REPLACEMENTS:
                child.__class__ = _REPLACEMENTS[type(child)]
                n += 1
    return n

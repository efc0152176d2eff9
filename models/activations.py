"""Sigmoid, SiLU and SwiGLU on mtp-serve's native CPU kernel, with MLX's bits.

MLX's CPU sigmoid runs its exp one element at a time on x86 (13-19 ns an element, about
3.5 ms of activations a token at Qwen3.5-0.8B's shapes, a sixth of a 4-token verify
window); `mtp_serve/native/activations.cpp` computes the same operations eight lanes at
a time and gives the same bits (tests/test_activations_native.py). Where the kernel is
not built, not on the CPU, or for dtypes other than float32, MLX's own ops compute.

`install_native_activations` swaps mlx-lm's MLP and gated RMS norm classes (by instance,
as the GatedDeltaNet swap) and the MoE experts' SwiGLU to subclasses that call these;
their weights and names stay mlx-lm's. Issue 23.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from mtp_serve import quantized_matmul as qmm_ext

from .mlx_lm_compat import Qwen3NextMLP, Qwen3NextRMSNormGated, SwiGLU, precise_swiglu, swiglu as mlx_swiglu

# False: MLX's ops (benchmarks compare).
NATIVE = True


def _native(*arrays: mx.array) -> Optional[Any]:
    if not NATIVE or mx.default_device() != mx.cpu or any(a.dtype != mx.float32 for a in arrays):
        return None
    ext = qmm_ext.load()
    return ext if ext is not None and hasattr(ext, "swiglu") else None


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


class NativeMLP(Qwen3NextMLP):
    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class NativeRMSNormGated(Qwen3NextRMSNormGated):
    def __call__(self, hidden_states: mx.array, gate: Optional[mx.array] = None) -> mx.array:
        x = mx.fast.rms_norm(hidden_states, self.weight, self.eps)
        if gate is None:
            return x.astype(hidden_states.dtype)
        if _native(hidden_states, gate, x) is None:  # mlx-lm's precise_swiglu upcasts; float32 needs none
            return precise_swiglu(hidden_states, gate, x)
        return swiglu(gate, x)


class NativeSwiGLU(SwiGLU):
    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        return swiglu(gate, x)


_REPLACEMENTS = {Qwen3NextMLP: NativeMLP, Qwen3NextRMSNormGated: NativeRMSNormGated, SwiGLU: NativeSwiGLU}


def install_native_activations(*modules: Optional[nn.Module]) -> int:
    """Swap every mlx-lm MLP, gated RMS norm and expert SwiGLU inside `modules`; returns the count."""
    n = 0
    for module in modules:
        if module is None:
            continue
        for _, child in module.named_modules():
            if type(child) in _REPLACEMENTS:
                child.__class__ = _REPLACEMENTS[type(child)]
                n += 1
    return n

"""`mx.compile`d decoder layers for the short inputs of decoding.

A decode step (T=1) or a verify window (T=K+1) of a small model costs far more
in per-operation dispatch than in arithmetic: a GatedDeltaNet layer is ~40
small operations. Compiling each layer's whole step (input norm, mixer,
residual, MLP) fuses its elementwise chains and drops the Python graph
building, which measured ~30% off a demo-model decode step on this CPU.

What is compiled is a pure function of arrays (the layer's weights are
captured as constants, so the model's weights must not change after the
first call). GatedDeltaNet layers are compiled whole: cache in, cache out.
Attention layers are compiled in two parts around mlx-lm's own cache update
and attention (whose key length grows every step; over a quantized cache the
attention is `quantized_attention.py`'s): projections, norms and
RoPE (the offset passed as an array, so one trace serves every position);
then gate, output projection, residual and MLP. Everything else (prefill, masked batches, long
inputs) goes through the layers as mlx-lm defines them. Without a C++
compiler MLX runs compiled functions unfused, with the same results.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from .activations import sigmoid
from .caches import SpeculativeGDNCache
from .gdn import store_step
from .mlx_lm_compat import Qwen3NextAttention, scaled_dot_product_attention
from .quantized_attention import attention
from .rope_positions import RopePositions, attention_projections, qkv_at

# Longest input the compiled paths take: verify windows are K+1 <= 8 tokens.
MAX_COMPILED_TOKENS = 8


class CompiledLayers:
    def __init__(self) -> None:
        self._fns: Dict[Tuple[int, str], Callable] = {}
        self._traced: Dict[Tuple[int, str], Callable] = {}  # the uncompiled functions, for what their traces noted

    def _get(self, layer: nn.Module, kind: str) -> Callable:
        key = (id(layer), kind)
        fn = self._fns.get(key)
        if fn is None:
            self._traced[key] = _BUILDERS[kind](layer)
            fn = self._fns[key] = mx.compile(self._traced[key])
        return fn

    def __call__(self, layer: nn.Module, h: mx.array, mask: Optional[mx.array], cache: Any,
                 rope: Optional[RopePositions] = None) -> mx.array:
        """`layer(h, mask, cache)`, compiled where the input is a short decode input;
        `rope`: positions other than the cache offset (a prompt with images)."""
        T = h.shape[1]
        if not layer.is_linear and rope is not None and (rope.grid is not None or T > MAX_COMPILED_TOKENS
                                                         or cache is None or type(layer.self_attn) is not Qwen3NextAttention):
            return attention_layer_at(layer, h, mask, cache, rope)
        if T > MAX_COMPILED_TOKENS:
            return layer(h, mask=mask, cache=cache)
        if not layer.is_linear:
            if cache is None or type(layer.self_attn) is not Qwen3NextAttention:
                r = layer.self_attn(layer.input_layernorm(h), mask, cache)
                return self._get(layer, "mlp")(h + r)
            # Projections, norms and RoPE compiled; the cache update and attention over
            # the (growing) cache as mlx-lm does them; output, residual and MLP compiled.
            offset = cache.offset if rope is None else rope.shifted(cache.offset)
            offset = offset if isinstance(offset, mx.array) else mx.array(offset)
            q, k, v, gate = self._get(layer, "attn_in")(h, offset)
            k, v = cache.update_and_fetch(k, v)
            out = attention(q, k, v, cache, layer.self_attn.scale, mask)
            return self._get(layer, "attn_out")(h, out, gate)
        capture = isinstance(cache, SpeculativeGDNCache) and cache.capturing
        if (
            mask is not None
            or not isinstance(cache, SpeculativeGDNCache)
            or cache[0] is None
            or cache[1] is None
            or cache.lengths is not None
            or (T > 1 and not capture)
        ):
            return layer(h, mask=mask, cache=cache)
        state = cache[1]
        if capture:
            h, conv_input, *window = self._get(layer, "gdn_window")(h, cache[0], state)
            window = self._traced[(id(layer), "gdn_window")].window_type.rebuild(state, window)
            store_step(cache, conv_input, window, T, True)
        else:
            h, conv_input, state = self._get(layer, "gdn_step")(h, cache[0], state)
            store_step(cache, conv_input, state, T, False)
        return h


def _residual_mlp(layer: nn.Module, h: mx.array) -> mx.array:
    """A decoder layer's second half, as mlx-lm's DecoderLayer computes it."""
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _mlp_half(layer: nn.Module) -> Callable:
    return lambda h: _residual_mlp(layer, h)


def _attention_in(layer: nn.Module) -> Callable:
    """Qwen3NextAttention up to the cache update (mlx-lm's operations, same order)."""
    rope = layer.self_attn.rope

    def step(x: mx.array, offset: mx.array):
        queries, keys, values, gate = attention_projections(layer, x)
        return rope(queries, offset=offset), rope(keys, offset=offset), values, gate

    return step


def _attention_out(layer: nn.Module) -> Callable:
    """Qwen3NextAttention after the attention, then the residual and the MLP half."""
    attn = layer.self_attn

    def step(x: mx.array, out: mx.array, gate: mx.array) -> mx.array:
        B, L, _ = x.shape
        return _residual_mlp(layer, x + attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1) * sigmoid(gate)))

    return step


def attention_layer_at(layer: nn.Module, h: mx.array, mask: Any, cache: Any, rope: RopePositions) -> mx.array:
    """A whole attention decoder layer as mlx-lm computes it, at the positions `rope` gives
    (uncompiled: prefill chunks of prompts with images, and the paths compiling skips)."""
    q, k, v, gate = qkv_at(layer, h, cache, rope)
    k, v = cache.update_and_fetch(k, v)
    out = scaled_dot_product_attention(q, k, v, cache=cache, scale=layer.self_attn.scale, mask=mask)
    return _attention_out(layer)(h, out, gate)


def _gdn_layer(layer: nn.Module, capture: bool) -> Callable:
    def step(x: mx.array, conv_state: mx.array, state: mx.array):
        r, conv_input, st = layer.linear_attn.mix(layer.input_layernorm(x), conv_state, state, capture=capture)
        h = _residual_mlp(layer, x + r)
        if capture:  # the window's record as arrays; the trace notes its class, to rebuild it from them
            step.window_type = type(st)
            return (h, conv_input, *st.arrays)
        return h, conv_input, st

    return step


_BUILDERS = {
    "mlp": _mlp_half,
    "attn_in": _attention_in,
    "attn_out": _attention_out,
    "gdn_step": lambda layer: _gdn_layer(layer, capture=False),
    "gdn_window": lambda layer: _gdn_layer(layer, capture=True),
}

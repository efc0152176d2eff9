"""Decoder layers over long inputs (prefill chunks) on MLX's CPU backend.

The same computation as mlx-lm's decoder layers, with the parts that dominate
a long CPU prefill replaced (measured on the demo model, 8,192 tokens: the
attention layers' softmax over materialised score matrices, then SiLU and
sigmoid, whose `exp` runs element by element through library calls here):

* full attention: `prefill_attention.causal_attention` (query blocks, no
  score above the diagonal outside one small tile, fast exp), and the output
  gate's sigmoid from `fast_math`;
* GatedDeltaNet: the chunked gated delta rule as before, with its conv and
  gated-norm activations from `fast_math` (`gdn.py`, `cpu_prefill=True`);
* dense MLP: SwiGLU from `fast_math`.

A quantized KV cache (`--kv-bits`) takes the same blockwise path: the
chunk's keys and values are quantized into the cache first, then the cache is
dequantized (an O(keys) pass per chunk) and the queries attend over those
values, exactly what mlx-lm's quantized attention computes (its products
dequantize the same groups), without its [heads, L, S] score matrix through
CPU `quantized_matmul` (bench_kv_quant.py times both).

Anything else (array masks of batched caches, MoE blocks) runs mlx-lm's own
modules, and so does every layer when the compute dtype is not fp32. Outputs
match mlx-lm's to fp32 rounding; short decode inputs never come here
(`compiled_steps.py`).
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from . import fast_math
from .compiled_steps import _attention_in, attention_layer_at
from .caches import QuantizedKVCache
from .mlx_lm_compat import KVCache, Qwen3NextAttention, Qwen3NextMLP
from .prefill_attention import causal_attention
from .quantized_attention import attention_rows
from .rope_positions import RopePositions, qkv_at


# Inputs of up to this many tokens (verify windows of copied drafts) attend on the decode kernel
# (`quantized_attention.attention_rows`): K and V read once for all rows, each row with the bits of
# the single step at its position. The blockwise path cost a 9-token window at 22k keys of context
# ~9 plain steps on the demo model, the kernel ~1.5.
NATIVE_WINDOW = 64

# Quantized KV through the blockwise path (False: mlx-lm's quantized attention; benchmarks compare).
DEQUANTIZE_QUANTIZED_KV = True


def blockwise(layer: nn.Module, mask: Any, cache: Optional[Any]) -> bool:
    """Whether `attention` runs this attention layer blockwise (else mlx-lm's module does)."""
    return (
        type(layer.self_attn) is Qwen3NextAttention
        and (type(cache) is KVCache or (type(cache) is QuantizedKVCache and DEQUANTIZE_QUANTIZED_KV))
        and isinstance(mask, str) and mask == "causal"
    )


def attention(layer: nn.Module, x: mx.array, mask: Any, cache: Optional[Any], rope: Optional[RopePositions] = None) -> mx.array:
    """`layer.self_attn(layer.input_layernorm(x), mask, cache)`, blockwise where supported
    (`rope`: positions other than the cache offset, blockwise layers only)."""
    attn = layer.self_attn
    quantized = type(cache) is QuantizedKVCache
    if not blockwise(layer, mask, cache):
        return attn(layer.input_layernorm(x), mask, cache)
    B, L, _ = x.shape
    q, k, v, gate = _attention_in(layer)(x, cache.offset) if rope is None else qkv_at(layer, x, cache, rope)
    k, v = cache.update_and_fetch(k, v)
    out = attention_rows(q, k, v, cache, attn.scale, mask) if L <= NATIVE_WINDOW else None
    if out is None:
        if quantized:
            k, v = (mx.dequantize(*p, group_size=cache.group_size, bits=cache.bits) for p in (k, v))
        out = causal_attention(q, k, v, attn.scale)
    out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
    return attn.o_proj(out * fast_math.sigmoid(gate))


def mlp(module: nn.Module, x: mx.array) -> mx.array:
    if type(module) is not Qwen3NextMLP:
        return module(x)
    return module.down_proj(fast_math.swiglu(module.gate_proj(x), module.up_proj(x)))


class PrefillLayers:
    """`run_layer(layer, h, mask, cache)` for inputs longer than a verify window."""

    def __call__(self, layer: nn.Module, h: mx.array, mask: Any, cache: Optional[Any],
                 rope: Optional[RopePositions] = None) -> mx.array:
        if rope is not None and not layer.is_linear and (h.dtype != mx.float32 or not blockwise(layer, mask, cache)):
            return attention_layer_at(layer, h, mask, cache, rope)
        if h.dtype != mx.float32:  # fast_math computes in fp32
            return layer(h, mask=mask, cache=cache)
        if layer.is_linear:
            r = layer.linear_attn(layer.input_layernorm(h), mask, cache, cpu_prefill=True)
        else:
            r = attention(layer, h, mask, cache, rope)
        h = h + r
        return h + mlp(layer.mlp, layer.post_attention_layernorm(h))

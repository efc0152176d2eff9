"""Where RoPE puts a forward's tokens when that is not simply the cache offset.

Text-only prompts never need this: a token's position is its index, which is the
attention cache's offset. A prompt with images (Qwen3.5 / Qwen3.6 vision-language
checkpoints) gives its image tokens three-axis positions (time, height, width:
multimodal RoPE), and every token after an image sits at its index plus a fixed
`delta` (an image of N tokens takes fewer than N positions). So:

* a prefill chunk of a prompt with images passes `grid`, its tokens' explicit
  positions [3, T] (one row: prefill is per sequence);
* every later forward of that row (decode steps, MTP drafts, verify windows)
  passes `delta`, added to the cache offset: an int for one row, an array [B]
  for a batch whose rows have different deltas.

Plain decoding, drafts and verify windows of a row all use the same `delta`, so
MTP keeps scoring each token exactly as plain decoding does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from .quantized_layers import project


@dataclass(frozen=True)
class RopePositions:
    delta: Union[int, mx.array] = 0  # added to each row's cache offset
    grid: Optional[mx.array] = None  # explicit multimodal positions [3, T] (a prefill chunk of one row)
    spec: Any = None  # the VisionSpec whose mrope sections apply `grid`

    def shifted(self, offset: Union[int, mx.array]) -> Union[int, mx.array]:
        """The RoPE offset of a forward whose cache holds `offset` tokens (no `grid`)."""
        return offset + self.delta


def attention_projections(layer: nn.Module, x: mx.array) -> Tuple[mx.array, mx.array, mx.array, mx.array]:
    """Qwen3NextAttention's projections and norms before RoPE (mlx-lm's operations, in its
    order): queries, keys, values [B, heads, T, D] and the output gate [B, T, H]."""
    attn = layer.self_attn
    B, L, _ = x.shape
    h = layer.input_layernorm(x)
    queries, keys, values = project(h, [attn.q_proj, attn.k_proj, attn.v_proj])
    queries, gate = mx.split(queries.reshape(B, L, attn.num_attention_heads, -1), 2, axis=-1)
    queries = attn.q_norm(queries).transpose(0, 2, 1, 3)
    keys = attn.k_norm(keys.reshape(B, L, attn.num_key_value_heads, -1)).transpose(0, 2, 1, 3)
    values = values.reshape(B, L, attn.num_key_value_heads, -1).transpose(0, 2, 1, 3)
    return queries, keys, values, gate.reshape(B, L, -1)


def qkv_at(layer: nn.Module, x: mx.array, cache: Any, rope: RopePositions) -> Tuple[mx.array, mx.array, mx.array, mx.array]:
    """`attention_projections` with RoPE at the positions `rope` gives."""
    from .vision import apply_mrope  # only prompts with images get here

    attn = layer.self_attn
    queries, keys, values, gate = attention_projections(layer, x)
    if rope.grid is not None:
        queries, keys = (apply_mrope(t, rope.grid, attn.rope, rope.spec) for t in (queries, keys))
    else:
        offset = rope.shifted(cache.offset)
        queries, keys = attn.rope(queries, offset=offset), attn.rope(keys, offset=offset)
    return queries, keys, values, gate

"""Decode- and verify-sized attention on CPU, over full-precision and quantized (`--kv-bits`) KV.

`attention` (what the compiled decode layers call) runs the whole attention of a decode step
or verify window on the native kernel's `attention_rows` (`native/quantized_attention.cpp`):
per (sequence, kv head), each tile of K and then of V is read (a quantized one unpacked) once
for all the head's query rows, with a row's bits those of the single step at its position and
of the row alone outside a batch. MLX's own CPU attention computed a window as separate
products whose p @ V went to OpenBLAS at long contexts (~9 ms a layer at 22k keys on the demo
model's shapes, against ~0.6 ms to stream V once). Other inputs (additive masks, other
dtypes, no kernel) take the paths below: mlx-lm's attention, or `quantized_attention`.

The older split path over a quantized cache, kept for those inputs:

mlx-lm's quantized attention computes the scores q @ K^T and the output p @ V with
`mx.quantized_matmul`, which on MLX 0.32's CPU backend dequantizes the cache for
every query row: at 8,192 keys (Qwen3.5-0.8B shapes, 8-bit) one query's scores
took 16-18 ms against 1.4 ms in fp32, and a 4-token verify window about 4x that,
so MTP's verify lost its advantage over plain steps. Here both products run on
mtp-serve's native kernel (`mtp_serve.quantized_matmul`), which unpacks each
quantized entry once for all the rows that read it:

* scores: K's groups lie along the head dimension, the reduced one, so q @ K^T is
  the kernel's gathered product with one "expert" per (sequence, kv head) and the
  head's query rows (its query heads times the window) routed to it;
* output: p @ V, V's groups along the output dimension (`quantized_values`).

The mask and the softmax are mlx-lm's, in the same order. Every row gets the same
bits whatever the rows beside it, so a T = K+1 verify window scores each query as
T plain steps would (greedy MTP = greedy plain within a KV setting), and the result
equals mlx-lm's quantized attention to fp32 rounding (tests/test_kv_quant.py).
Without the kernel (not CPU, no AVX2, MTP_SERVE_NO_QMM=1) or for shapes it does not
take, mlx-lm's own quantized attention computes, as before.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import mlx.core as mx

from mtp_serve import quantized_matmul as qmm_ext

from .fast_math import _exp_nonpositive
from .mlx_lm_compat import quantized_scaled_dot_product_attention, scaled_dot_product_attention

Quantized = Tuple[mx.array, mx.array, mx.array]  # packed, scales, biases

# Use the native path when available (False: mlx-lm's quantized attention; benchmarks compare).
NATIVE = True


def native_supported(head_dim: int, group_size: int, bits: int, scales_dtype: mx.Dtype) -> bool:
    """The kernel can compute this cache's attention (loading it at first use)."""
    return (NATIVE and qmm_ext.load() is not None and bits in (4, 8) and head_dim % 64 == 0
            and qmm_ext.supports(bits, group_size, "affine", head_dim, scales_dtype))


def quantized_attention(queries: mx.array, keys: Quantized, values: Quantized, scale: float, mask: Any,
                        group_size: int, bits: int, buffers: Optional[Quantized] = None) -> mx.array:
    """mlx-lm's `quantized_scaled_dot_product_attention(queries, keys, values, scale, mask, group_size, bits)`.

    queries [B, Hq, T, D]; keys and values (packed, scales, biases), each [B, Hkv, S, *];
    mask None, "causal", or an array broadcastable to [B, 1, T, S] (bool or additive); `buffers`:
    the cache's value buffers [B, Hkv, >= S, *] whose first S entries are `values`."""
    B, Hq, T, D = queries.shape
    Hkv, S = keys[0].shape[1], keys[0].shape[2]
    if not native_supported(D, group_size, bits, keys[1].dtype) or Hq % Hkv:
        return quantized_scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask,
                                                      group_size=group_size, bits=bits)
    rep, heads = Hq // Hkv, B * Hkv
    rows = rep * T  # query rows per kv head
    q = (queries * scale).astype(mx.float32).reshape(heads * rows, D)
    ext = qmm_ext.load()
    flat = lambda a: a.reshape(heads, S, a.shape[-1])  # noqa: E731
    scores = ext.gather_qmm_rows(q, *(flat(a) for a in keys), mx.arange(heads, dtype=mx.uint32), rows,
                                 group_size, bits, False)
    scores = scores.reshape(B, Hkv, rep, T, S)
    if mask is not None:  # as mlx-lm applies it
        if isinstance(mask, str):
            mask = mx.arange(S - T, S)[:, None] >= mx.arange(S)[None]
        if mask.ndim > 3:
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    p = softmax(scores, mask).reshape(heads * rows, S)
    # The values kernel reads the first S entries of each head: the cache's whole buffer
    # (`buffers`, when given) is passed as it is instead of a copy of the fetched slice.
    vals = buffers if buffers is not None else values
    out = ext.quantized_values(p, *(a.reshape(heads, a.shape[2], a.shape[-1]) for a in vals), rows, group_size, bits)
    return out.reshape(B, Hq, T, D).astype(queries.dtype)


def _exp_masked(x: mx.array, keep: mx.array) -> mx.array:
    return mx.where(keep, _exp_nonpositive(x), 0.0)


_exp_compiled = mx.compile(_exp_masked, shapeless=True)


def softmax(scores: mx.array, mask: Any) -> mx.array:
    """Softmax over the last axis, exp from `fast_math` (MLX's CPU exp costs ~13 ns an element:
    20 ms a layer for a 4-token window at 32k keys, Qwen3.5-0.8B shapes). Masked scores (at
    the float minimum) get exactly 0, as with mx.softmax. Row by row: the same bits for a row
    whatever the rows beside it."""
    if scores.dtype != mx.float32:
        return mx.softmax(scores, axis=-1, precise=True)
    m = mx.max(scores, axis=-1, keepdims=True)
    keep = scores > mx.finfo(mx.float32).min if mask is not None else mx.array(True)
    e = _exp_compiled(scores - m, keep)
    return e / mx.maximum(mx.sum(e, axis=-1, keepdims=True), 1e-30)  # a row all masked: zeros


def rows_kernel() -> Optional[Any]:
    """The native extension when it has the whole-attention kernel (`attention_rows`)."""
    ext = qmm_ext.load() if NATIVE else None
    return ext if ext is not None and hasattr(ext, "attention_rows") else None


def set_row_blocks(on: bool, wide: bool = True, tiles: bool = True) -> bool:
    """On (the default): `attention_rows` blocks the query rows that share a whole tile of keys,
    each K and V load serving up to four rows; wide: where the CPU has AVX-512, the blocks and
    the unpacking of quantized K/V tiles on 16-lane registers (else 8-lane ones); tiles (with
    wide): runs of 8 or 4 rows against 6 or 8 keys at a time for the scores and 6 rows x 64
    columns for the values, as a small GEMM (windows' many rows); off: each row alone. Every
    form gives the same bits (tests and benchmarks compare them). Returns whether the kernel
    is there to set."""
    ext = rows_kernel()
    if ext is None or not hasattr(ext, "set_row_blocks"):
        return False
    ext.set_row_blocks(on, wide, tiles)
    return True


def _rows_mask(mask: Any, B: int, T: int, S: int) -> Tuple[bool, Optional[mx.array]]:
    """(causal, bool mask [B, T, S] or None) for the kernel; None for masks it does not take."""
    if mask is None or (isinstance(mask, str) and mask == "causal"):
        return mask is not None and T > 1, None
    if isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.ndim == 4 and mask.shape[1] == 1:
        return False, mx.broadcast_to(mask, (mask.shape[0], 1, T, S)).reshape(mask.shape[0], T, S)
    return None  # additive masks and other layouts: mlx-lm's attention


def attention_rows(queries: mx.array, keys: Any, values: Any, cache: Any, scale: float, mask: Any) -> Optional[mx.array]:
    """The whole decode/verify attention on the native kernel (None where it does not apply):
    each (sequence, kv head) reads K and V once for all its query rows, each row with the
    bits of the single step at its position (`native/quantized_attention.cpp` says how).
    The cache's buffers are passed whole (their first S entries are the fetched keys)."""
    ext = rows_kernel()
    bits = getattr(cache, "bits", None)
    buf_k, buf_v = getattr(cache, "keys", None), getattr(cache, "values", None)
    B, Hq, T, D = queries.shape
    if ext is None or queries.dtype != mx.float32 or D % 8 or buf_k is None:
        return None
    if bits is None:
        if not (isinstance(buf_k, mx.array) and buf_k.ndim == 4 and buf_k.dtype == mx.float32):
            return None
        parts, S = [buf_k, buf_v], keys.shape[2]
    else:
        if bits not in (4, 8) or not native_supported(D, cache.group_size, bits, buf_k[1].dtype):
            return None
        parts, S = [*buf_k, *buf_v], keys[0].shape[2]
    Hkv, buf = parts[0].shape[1], parts[0].shape[2]
    how = _rows_mask(mask, B, T, S)
    if how is None or Hq % Hkv or parts[0].shape[0] != B:
        return None
    causal, rows_mask = how
    rows = (Hq // Hkv) * T
    q = (queries * scale).reshape(B * Hkv * rows, D)
    flat = [a.reshape(B * Hkv, buf, a.shape[-1]) for a in parts]
    out = ext.attention_rows(q, flat, rows_mask, rows, T, S, Hkv, causal, getattr(cache, "group_size", 0), bits or 0)
    return out.reshape(B, Hq, T, D)


def attention(queries: mx.array, keys: Any, values: Any, cache: Any, scale: float, mask: Optional[Any]) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention` for a decode step or verify window:
    the native kernel's `attention_rows` where it applies, else quantized caches (a `bits`
    attribute) through `quantized_attention` and full-precision ones through mlx-lm."""
    out = attention_rows(queries, keys, values, cache, scale, mask)
    if out is not None:
        return out
    if getattr(cache, "bits", None) is None:
        return scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale, mask=mask)
    return quantized_attention(queries, keys, values, scale, mask, cache.group_size, cache.bits, cache.values)

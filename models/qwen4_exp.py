"""Qwen3.8-Flash-Next (`qwen4_exp`): the backbone, written from the published architecture.

What it adds over Qwen3.5 MoE (transformers' `modeling_qwen4_exp.py` is the reference
for the math; the goldens in tests/data check this file against it):

* hyper-connections: the residual is `hc_count` streams of `hidden_size`; before attention
  and before the MLP a gated mixer (`GatedResidual`) folds them into one input, and the
  block's output is added back to every stream with its own weight; a final mixer gives
  the hidden the LM head reads (there is no final norm);
* no input / post-attention layernorms: each mixer's grouped RMSNorm is the pre-norm;
* PLE (per-layer embeddings) on the GatedDeltaNet layers in `ple_layer_ids`: hashed
  n-gram embeddings of the tokens (orders 2..`ngram_size`, `heads_per_ngram` heads each,
  prime-sized tables) gate a value into every stream, then a dilated depthwise conv adds
  local context. Each keeps two windows in its cache: the last `ngram_size - 1` tokens and
  the conv's last `(kernel - 1) * ngram_size` inputs;
* QSA on the attention layers: an indexer scores blocks of `indexer_compress_ratio` keys
  (their mean, normed and rotated at the block's first position) and each query attends
  to the best `indexer_budget / indexer_compress_ratio` complete blocks plus the tokens
  of its incomplete last block. Its raw keys live in the layer's KV cache
  (`IndexedKVCache`), so a trim rolls them back with the keys and values.

The GatedDeltaNet and the MoE block are mlx-lm's Qwen3.5 / Qwen3-Next ones (the same
math, and the GatedDeltaNet takes the project's capturing forward). Positions are Qwen3.5's
multimodal RoPE (interleaved sections): a forward takes explicit three-axis positions for a
prompt with images, in the attention and in the indexer (whose cache then keeps each token's
position, so a block rotates at its first token's); text-only forwards rotate at the cache
offset (M-RoPE with equal axes is plain RoPE).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn

from .caches import FULL_KV, KVSetting, QuantizedKVCache
from .mlx_lm_compat import KVCache, Qwen35GatedDeltaNetBase, Qwen3NextSparseMoeBlock
from .quantized_attention import attention as kv_attention

MODEL_TYPE = "qwen4_exp"


class Unsupported(ValueError):
    """A part of a qwen4_exp checkpoint this server cannot run yet (the message names it)."""


def unsupported(part: str) -> Unsupported:
    return Unsupported(f"{MODEL_TYPE}: {part} is not supported yet")


@dataclass
class Qwen4ExpArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    linear_num_value_heads: int
    linear_num_key_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    layer_types: List[str]
    eos_token_id: int
    hc_count: int = 4
    hc_lowrank: int = 320
    ple_layer_ids: List[int] = field(default_factory=list)
    ple_embed_dim: Optional[int] = None
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    split_ngram_parts: int = 512
    indexer_n_heads: Optional[int] = None
    indexer_kv_heads: Optional[int] = None
    indexer_head_dim: Optional[int] = None
    indexer_budget: Optional[int] = None
    indexer_compress_ratio: Optional[int] = None
    norm_topk_prob: bool = True
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    mrope_section: List[int] = field(default_factory=lambda: [11, 11, 10])
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    full_attention_interval: int = 4  # the MTP head's layer index (mlx-lm's Qwen3.5 layer)

    @property
    def qsa(self) -> bool:
        return self.indexer_n_heads is not None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def mrope_axes(self) -> List[int]:
        """Which position row (0 time, 1 height, 2 width) each rotary frequency reads: the
        sections interleaved (frequency j reads height when j % 3 == 1 and j < 3 * section[1],
        width when j % 3 == 2 and j < 3 * section[2], else time)."""
        sec = list(self.mrope_section) + [0] * (3 - len(self.mrope_section))
        return [1 if j % 3 == 1 and j < 3 * sec[1] else 2 if j % 3 == 2 and j < 3 * sec[2] else 0
                for j in range(self.rotary_dim // 2)]

    @classmethod
    def from_config(cls, config: dict) -> "Qwen4ExpArgs":
        text = dict(config.get("text_config", config))
        act = text.get("output_gate_type") or text.get("hidden_act", "silu")
        if act != "silu" or text.get("hidden_act", "silu") != "silu":
            raise unsupported(f"activation {act!r} (only silu)")
        rope = text.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise unsupported(f"rope_type {rope.get('rope_type')!r}")
        interval = text.get("full_attention_interval", 4)
        types = text.get("layer_types") or [
            "linear_attention" if (i + 1) % interval else "indexed_attention" for i in range(text["num_hidden_layers"])]
        types = ["indexed_attention" if t == "full_attention" else t for t in types]
        eos = text.get("eos_token_id", config.get("eos_token_id"))
        names = {f for f in cls.__dataclass_fields__}
        kw = {k: v for k, v in text.items() if k in names}
        kw.update(layer_types=types, eos_token_id=eos[0] if isinstance(eos, list) else eos,
                  rope_theta=rope.get("rope_theta", text.get("rope_theta", 10000.0)),
                  partial_rotary_factor=rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)),
                  mrope_section=list(rope.get("mrope_section") or [11, 11, 10]),
                  ple_layer_ids=sorted(set(text.get("ple_layer_ids") or [])),
                  full_attention_interval=next((i + 1 for i, t in enumerate(types) if t != "linear_attention"), interval))
        args = cls(**kw)
        if args.ple_embed_dim is None:
            args.ple_embed_dim = args.hidden_size
        if args.qsa and args.indexer_kv_heads != 1:
            raise unsupported(f"QSA with {args.indexer_kv_heads} indexer key heads (one is the published layout)")
        return args


# ---------------------------------------------------------------- norms and RoPE


def rms_norm(x: mx.array, weight: Optional[mx.array], eps: float, groups: int = 1) -> mx.array:
    """RMSNorm over `groups` equal slices of the last axis, each with its part of `weight`
    (already shifted: the checkpoint's zero-centred w becomes 1 + w at load)."""
    if groups == 1:
        return mx.fast.rms_norm(x, weight, eps)
    shape = x.shape
    y = mx.fast.rms_norm(x.reshape(*shape[:-1], groups, shape[-1] // groups), None, eps).reshape(shape)
    return y * weight if weight is not None else y


class GroupedRMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float, groups: int = 1):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps, self.groups = eps, groups

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self.weight, self.eps, self.groups)


def rope_at(x: mx.array, positions: mx.array, dims: int, base: float, axes: Optional[List[int]] = None) -> mx.array:
    """Rotate-half RoPE on the first `dims` features of x at `positions`: [T] for x [..., T, D]
    (any positions, not only a run from an offset: the indexer's blocks sit at their starts),
    or multimodal [B|1, 3, T] for x [B, heads, T, D] or [B, T, D], each frequency reading the
    row `axes` gives it (M-RoPE; three equal rows are plain RoPE)."""
    inv_freq = 1.0 / (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims))
    if positions.ndim == 1:
        freqs = positions.astype(mx.float32)[:, None] * inv_freq[None]
    else:
        rows = mx.take(positions.astype(mx.float32), mx.array(axes), axis=1)  # [B|1, dims/2, T]
        freqs = rows.swapaxes(1, 2) * inv_freq  # [B|1, T, dims/2]
        if x.ndim == 4:
            freqs = freqs[:, None]
    cos = mx.concatenate([mx.cos(freqs)] * 2, axis=-1).astype(x.dtype)
    sin = mx.concatenate([mx.sin(freqs)] * 2, axis=-1).astype(x.dtype)
    r, rest = x[..., :dims], x[..., dims:]
    half = dims // 2
    rotated = mx.concatenate([-r[..., half:], r[..., :half]], axis=-1)
    return mx.concatenate([r * cos + rotated * sin, rest], axis=-1)


def text_positions(start: int, T: int, delta: int = 0) -> mx.array:
    """Multimodal positions [1, 3, T] of text tokens start.. (index + delta on every axis)."""
    return mx.broadcast_to(mx.arange(start + delta, start + delta + T, dtype=mx.int32)[None, None], (1, 3, T))


# ---------------------------------------------------------------- hyper-connections


class GatedResidual(nn.Module):
    """Fold the `hc_count` streams into one block input (and, with `combine`, the weights
    that add the block's output back to each stream)."""

    def __init__(self, args: Qwen4ExpArgs, combine: bool = True):
        super().__init__()
        G, H = args.hc_count, args.hidden_size
        self.G, self.H = G, H
        self.hc_norm = GroupedRMSNorm(G * H, args.rms_norm_eps, groups=G)
        self.input_mix_weight_down = nn.Linear(G * H, args.hc_lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(args.hc_lowrank, G * H, bias=False)
        if combine:
            self.block_inject_weight = nn.Linear(G * H, G, bias=False)

    def __call__(self, streams: mx.array):
        xn = self.hc_norm(streams)
        w = nn.silu(self.input_mix_weight_down(xn) / self.G)
        w = mx.sigmoid(self.input_mix_weight_up(w))
        shape = (*streams.shape[:-1], self.G, self.H)
        mixed = (w.reshape(shape) * xn.reshape(shape)).mean(axis=-2)
        if "block_inject_weight" not in self:
            return mixed
        return mixed, 2 * mx.sigmoid(self.block_inject_weight(xn) / self.G)


def inject(streams: mx.array, out: mx.array, weights: mx.array) -> mx.array:
    """streams + each stream's weight times the block's output."""
    return streams + (out[..., None, :] * weights[..., None]).reshape(streams.shape)


# ---------------------------------------------------------------- PLE

_MASK64 = (1 << 64) - 1
_GAMMA, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_PRIME_1 = 10007


def _splitmix64(v: int) -> int:
    v = (v + _GAMMA) & _MASK64
    v = ((v ^ (v >> 30)) * _M1) & _MASK64
    v = ((v ^ (v >> 27)) * _M2) & _MASK64
    return (v ^ (v >> 31)) & _MASK64


def layer_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> List[int]:
    """Odd hash multipliers for token positions 0..ngram_size-1 of PLE layer `ple_index`,
    small enough that token * multiplier stays inside int64."""
    half = max(1, (((1 << 63) - 1) // max(vocab_size, 1)) // 2)
    base = seed + _PRIME_1 * ple_index
    return [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)]


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def head_vocab_sizes(base: int, first: int, count: int) -> List[int]:
    """The primes after base-1 numbered first+1 .. first+count (each n-gram head has its own)."""
    sizes, p, k = [], base - 1, 0
    while len(sizes) < count:
        p += 1
        while not _is_prime(p):
            p += 1
        k += 1
        if k > first:
            sizes.append(p)
    return sizes


def ngram_table_rows(args: Qwen4ExpArgs, ple_index: int) -> int:
    heads = (args.ngram_size - 1) * args.heads_per_ngram
    total = sum(head_vocab_sizes(args.ngram_vocab_size_base, ple_index * heads, heads))
    d = args.make_ngram_vocab_size_divisible_by
    return math.ceil(total / d) * d


class NGramEmbedding(nn.Module):
    def __init__(self, args: Qwen4ExpArgs, ple_index: int):
        super().__init__()
        self.n = args.ngram_size
        self.per_order = args.heads_per_ngram
        heads = (self.n - 1) * self.per_order
        self.eos = args.eos_token_id
        self._sizes = head_vocab_sizes(args.ngram_vocab_size_base, ple_index * heads, heads)
        self._offsets = [sum(self._sizes[:i]) for i in range(heads)]
        self._mult = layer_multipliers(args.vocab_size, self.n, ple_index, args.seed)
        self.ngram_embedding = nn.Embedding(ngram_table_rows(args, ple_index), args.ple_embed_dim // heads)
        self.mapped = None  # the table memory-mapped from the checkpoint (models/ngram_tables.py), if so

    def use_mapped(self, table: Any) -> None:
        """Read rows from `table` (a MappedTable) instead of an in-memory `ngram_embedding`."""
        if table.shape != self.ngram_embedding.weight.shape:
            raise ValueError(f"n-gram table of shape {table.shape}, expected {self.ngram_embedding.weight.shape}")
        del self["ngram_embedding"]
        self.mapped = table

    @property
    def table_nbytes(self) -> int:
        return self.mapped.nbytes if self.mapped is not None else self.ngram_embedding.weight.nbytes

    def ids(self, history: mx.array, T: int) -> mx.array:
        """Table rows [B, T, heads] of the last T tokens of `history` [B, n-1+T] (int64)."""
        h = history.astype(mx.int64)
        L = h.shape[1]
        is_eos = h == self.eos
        shifted = [h]
        for s in range(1, self.n):  # token s back, or EOS when an EOS lies within the last s
            src = mx.concatenate([mx.full((h.shape[0], s), self.eos, mx.int64), h[:, : L - s]], axis=1)
            crossed = mx.zeros_like(is_eos)
            for j in range(1, s + 1):
                crossed = crossed | mx.concatenate([mx.ones((h.shape[0], j), mx.bool_), is_eos[:, : L - j]], axis=1)
            shifted.append(mx.where(crossed, self.eos, src))
        blocks = []
        for order in range(2, self.n + 1):
            mixed = shifted[0] * self._mult[0]
            for p in range(1, order):
                mixed = mixed ^ (shifted[p] * self._mult[p])
            lo = (order - 2) * self.per_order
            sizes = mx.array(self._sizes[lo : lo + self.per_order], dtype=mx.int64)
            offsets = mx.array(self._offsets[lo : lo + self.per_order], dtype=mx.int64)
            blocks.append(mx.remainder(mixed[..., None], sizes) + offsets)
        return mx.concatenate(blocks, axis=-1)[:, -T:].astype(mx.int32)

    def __call__(self, history: mx.array, T: int) -> mx.array:
        ids = self.ids(history, T)
        e = self.mapped.take(ids) if self.mapped is not None else self.ngram_embedding(ids)
        return e.reshape(*e.shape[:2], -1)


class PLE(nn.Module):
    def __init__(self, args: Qwen4ExpArgs, ple_index: int):
        super().__init__()
        G, H, E = args.hc_count, args.hidden_size, args.ple_embed_dim
        self.G, self.H = G, H
        self.context = args.ngram_size - 1
        self.kernel, self.dilation = args.ple_conv_kernel_size, args.ngram_size
        self.window = (self.kernel - 1) * self.dilation
        self.ple_embedding = NGramEmbedding(args, ple_index)
        self.key_proj = nn.Linear(E, G * H, bias=False)
        self.value_proj = nn.Linear(E, H, bias=False)
        eps = args.rms_norm_eps
        self.norm_key = GroupedRMSNorm(G * H, eps, G)
        self.norm_query = GroupedRMSNorm(G * H, eps, G)
        self.norm_conv = GroupedRMSNorm(G * H, eps, G)
        self.conv_weight = mx.zeros((G * H, self.kernel))  # depthwise, dilated (HF conv1d.weight [C, 1, K])

    def __call__(self, streams: mx.array, tokens: mx.array, cache: Optional["PLEState"], capture: bool = False) -> mx.array:
        B, T, _ = streams.shape
        ctx = cache.ngram if cache is not None and cache.ngram is not None else mx.full((B, self.context), self.ple_embedding.eos, tokens.dtype)
        history = mx.concatenate([ctx.astype(tokens.dtype), tokens], axis=1)
        e = self.ple_embedding(history, T).astype(streams.dtype)
        shape = (B, T, self.G, self.H)
        key = self.norm_key(self.key_proj(e)).reshape(shape)
        query = self.norm_query(streams).reshape(shape)
        gate = (key * query).sum(axis=-1, keepdims=True) / math.sqrt(self.H)
        gate = mx.sqrt(mx.maximum(mx.abs(gate), 1e-6)) * mx.sign(gate)
        value = (mx.sigmoid(gate) * self.value_proj(e)[:, :, None, :]).reshape(B, T, -1)
        normed = self.norm_conv(value)
        prev = cache.conv if cache is not None and cache.conv is not None else mx.zeros((B, self.window, normed.shape[-1]), normed.dtype)
        conv_in = mx.concatenate([prev, normed], axis=1)
        out = sum(conv_in[:, j * self.dilation : j * self.dilation + T] * self.conv_weight[:, j] for j in range(self.kernel))
        if cache is not None:
            cache.store(history, conv_in, T, capture)
        return value + nn.silu(out)


# ---------------------------------------------------------------- attention with the QSA indexer


class IndexKeys:
    """The QSA indexer's raw key per token, kept beside an attention cache's keys and values at
    the same offsets (full precision whatever the KV setting: one small head per token), so
    `trim` rolls it back with them. A row whose prompt held an image also keeps each token's
    multimodal position (`index_positions`: the indexer rotates a block at its first token's);
    text-only rows keep none (a token's position is its index)."""

    index_keys: Optional[mx.array] = None  # [B, capacity, D]
    index_positions: Optional[mx.array] = None  # [B, 3, capacity] int32, or None: positions are indices

    def update_index(self, start: int, keys: mx.array, positions: Optional[mx.array] = None):
        """Write keys [B, T, D] (and their positions [B|1, 3, T]) at `start`; returns the keys
        [B, start+T, D] and their positions [B, 3, start+T] (None while every one is its index)."""
        B, T, D = keys.shape
        end = start + T
        if self.index_keys is None or self.index_keys.shape[1] < end:
            grown = mx.zeros((B, ((end + self.step - 1) // self.step) * self.step, D), keys.dtype)
            if self.index_keys is not None and start:
                grown[:, :start] = self.index_keys[:, :start]
            self.index_keys = grown
        self.index_keys[:, start:end] = keys
        if positions is not None or self.index_positions is not None:
            self._write_positions(start, end, B, positions)
            return self.index_keys[:, :end], self.index_positions[:, :, :end]
        return self.index_keys[:, :end], None

    def place_positions(self, positions: mx.array) -> None:
        """Give the tokens this cache holds their multimodal positions [3, offset] (a cache
        restored from a prompt-cache snapshot keeps none: the prompt's images give them)."""
        self.index_positions = None
        self._write_positions(0, positions.shape[1], self.index_keys.shape[0], positions[None])

    def _write_positions(self, start: int, end: int, B: int, positions: Optional[mx.array]) -> None:
        cap = self.index_keys.shape[1]
        if self.index_positions is None or self.index_positions.shape[2] < cap:
            old = self.index_positions
            grown = mx.broadcast_to(mx.arange(cap, dtype=mx.int32)[None, None], (B, 3, cap))  # text: index
            if old is not None and start:
                grown = mx.concatenate([old[:, :, :start], grown[:, :, start:]], axis=2)
            self.index_positions = mx.contiguous(grown)
        if positions is None:  # a forward at plain positions (a row whose images shift nothing)
            positions = text_positions(start, end - start)
        self.index_positions[:, :, start:end] = positions.astype(mx.int32)

    @property
    def state(self):
        """The attention cache's state, then the index keys up to its offset."""
        keys = self.index_keys[:, : self.offset] if self.index_keys is not None else None
        return (*super().state, keys)

    @state.setter
    def state(self, v):
        *base, self.index_keys = v
        super(IndexKeys, type(self)).state.__set__(self, tuple(base))  # the attention cache's own setter


class IndexedKVCache(IndexKeys, KVCache):
    """A full-precision KVCache with the indexer's keys."""


class IndexedQuantizedKVCache(IndexKeys, QuantizedKVCache):
    """A quantized KV cache (`--kv-bits`) with the indexer's keys (those stay full precision)."""


def indexed_kv_cache(kv: KVSetting = FULL_KV) -> IndexKeys:
    """An empty attention cache for an indexed layer at KV setting `kv`."""
    return IndexedQuantizedKVCache(kv.group_size, kv.bits) if kv.quantized else IndexedKVCache()


class Indexer(nn.Module):
    def __init__(self, args: Qwen4ExpArgs):
        super().__init__()
        self.n_heads, self.dim = args.indexer_n_heads, args.indexer_head_dim
        self.ratio = args.indexer_compress_ratio
        self.top_blocks = args.indexer_budget // args.indexer_compress_ratio
        self.rope_dims, self.base, self.axes = args.rotary_dim, args.rope_theta, args.mrope_axes
        self.index_qk_proj = nn.Linear(args.hidden_size, (self.n_heads + 1) * self.dim, bias=False)
        self.q_layernorm = GroupedRMSNorm(self.dim, args.rms_norm_eps)
        self.k_layernorm = GroupedRMSNorm(self.dim, args.rms_norm_eps)

    def selection(self, x: mx.array, offset: int, cache: Optional[IndexKeys],
                  positions: Optional[mx.array] = None) -> mx.array:
        """Which keys each query may attend to: [B, 1, T, offset+T] bool (causal included).
        `positions`: the queries' multimodal positions [B|1, 3, T] (None: their indices)."""
        B, T, _ = x.shape
        qk = self.index_qk_proj(x)
        q = self.q_layernorm(qk[..., : self.n_heads * self.dim].reshape(B, T, self.n_heads, self.dim))
        idx = mx.arange(offset, offset + T)
        q = q.transpose(0, 2, 1, 3)  # [B, h, T, D]
        q = rope_at(q, idx if positions is None else positions, self.rope_dims, self.base, self.axes)
        raw = qk[..., self.n_heads * self.dim :]
        if cache is not None:
            keys, kpositions = cache.update_index(offset, raw, positions)
        else:
            keys, kpositions = raw, positions
        S = keys.shape[1]
        nb = S // self.ratio
        kpos = mx.arange(S)
        causal = kpos[None] <= idx[:, None]  # [T, S]
        if nb == 0:
            return mx.broadcast_to(causal[None, None], (B, 1, T, S))
        blocks = keys[:, : nb * self.ratio].reshape(B, nb, self.ratio, self.dim).astype(mx.float32).mean(axis=2)
        blocks = self.k_layernorm(blocks.astype(keys.dtype))
        if kpositions is None:
            starts = mx.arange(nb) * self.ratio
        else:  # each block at its first token's multimodal position
            starts = kpositions[:, :, : nb * self.ratio : self.ratio]
        blocks = rope_at(blocks, starts, self.rope_dims, self.base, self.axes)
        scores = mx.maximum(q.astype(mx.float32) @ blocks.astype(mx.float32).swapaxes(-1, -2)[:, None], 0)
        scores = scores.sum(axis=1) / math.sqrt(self.dim)  # [B, T, nb]
        complete = (idx + 1) // self.ratio  # complete blocks each query sees
        valid = mx.arange(nb)[None] < complete[:, None]  # [T, nb]
        chosen = top_blocks(mx.where(valid[None], scores, -mx.inf), self.top_blocks) & valid[None]  # [B, T, nb]
        in_block = kpos < nb * self.ratio
        token_chosen = mx.take(chosen, mx.minimum(kpos // self.ratio, nb - 1), axis=-1) & in_block
        tail = (kpos[None] >= (complete * self.ratio)[:, None])  # the incomplete last block
        return ((token_chosen | tail[None]) & causal[None])[:, None]


def top_blocks(scores: mx.array, k: int) -> mx.array:
    """The k best of `scores` [..., n] as a mask; among blocks tied at the cut (heads' scores
    all clamped to zero by the ReLU tie easily) the most recent win. transformers' `topk`
    leaves the order of ties unspecified (its CPU and CUDA kernels differ), so this rule
    is a choice, fixed here so a verify window and plain steps choose alike."""
    n = scores.shape[-1]
    if n <= k:
        return mx.ones(scores.shape, mx.bool_)
    cut = mx.sort(scores, axis=-1)[..., n - k : n - k + 1]  # the k-th best score
    above = scores > cut
    tied = scores == cut
    need = k - above.sum(axis=-1, keepdims=True)
    later_tied = mx.cumsum(tied[..., ::-1].astype(mx.int32), axis=-1)[..., ::-1] - tied  # tied blocks after each
    return above | (tied & (later_tied < need))


class Attention(nn.Module):
    def __init__(self, args: Qwen4ExpArgs):
        super().__init__()
        H, nh, nkv, hd = args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.scale = hd ** -0.5
        self.rope_dims, self.base, self.axes = args.rotary_dim, args.rope_theta, args.mrope_axes
        bias = args.attention_bias
        self.q_proj = nn.Linear(H, nh * hd * 2, bias=bias)
        self.k_proj = nn.Linear(H, nkv * hd, bias=bias)
        self.v_proj = nn.Linear(H, nkv * hd, bias=bias)
        self.o_proj = nn.Linear(nh * hd, H, bias=bias)
        self.q_norm = GroupedRMSNorm(hd, args.rms_norm_eps)
        self.k_norm = GroupedRMSNorm(hd, args.rms_norm_eps)
        if args.qsa:
            self.indexer = Indexer(args)

    def __call__(self, x: mx.array, cache: Optional[KVCache], positions: Optional[mx.array] = None) -> mx.array:
        """`positions`: multimodal positions [B|1, 3, T] (None: text at the cache offset)."""
        B, T, _ = x.shape
        offset = cache.offset if cache is not None else 0
        q, gate = mx.split(self.q_proj(x).reshape(B, T, self.nh, 2 * self.hd), 2, axis=-1)
        q = self.q_norm(q).transpose(0, 2, 1, 3)
        k = self.k_norm(self.k_proj(x).reshape(B, T, self.nkv, self.hd)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, T, self.nkv, self.hd).transpose(0, 2, 1, 3)
        if positions is None:
            q = mx.fast.rope(q, self.rope_dims, traditional=False, base=self.base, scale=1.0, offset=offset)
            k = mx.fast.rope(k, self.rope_dims, traditional=False, base=self.base, scale=1.0, offset=offset)
        else:
            q, k = (rope_at(t, positions, self.rope_dims, self.base, self.axes) for t in (q, k))
        if "indexer" in self:
            mask = self.indexer.selection(x, offset, cache, positions)
        else:
            mask = mx.arange(offset + T)[None] <= mx.arange(offset, offset + T)[:, None]
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if getattr(cache, "bits", None) is not None:  # quantized KV: the project's quantized attention
            out = kv_attention(q, k, v, cache, self.scale, mask)
        else:
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        out = out.transpose(0, 2, 1, 3).reshape(B, T, -1)
        return self.o_proj(out * mx.sigmoid(gate.reshape(B, T, -1)))


# ---------------------------------------------------------------- layers and model


class PLEState:
    """A PLE layer's two windows (last n-1 tokens, last conv inputs); while its cache
    captures a verify window, the whole window is kept so a commit can cut it anywhere."""

    def __init__(self):
        self.ngram: Optional[mx.array] = None
        self.conv: Optional[mx.array] = None
        self.recorded: Optional[tuple] = None  # (history, conv input, T)

    def store(self, history: mx.array, conv_in: mx.array, T: int, capture: bool = False) -> None:
        n_ctx, n_conv = history.shape[1] - T, conv_in.shape[1] - T
        self.ngram = mx.contiguous(history[:, -n_ctx:])
        self.conv = mx.contiguous(conv_in[:, -n_conv:])
        self.recorded = (history, conv_in, T) if capture else None

    def keep(self, n) -> None:
        """Windows as after the first n positions of the recorded window (an int, or one per row)."""
        history, conv_in, T = self.recorded
        self.ngram, self.conv = _cut(history, n, history.shape[1] - T), _cut(conv_in, n, conv_in.shape[1] - T)
        self.recorded = None


def _cut(full: mx.array, n, width: int) -> mx.array:
    if isinstance(n, int):
        return mx.contiguous(full[:, n : n + width])
    pos = n.astype(mx.int32)[:, None] + mx.arange(width)[None]
    if full.ndim == 3:
        pos = pos[..., None]
    return mx.take_along_axis(full, pos, axis=1)


class DecoderLayer(nn.Module):
    def __init__(self, args: Qwen4ExpArgs, idx: int):
        super().__init__()
        self.is_linear = args.layer_types[idx] == "linear_attention"
        if self.is_linear:
            self.linear_attn = Qwen35GatedDeltaNetBase(SimpleNamespace(**vars(args)))
        else:
            self.self_attn = Attention(args)
        self.mlp = Qwen3NextSparseMoeBlock(args)
        if idx + 1 in args.ple_layer_ids:
            self.ple = PLE(args, args.ple_layer_ids.index(idx + 1))
        self.attn_hyper_connection = GatedResidual(args)
        self.mlp_hyper_connection = GatedResidual(args)

    @property
    def has_ple(self) -> bool:
        return "ple" in self

    def __call__(self, streams: mx.array, tokens: mx.array, cache: Any = None,
                 positions: Optional[mx.array] = None) -> mx.array:
        if self.has_ple:
            streams = streams + self.ple(streams, tokens, None if cache is None else cache.ple,
                                         getattr(cache, "capturing", False))
        x, w = self.attn_hyper_connection(streams)
        if self.is_linear:
            y = self.linear_attn(x, mask=None, cache=cache)
        else:
            y = self.attend(x, cache, positions)
        streams = inject(streams, y, w)
        x, w = self.mlp_hyper_connection(streams)
        return inject(streams, self.mlp(x), w)


    def attend(self, x: mx.array, cache: Any, positions: Any) -> mx.array:
        """The attention; over a batch's rows (a cache with `rows`: each row's own indexed cache,
        `positions` a list per row) row by row: the rows differ in length, and the indexer
        groups each row's own keys into blocks."""
        rows = getattr(cache, "rows", None)
        if rows is None:
            return self.self_attn(x, cache, positions)
        return mx.concatenate([self.self_attn(x[i : i + 1], c, None if positions is None else positions[i])
                               for i, c in enumerate(rows)])


class Inner(nn.Module):
    def __init__(self, args: Qwen4ExpArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.hyper_connection_mixer = GatedResidual(args, combine=False)

    def __call__(self, tokens: mx.array, cache: Optional[list] = None, embeds: Optional[mx.array] = None,
                 positions: Optional[mx.array] = None) -> mx.array:
        """`embeds` replace the tokens' embeddings (image features at image tokens; PLE still
        hashes the token ids); `positions`: multimodal positions [B|1, 3, T] (over a batch whose
        attention caches are per row: a list of each row's, or None)."""
        h = self.embed_tokens(tokens) if embeds is None else embeds
        streams = mx.concatenate([h] * self.args.hc_count, axis=-1)
        for i, layer in enumerate(self.layers):
            streams = layer(streams, tokens, None if cache is None else cache[i], positions)
        return self.hyper_connection_mixer(streams)


class TextModel(nn.Module):
    def __init__(self, args: Qwen4ExpArgs):
        super().__init__()
        self.args = args
        self.model = Inner(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def logits(self, h: mx.array) -> mx.array:
        return self.model.embed_tokens.as_linear(h) if self.args.tie_word_embeddings else self.lm_head(h)


class Model(nn.Module):
    """The whole checkpoint's text part: `language_model.model.*` and `language_model.lm_head`."""

    model_type = MODEL_TYPE

    def __init__(self, args: Qwen4ExpArgs):
        super().__init__()
        self.args = args
        self.language_model = TextModel(args)

    def __call__(self, tokens: mx.array, cache: Optional[list] = None) -> mx.array:
        return self.language_model.logits(self.language_model.model(tokens, cache))

    @property
    def layers(self):
        return self.language_model.model.layers

    def make_cache(self) -> list:
        return make_cache(self.layers)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        return sanitize(weights, self.args)


def make_cache(layers, gdn_cache_cls: Optional[type] = None, kv: KVSetting = FULL_KV) -> list:
    """One cache per layer: attention layers an indexed KV cache at `kv`, GatedDeltaNet layers a
    GatedDeltaNet cache (`gdn_cache_cls`, mlx-lm's ArraysCache by default) carrying a
    `ple` PLEState (None on layers without PLE)."""
    from .mlx_lm_compat import ArraysCache

    out = []
    for layer in layers:
        if not layer.is_linear:
            out.append(indexed_kv_cache(kv))
            continue
        c = gdn_cache_cls() if gdn_cache_cls is not None else ArraysCache(size=2)
        c.ple = PLEState() if layer.has_ple else None
        out.append(c)
    return out


# ---------------------------------------------------------------- checkpoint layout

# Zero-centred (1 + w) RMSNorm weights in the checkpoint; the GatedDeltaNet's gated norm is not.
_SHIFTED = re.compile(r"(hc_norm|q_norm|k_norm|q_layernorm|k_layernorm|norm_key|norm_query|norm_conv)\.weight$")
_SHARD = re.compile(r"^(.*ngram_embedding)\.shard_(\d+)\.weight$")
_PER_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def sanitize(weights: Dict[str, mx.array], args: Qwen4ExpArgs) -> Dict[str, mx.array]:
    """Raw Hugging Face tensors (`model.language_model.*`, `lm_head`) -> this module's names:
    n-gram table shards joined, experts stacked for mlx-lm's SwitchGLU, conv weights to MLX's
    layout, zero-centred norms shifted. The vision tower and MTP tensors must be split off before."""
    if any(k.startswith(("model.visual.", "visual.", "vision_tower.")) for k in weights):
        raise ValueError(f"{MODEL_TYPE}: the vision tower's tensors go to models/vision's loader, not the backbone")
    if weights and all(k.startswith("language_model.") for k in weights):
        return weights  # this module's own layout (`mtp-convert`'s output): already sanitized, maybe quantized
    if is_mlx_lm_layout(weights):
        return _from_mlx_lm(weights)
    if any(k.endswith((".scales", ".weight_scale_inv", ".weight_scale", ".qweight")) for k in weights):
        raise unsupported("a quantized Hugging Face body (convert the original with mtp-convert)")
    out: Dict[str, mx.array] = {}
    shards: Dict[str, dict] = {}
    experts: Dict[str, dict] = {}
    for k, v in weights.items():
        if k.startswith("model.language_model."):
            k = "language_model.model." + k[len("model.language_model."):]
        elif k.startswith("lm_head."):
            k = "language_model." + k
        if (m := _SHARD.match(k)):
            shards.setdefault(m.group(1), {})[int(m.group(2))] = v
            continue
        if (m := _PER_EXPERT.match(k)):
            experts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = v
            continue
        if k.endswith(".mlp.experts.gate_up_proj"):
            p = k[: -len(".experts.gate_up_proj")]
            gate, up = mx.split(v, 2, axis=-2)
            out[f"{p}.switch_mlp.gate_proj.weight"], out[f"{p}.switch_mlp.up_proj.weight"] = gate, up
            continue
        if k.endswith(".mlp.experts.down_proj"):
            out[k[: -len(".experts.down_proj")] + ".switch_mlp.down_proj.weight"] = v
            continue
        if k.endswith(".mlp.gate.weight") or k.endswith(".mlp.shared_expert_gate.weight"):
            out[k] = v
            continue
        if k.endswith("linear_attn.conv1d.weight") and v.ndim == 3 and v.shape[-1] != 1:
            v = v.moveaxis(2, 1)  # [C, 1, K] -> [C, K, 1]
        if k.endswith(".ple.conv1d.weight"):
            k, v = k[: -len("conv1d.weight")] + "conv_weight", v.reshape(v.shape[0], -1)
        if _SHIFTED.search(k) and v.ndim == 1:
            v = v.astype(mx.float32) + 1.0  # in float32 as transformers does: a bf16 1 + w would round
        out[k] = v
    for p, parts in shards.items():
        out[p + ".weight"] = mx.concatenate([parts[i] for i in sorted(parts)], axis=0)
    for p, by_name in experts.items():
        for name, per in by_name.items():
            out[f"{p}.switch_mlp.{name}.weight"] = mx.stack([per[i] for i in sorted(per)])
    return out


# The n-gram hash's constants, which mlx-lm's model keeps as parameters (so saves); this module
# derives them from the config.
_NGRAM_BUFFERS = (".layer_multipliers", ".ngram_heads_vocab_sizes", ".ngram_heads_offsets")


def is_mlx_lm_layout(weights: Dict[str, mx.array]) -> bool:
    """The layout mlx-lm's main-branch model writes (mlx-community conversions): the text model
    under `model.*` (not `model.language_model.*`), top-level `lm_head`."""
    return any(k.startswith(("model.layers.", "model.embed_tokens.")) for k in weights) and not any(
        k.startswith(("model.language_model.", "language_model.")) for k in weights)


def _from_mlx_lm(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """mlx-lm layout -> this module's names. Experts are already stacked (`switch_mlp`) and the
    GatedDeltaNet conv is already [C, K, 1]; norms are stored zero-centred (mlx-lm applies 1 + w),
    so they are shifted here; the PLE conv [C, K, 1] becomes [C, K]. Bodies quantized by mlx-lm
    (affine, the router kept in full precision) keep their `.scales`/`.biases`."""
    out: Dict[str, mx.array] = {}
    shards: Dict[str, dict] = {}
    for k, v in weights.items():
        if k.endswith(_NGRAM_BUFFERS):
            continue
        if k.startswith("model."):
            k = "language_model." + k
        elif k.startswith("lm_head."):
            k = "language_model." + k
        if ".ngram_embedding.shard_" in k and not k.endswith(".weight"):
            raise unsupported("a quantized PLE n-gram table (convert with the tables in full precision)")
        if (m := _SHARD.match(k)):
            shards.setdefault(m.group(1), {})[int(m.group(2))] = v
            continue
        if k.endswith(".ple.conv1d.weight"):
            k, v = k[: -len("conv1d.weight")] + "conv_weight", v.reshape(v.shape[0], -1)
        if _SHIFTED.search(k) and v.ndim == 1:
            v = v.astype(mx.float32) + 1.0
        out[k] = v
    for p, parts in shards.items():
        out[p + ".weight"] = mx.concatenate([parts[i] for i in sorted(parts)], axis=0)
    return out


def ngram_table_bytes(model: nn.Module) -> int:
    """Bytes the PLE n-gram tables hold (the start-up line reports them)."""
    return sum(l.ple.ple_embedding.table_nbytes for l in model.layers if l.has_ple)


def tables_mapped(model: nn.Module) -> bool:
    """Whether every PLE layer reads its n-gram table memory-mapped."""
    return all(l.ple.ple_embedding.mapped is not None for l in model.layers if l.has_ple)


def build(config: dict) -> Model:
    return Model(Qwen4ExpArgs.from_config(config))


def head_args(config: dict) -> Any:
    """mlx-lm Qwen3.5 MoE arguments for the MTP head's decoder layer. The head is taken to be
    Qwen3.5 MoE's (`mtp.fc`, `mtp.pre_fc_norm_*`, one decoder layer with input and
    post-attention norms, gated full attention without the indexer and the MoE block,
    `mtp.norm`): transformers does not define it (it drops `mtp.*`)."""
    from .mlx_lm_compat import Qwen35TextModelArgs

    text = dict(config.get("text_config", config))
    text.update(model_type="qwen3_5_moe_text", full_attention_interval=1, layer_types=None)
    return Qwen35TextModelArgs.from_dict(text)

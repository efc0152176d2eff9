"""The Qwen3-VL vision tower as Qwen3.5 uses it (no deepstack).

Patch embedding (a Conv3d whose stride equals its kernel, i.e. one matmul per patch), a
learned position table bilinearly interpolated to the image's grid, 2-D rotary attention
over the image's patches, pre-norm blocks, and the merger that folds each merge x merge
window into one text-width token. Parameter names follow mlx-vlm's `vision_tower.*`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mtp_serve.models.prefill_attention import full_attention


@dataclass(frozen=True)
class TowerConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    num_position_embeddings: int = 2304
    hidden_act: str = "gelu_pytorch_tanh"  # the blocks' MLP (the merger always uses exact GELU)

    @classmethod
    def from_dict(cls, vc: dict) -> "TowerConfig":
        names = cls.__dataclass_fields__
        deep = vc.get("deepstack_visual_indexes") or []
        if deep:
            raise ValueError(f"deepstack vision towers are not supported (deepstack_visual_indexes={deep})")
        act = vc.get("hidden_act", cls.hidden_act)
        if act not in ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        return cls(**{k: int(v) for k, v in vc.items() if k in names and k != "hidden_act"}, hidden_act=act)


# transformers' ACT2FN names -> MLX
ACTIVATIONS = {"gelu_pytorch_tanh": nn.gelu_approx, "gelu_new": nn.gelu_approx, "gelu_fast": nn.gelu_approx,
               "gelu": nn.gelu, "quick_gelu": nn.gelu_fast_approx, "silu": nn.silu}


class PatchEmbed(nn.Module):
    def __init__(self, c: TowerConfig):
        super().__init__()
        self.c = c
        k = (c.temporal_patch_size, c.patch_size, c.patch_size)
        self.proj = nn.Conv3d(c.in_channels, c.hidden_size, kernel_size=k, stride=k, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        c = self.c
        # [N, C*t*p*p] (channel-major, as the processor flattens) -> NDHWC for MLX's conv.
        x = x.reshape(-1, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size).moveaxis(1, 4)
        return self.proj(x).reshape(-1, c.hidden_size)


SCORE_BUDGET = 512 * 2**20  # bytes of fp32 attention scores per block of query rows


def _rotate_half(x: mx.array) -> mx.array:
    h = x.shape[-1] // 2
    return mx.concatenate([-x[..., h:], x[..., :h]], axis=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        n = x.shape[0]
        q, k, v = mx.split(self.qkv(x).reshape(n, 3, self.num_heads, -1).transpose(1, 2, 0, 3), 3)
        q = q * cos + _rotate_half(q) * sin   # [1, heads, n, head_dim]
        k = k * cos + _rotate_half(k) * sin
        out = self._attend(q, k, v)
        return self.proj(out[0].transpose(1, 0, 2).reshape(n, -1))

    def _attend(self, q: mx.array, k: mx.array, v: mx.array) -> mx.array:
        """Full attention over the image's patches; a large image (Qwen3.5 allows 16 Mpx: ~65k
        patches) goes in blocks of query rows, so the score matrix never exceeds SCORE_BUDGET."""
        n = q.shape[2]
        if mx.default_device() == mx.cpu and q.dtype == mx.float32 and n > 64:
            return full_attention(q, k, v, self.scale)  # MLX's CPU attention materialises every score
        rows = max(1, SCORE_BUDGET // (4 * n * self.num_heads))
        if rows >= n:
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale)
        parts = []
        for i in range(0, n, rows):
            part = mx.fast.scaled_dot_product_attention(q[:, :, i:i + rows], k, v, scale=self.scale)
            mx.eval(part)  # one block's scores at a time
            parts.append(part)
        return mx.concatenate(parts, axis=2)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden, bias=True)
        self.linear_fc2 = nn.Linear(hidden, dim, bias=True)
        self.act = ACTIVATIONS[act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Block(nn.Module):
    def __init__(self, c: TowerConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(c.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(c.hidden_size, eps=1e-6)
        self.attn = Attention(c.hidden_size, c.num_heads)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, c.hidden_act)

    def __call__(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    def __init__(self, c: TowerConfig):
        super().__init__()
        self.width = c.hidden_size * c.spatial_merge_size ** 2
        self.norm = nn.LayerNorm(c.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, c.out_hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        x = self.norm(x).reshape(-1, self.width)  # rows of one merge window are adjacent
        return self.linear_fc2(nn.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    def __init__(self, c: TowerConfig):
        super().__init__()
        self.c = c
        self.patch_embed = PatchEmbed(c)
        self.pos_embed = nn.Embedding(c.num_position_embeddings, c.hidden_size)
        self.side = int(round(c.num_position_embeddings ** 0.5))
        self.blocks = [Block(c) for _ in range(c.depth)]
        self.merger = Merger(c)

    # Per-image index tables, computed in numpy: they depend only on the grid.
    def _merge_order(self, h: int, w: int) -> np.ndarray:
        """(row, col) of each patch in the processor's merge-window order."""
        m = self.c.spatial_merge_size
        rows = np.arange(h).reshape(h // m, 1, m, 1)
        cols = np.arange(w).reshape(1, w // m, 1, m)
        rows = np.broadcast_to(rows, (h // m, w // m, m, m)).reshape(-1)
        cols = np.broadcast_to(cols, (h // m, w // m, m, m)).reshape(-1)
        return rows, cols

    def _position_embedding(self, t: int, h: int, w: int, rows: np.ndarray, cols: np.ndarray) -> mx.array:
        """The learned side x side table, bilinearly resampled to h x w (align-corners)."""
        s = self.side
        hi = np.linspace(0, s - 1, h, dtype=np.float32)
        wi = np.linspace(0, s - 1, w, dtype=np.float32)
        h0, w0 = hi.astype(np.int32), wi.astype(np.int32)
        h1, w1 = np.minimum(h0 + 1, s - 1), np.minimum(w0 + 1, s - 1)
        dh, dw = (hi - h0)[rows], (wi - w0)[cols]
        r0, r1, c0, c1 = h0[rows], h1[rows], w0[cols], w1[cols]
        idx = np.stack([r0 * s + c0, r0 * s + c1, r1 * s + c0, r1 * s + c1]).astype(np.int32)
        wts = np.stack([(1 - dh) * (1 - dw), (1 - dh) * dw, dh * (1 - dw), dh * dw]).astype(np.float32)
        table = self.pos_embed(mx.array(idx))                       # [4, n, hidden]
        wts = mx.array(wts, dtype=table.dtype)[:, :, None]
        pe = table[0] * wts[0] + table[1] * wts[1] + table[2] * wts[2] + table[3] * wts[3]
        return mx.tile(pe, (t, 1)) if t > 1 else pe

    def _rotary(self, t: int, rows: np.ndarray, cols: np.ndarray, dtype) -> tuple:
        head_dim = self.c.hidden_size // self.c.num_heads
        dim = head_dim // 2
        inv = 1.0 / (10000.0 ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
        freqs = np.concatenate([np.outer(rows, inv), np.outer(cols, inv)], axis=-1).astype(np.float32)
        freqs = mx.array(np.tile(freqs, (t, 1)))
        emb = mx.concatenate([freqs, freqs], axis=-1)   # [n, head_dim]
        return mx.cos(emb).astype(dtype), mx.sin(emb).astype(dtype)

    def __call__(self, pixels: mx.array, grid_thw: tuple) -> mx.array:
        """One image's patches [t*h*w, C*tp*p*p] -> [t*h*w / merge^2, out_hidden]."""
        *_, out = self.steps(pixels, grid_thw, blocks_per_step=0)
        return out

    def steps(self, pixels: mx.array, grid_thw: tuple, blocks_per_step: int = 1) -> Iterator[Optional[mx.array]]:
        """The same forward in pieces: yields None after every `blocks_per_step` blocks (their
        output evaluated; 0: no pieces), then the output. The engine runs one piece per step,
        so the rows decoding meanwhile wait at most a piece, not a whole image."""
        t, h, w = (int(v) for v in grid_thw)
        if t != 1:  # video frames would need per-frame attention blocks; images are one frame
            raise ValueError(f"the vision tower encodes single images (t=1), got grid {grid_thw}")
        rows, cols = self._merge_order(h, w)
        x = self.patch_embed(pixels.astype(self.patch_embed.proj.weight.dtype))
        x = x + self._position_embedding(t, h, w, rows, cols).astype(x.dtype)
        cos, sin = self._rotary(t, rows, cols, x.dtype)
        for i, blk in enumerate(self.blocks, 1):
            x = blk(x, cos, sin)
            if blocks_per_step and i % blocks_per_step == 0 and i < len(self.blocks):
                mx.eval(x)
                yield None
        yield self.merger(x)

"""Multimodal RoPE (M-RoPE) as Qwen3-VL / Qwen3.5 use it.

Every token has three positions (temporal, height, width). Text tokens have the same
value on all three; an image's tokens count its rows and columns from the position after
the preceding text; text after an image resumes at the largest position so far + 1. Each
rotary frequency reads one of the three: with interleaved sections (Qwen3-VL, Qwen3.5)
frequency j reads height when j % 3 == 1 and j < 3 * section[1], width when j % 3 == 2
and j < 3 * section[2], otherwise temporal.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mtp_serve.models.activations import NativeRoPE
from mtp_serve.models.vision.spec import VisionSpec


def mrope_positions(ids: Sequence[int], grids: Sequence[tuple], spec: VisionSpec) -> Tuple[np.ndarray, int]:
    """Positions int64 [3, len(ids)] of one sequence whose image-pad runs match `grids` in
    order, and delta = max(positions) + 1 - len(ids) (later text sits at index + delta)."""
    ids = np.asarray(ids, dtype=np.int64)
    n, m = len(ids), spec.spatial_merge_size
    pos = np.empty((3, n), dtype=np.int64)
    st, next_pos = 0, 0
    for t, h, w in grids:
        gt, gh, gw = int(t), int(h) // m, int(w) // m
        count = gt * gh * gw
        found = np.flatnonzero(ids[st:] == spec.image_token_id)
        if len(found) == 0:
            raise ValueError(f"prompt has fewer image tokens than its {len(grids)} images")
        ed = st + int(found[0])
        if ed + count > n or not np.all(ids[ed:ed + count] == spec.image_token_id):
            raise ValueError(f"an image of grid {(t, h, w)} needs {count} consecutive image tokens")
        pos[:, st:ed] = next_pos + np.arange(ed - st)            # text before the image
        base = next_pos + (ed - st)
        pos[0, ed:ed + count] = base + np.repeat(np.arange(gt), gh * gw)
        pos[1, ed:ed + count] = base + np.tile(np.repeat(np.arange(gh), gw), gt)
        pos[2, ed:ed + count] = base + np.tile(np.arange(gw), gt * gh)
        next_pos = base + max(gt, gh, gw)
        st = ed + count
    if np.any(ids[st:] == spec.image_token_id):
        raise ValueError(f"prompt has more image tokens than its {len(grids)} images take")
    pos[:, st:] = next_pos + np.arange(n - st)
    delta = int(pos.max()) + 1 - n if n else 0
    return pos, delta


def _inv_freq(rope: nn.Module) -> mx.array:
    """The rope module's inverse frequencies (dims/2), as mx.fast.rope computes them."""
    if type(rope) not in (nn.RoPE, NativeRoPE):  # mlx-lm's scaled variants (YaRN, Llama 3, ...) change the frequencies
        raise ValueError(f"M-RoPE is implemented for the default rotary embedding, not {type(rope).__name__}")
    dims = rope.dims
    return mx.power(mx.array(float(rope.base), mx.float32),
                    -mx.arange(0, dims, 2, dtype=mx.float32) / dims)


def axis_of_frequency(half: int, spec: VisionSpec) -> np.ndarray:
    """For each of the `half` rotary frequencies, which position row (0 t, 1 h, 2 w) it reads."""
    sec = list(spec.mrope_section) + [0] * (3 - len(spec.mrope_section))
    axis = np.zeros(half, dtype=np.int64)
    if spec.mrope_interleaved:
        j = np.arange(half)
        axis[(j % 3 == 1) & (j < 3 * sec[1])] = 1
        axis[(j % 3 == 2) & (j < 3 * sec[2])] = 2
    else:  # contiguous sections (Qwen2-VL): [t]*s0 + [h]*s1 + [w]*s2
        axis[sec[0]:sec[0] + sec[1]] = 1
        axis[sec[0] + sec[1]:sec[0] + sec[1] + sec[2]] = 2
    return axis


def apply_mrope(x: mx.array, positions: mx.array, rope: nn.Module, spec: VisionSpec) -> mx.array:
    """Rotate the first rope.dims features of x [B, heads, T, head_dim] by M-RoPE at
    `positions` [3, T] or [B, 3, T]; with three equal rows this is rope(x, offset)."""
    dims = rope.dims
    half = dims // 2
    inv = _inv_freq(rope)
    pos = positions if positions.ndim == 3 else positions[None]              # [B|1, 3, T]
    axis = mx.array(axis_of_frequency(half, spec))
    sel = mx.take(pos.astype(mx.float32), axis, axis=1)                      # [B|1, half, T]
    scale = float(getattr(rope, "scale", 1.0))
    theta = (sel.transpose(0, 2, 1) * scale) * inv                           # [B|1, T, half]
    cos = mx.cos(theta)[:, None].astype(x.dtype)                             # [B|1, 1, T, half]
    sin = mx.sin(theta)[:, None].astype(x.dtype)
    rot, rest = x[..., :dims], x[..., dims:]
    if getattr(rope, "traditional", False):  # pairs (2i, 2i+1)
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = mx.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(rot.shape)
    else:                                     # pairs (i, i + dims/2)
        a, b = rot[..., :half], rot[..., half:]
        out = mx.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    return mx.concatenate([out, rest], axis=-1) if rest.shape[-1] else out

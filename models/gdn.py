"""GatedDeltaNet forward with per-position state capture and a fast prefill.

mlx-lm's GatedDeltaNet (Qwen3.5 and Qwen3-Next variants) is reused for its
parameters and projections; only the forward is replaced (by swapping the
instance's class after the model is built, so weights and names stay
mlx-lm's). The forward does the same operations as mlx-lm's, in the same
order, so plain decoding stays bit-identical to mlx-lm, and adds:

* capture: when the cache is a capturing `SpeculativeGDNCache`, a verify window
  records the whole conv input and what gives the state after every position
  (on mtp-serve's native kernel where it is built, the last state and the window's
  inputs, to step an earlier one again: `ReplayStates`; else every state from
  mlx-lm's step op), so it can be rolled back to any accepted length. Either way a
  window steps token by token as plain decoding does, so each position gets a single
  step's bits (a one-chunk WY form was exact only to fp32 rounding, and on MLX's
  CUDA backend made greedy MTP leave plain decoding's tokens);
* chunked prefill: on backends without the Metal kernel, long inputs go
  through the chunked gated delta rule instead of a Python loop over tokens.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from mtp_serve import quantized_matmul
from mtp_serve.backend import SMALL_MATMUL_ROWS

from . import activations, fast_math
from .caches import SpeculativeGDNCache
from .gated_delta_chunked import gated_delta_chunked
from .mlx_lm_compat import (
    Qwen35GatedDeltaNetBase,
    Qwen3NextGatedDeltaNetBase,
    Qwen3NextRMSNormGated,
    compute_g,
    gated_delta_step_ops,
    gated_delta_update,
)
from .quantized_layers import project

# Inputs at least this long take the chunked path where no Metal kernel runs: its
# operation count does not grow with the length, the per-token loop's does (a
# 63-token demo-model prefill measured 48-59 ms chunked against 105-126 ms looped).
CHUNKED_PREFILL_MIN_TOKENS = 8


# Decode steps and verify windows (at most this many tokens a row) compute the depthwise
# conv as shifted multiply-adds, elementwise, so on every device a row's bits never depend
# on the window's length or the batch (on a GPU, MLX's conv was not checked to keep them).
# On CPU, at these sizes MLX's conv kernel sums the K taps in the same order (the bits are
# mlx-lm's, checked up to 8 rows of 8 tokens), but past ~64 rows of input it changes
# algorithm and rounds differently (16 rows of 5 tokens already): a batched verify window
# would then differ from the batch's plain steps by ~1e-7, which int8 numerics turn into
# token changes. Every verify window takes it (copy drafts make windows of up to 64 tokens):
# past 8 tokens MLX's conv and its SiLU, whose exp runs one element at a time on x86, took
# about a tenth of a 32-token fp32 window at 0.8B shapes (profiled).
DECODE_CONV_MAX_TOKENS = SMALL_MATMUL_ROWS


def _metal_kernel_available(head_k_dim: int) -> bool:
    return (
        mx.default_device() == mx.gpu
        and mx.metal.is_available()
        and head_k_dim >= 32
        and head_k_dim % 32 == 0
    )


class StackedStates:
    """Every position's state, materialized (the per-token windows' record on mlx-lm's step op):
    one array per position, not stacked, so a single-sequence commit keeps one of them without a
    copy."""

    def __init__(self, states: list):
        self.states = list(states)  # T arrays [B, Hv, Dv, Dk]

    @property
    def length(self) -> int:
        return len(self.states)

    @property
    def arrays(self) -> list:
        return self.states

    @classmethod
    def rebuild(cls, start: mx.array, arrays: list) -> "StackedStates":
        return cls(arrays)

    def after(self, n) -> mx.array:
        """The state after n positions: an int, or one per row (an int array [B] or list). Per row,
        each row's state is sliced from its position's array (a stack and MLX's CPU gather made a
        commit of 4 demo rows 5.4 ms, slices 0.9 ms; `python bench/bench_round.py --batch 4`)."""
        if isinstance(n, int):
            return self.states[n - 1]
        rows = n.tolist() if isinstance(n, mx.array) else list(n)
        if len(set(rows)) == 1:
            return self.states[rows[0] - 1]
        return mx.concatenate([self.states[r - 1][i : i + 1] for i, r in enumerate(rows)], axis=0)


class ReplayStates:
    """A native verify window's record: its last state, and what steps any earlier one again.

    The window writes one state a layer, not one a position. A commit that keeps n < T
    positions steps those n tokens again from the window's starting state on the same kernel,
    which gives the bits the window computed for them (the kernel's chain per state row does
    not depend on T, the batch or the threads); a commit that keeps them all takes the last
    state. 0.8B-shaped 4-bit windows of 4 tokens one after another (`bench_quantized.py
    --window-commit`): keeping all 4, 53.3-56.1 ms against 58.6-59.9 with every state written;
    keeping 1-3, 54.8-59.7 against 57.2-60.3.
    """

    def __init__(self, start: mx.array, final: mx.array, inputs: list, mask: Optional[mx.array] = None):
        self.start = start  # [B, Hv, Dv, Dk], the state before the window
        self.final = final  # the state after all T positions
        self.inputs = list(inputs)  # q, k, v, g, beta in float32, as the window's kernel took them
        self.mask = mask  # [B, T] bool or None

    @property
    def length(self) -> int:
        return self.inputs[0].shape[1]

    @property
    def arrays(self) -> list:
        return [self.final, *self.inputs] + ([] if self.mask is None else [self.mask])

    @classmethod
    def rebuild(cls, start: mx.array, arrays: list) -> "ReplayStates":
        return cls(start, arrays[0], arrays[1:6], arrays[6] if len(arrays) > 6 else None)

    def after(self, n) -> mx.array:
        """The state after n positions: an int, or one per row (an int array [B] or list). Rows that
        keep fewer positions than the longest are masked past their count (a masked position leaves
        the state as it was), so one replay serves the batch."""
        if not isinstance(n, int):
            rows = n.tolist() if isinstance(n, mx.array) else list(n)
            if len(set(rows)) > 1:
                top = max(rows)
                keep = mx.arange(top)[None] < mx.array(rows)[:, None]
                return self._replay(top, keep if self.mask is None else keep & self.mask[:, :top])
            n = rows[0]
        if n == self.length:
            return self.final
        return self._replay(n, None if self.mask is None else self.mask[:, :n])

    def _replay(self, n: int, mask: Optional[mx.array]) -> mx.array:
        ext = quantized_matmul.load()
        return ext.gated_delta_steps(*(a[:, :n] for a in self.inputs), self.start, mask, False)[1]


# Decode steps and verify windows run the recurrence on mtp-serve's native CPU kernel when
# it is built (False: mlx-lm's ops; benchmarks compare).
NATIVE = True

# Native verify windows write their last state and replay a shorter commit (`ReplayStates`);
# False: they write every position's state (benchmarks compare). Read when a step is traced.
REPLAY = True


def native_recurrence() -> Optional[Any]:
    """The native kernel's module when decode recurrences run on it here, else None. Its bits are
    mlx-lm's step op's (`gated_delta.cpp`), 4x (one token) to 9x (a 4-token window) cheaper."""
    if not NATIVE or mx.default_device() != mx.cpu:
        return None
    ext = quantized_matmul.load()
    return ext if ext is not None and hasattr(ext, "gated_delta_steps") else None


def _native_steps(ext: Any, q, k, v, g, beta, state, mask, capture: bool):
    """mlx-lm's `gated_delta_ops` on the native kernel: (y, the last state, or with `capture` the
    window's `ReplayStates`), or None where it does not take the inputs (per-dimension gating,
    head dims not multiples of 8, a state not in float32, a mask other than [B, T] booleans)."""
    B, T = q.shape[:2]
    if g.ndim != 3 or q.shape[-1] % 8 or v.shape[-1] % 8 or state.dtype != mx.float32:
        return None
    if mask is not None and (mask.dtype != mx.bool_ or tuple(mask.shape) != (B, T)):
        return None
    f32 = [a.astype(mx.float32) for a in (q, k, v, g, beta)]  # exact: MLX promotes to fp32 the same way
    if capture and not REPLAY:
        y, *states = ext.gated_delta_steps(*f32, state, mask, True)
        return y.astype(q.dtype), StackedStates(states)
    y, last = ext.gated_delta_steps(*f32, state, mask, False)
    return y.astype(q.dtype), (ReplayStates(state, last, f32, mask) if capture else last)


def gated_delta_steps(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    mask: Optional[mx.array],
) -> Tuple[mx.array, StackedStates]:
    """Per-token recurrence that also keeps the state after each position.

    Uses mlx-lm's own step op, so each position is computed exactly as a
    one-token decode step computes it: the windows' form where the native
    kernel does not run (a GPU, a CPU without it). Returns y [B,T,Hv,Dv].
    """
    Hk, Hv = q.shape[-2], v.shape[-2]
    if Hv // Hk > 1:
        q = mx.repeat(q, Hv // Hk, -2)
        k = mx.repeat(k, Hv // Hk, -2)
    ys, states = [], []
    for t in range(q.shape[1]):
        y, state = gated_delta_step_ops(
            q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state,
            None if mask is None else mask[:, t],
        )
        ys.append(y)
        states.append(state)
    return mx.stack(ys, axis=1), StackedStates(states)


class CapturingGatedDeltaNetMixin:
    """Forward shared by both GatedDeltaNet variants; subclasses give `project`."""

    def project(self, x: mx.array) -> Tuple[mx.array, mx.array, mx.array, mx.array]:
        raise NotImplementedError

    def mix(
        self,
        inputs: mx.array,
        conv_state: Optional[mx.array],
        state: Optional[mx.array],
        mask: Optional[mx.array] = None,
        capture: bool = False,
        cpu_prefill: bool = False,
    ) -> Tuple[mx.array, mx.array, Any]:
        """The layer as a function of its input and recurrent state (no cache
        object, so it can be `mx.compile`d). Returns (output, the conv input
        [B, kernel-1+S, C], the new state) or, with `capture`, the window's
        per-position states (`ReplayStates` / `StackedStates`) instead of the state.
        `cpu_prefill` computes a chunked prefill's conv and activations with
        `fast_math` (same values to fp32 rounding, several times faster on CPU).
        """
        B, S, _ = inputs.shape
        chunked = not capture and S >= CHUNKED_PREFILL_MIN_TOKENS and not _metal_kernel_available(self.head_k_dim)
        fast = cpu_prefill and chunked
        qkv, z, b, a = self.project(inputs)
        if conv_state is None:
            conv_state = mx.zeros((B, self.conv_kernel_size - 1, self.conv_dim), dtype=inputs.dtype)
        if mask is not None:
            qkv = mx.where(mask[..., None], qkv, 0)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        if fast:
            conv_out = fast_math.silu(activations.depthwise_conv(conv_input, self.conv1d.weight))
        elif S <= DECODE_CONV_MAX_TOKENS:
            conv_out = activations.depthwise_conv_silu(conv_input, self.conv1d.weight)
        else:
            conv_out = nn.silu(self.conv1d(conv_input))
        q, k, v = [
            t.reshape(B, S, h, d)
            for t, h, d in zip(
                mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
                [self.num_k_heads, self.num_k_heads, self.num_v_heads],
                [self.head_k_dim, self.head_k_dim, self.head_v_dim],
            )
        ]
        q, k = activations.normalize_qk(q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)

        native = None if chunked else native_recurrence()
        if capture or chunked or native is not None:  # (gated_delta_update computes them itself)
            g, beta = compute_g(self.A_log, a, self.dt_bias), mx.sigmoid(b)
        if state is None and (capture or native is not None):
            state = mx.zeros((B, self.num_v_heads, self.head_v_dim, self.head_k_dim), mx.float32)
        stepped = None if native is None else _native_steps(native, q, k, v, g, beta, state, mask, capture)
        if stepped is not None:
            out, state = stepped
        elif capture:
            out, state = gated_delta_steps(q, k, v, g, beta, state, mask)
        elif chunked:
            out, state = gated_delta_chunked(q, k, v, g, beta, state, mask)
        else:
            out, state = gated_delta_update(
                q, k, v, a, b, self.A_log, self.dt_bias, state, mask,
                use_kernel=not self.training,
            )
        if fast and type(self.norm) is Qwen3NextRMSNormGated:
            out = fast_math.swiglu(z, mx.fast.rms_norm(out, self.norm.weight, self.norm.eps))
        else:
            out = self.norm(out, z)
        out = self.out_proj(out.reshape(B, S, -1))
        if getattr(self, "sharding_group", None) is not None:  # tensor parallel: sum the ranks' heads
            out = mx.distributed.all_sum(out, group=self.sharding_group)
        return out, conv_input, state

    def __call__(
        self,
        inputs: mx.array,
        mask: Optional[mx.array] = None,
        cache: Optional[Any] = None,
        cpu_prefill: bool = False,
    ) -> mx.array:
        capture = isinstance(cache, SpeculativeGDNCache) and cache.capturing
        conv_state, state = (cache[0], cache[1]) if cache is not None else (None, None)
        out, conv_input, state = self.mix(inputs, conv_state, state, mask, capture, cpu_prefill)
        if cache is not None:
            store_step(cache, conv_input, state, inputs.shape[1], capture)
        return out


def store_step(cache: Any, conv_input: mx.array, state: Any, S: int, capture: bool) -> None:
    """Write a GatedDeltaNet step's results into its cache (a capture records its window)."""
    n_keep = conv_input.shape[1] - S
    if cache.lengths is not None:
        ends = mx.clip(cache.lengths, 0, S)
        positions = (ends[:, None] + mx.arange(n_keep))[..., None]
        cache[0] = mx.take_along_axis(conv_input, positions, axis=1)
    else:
        cache[0] = mx.contiguous(conv_input[:, -n_keep:, :])
    if capture:
        cache.record(conv_input, state)
        state = state.after(S)  # lazy: replaced by the commit's choice, never computed
    cache[1] = state
    cache.advance(S)


class Qwen35GatedDeltaNet(CapturingGatedDeltaNetMixin, Qwen35GatedDeltaNetBase):
    def project(self, x):
        B, S, _ = x.shape
        qkv, z, b, a = project(x, [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])
        return qkv, z.reshape(B, S, self.num_v_heads, self.head_v_dim), b, a


class Qwen3NextGatedDeltaNet(CapturingGatedDeltaNetMixin, Qwen3NextGatedDeltaNetBase):
    def project(self, x):
        B, S, _ = x.shape
        q, k, v, z, b, a = self.fix_query_key_value_ordering(*project(x, [self.in_proj_qkvz, self.in_proj_ba]))
        qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
        return qkv, z, b, a


_REPLACEMENTS = {
    Qwen35GatedDeltaNetBase: Qwen35GatedDeltaNet,
    Qwen3NextGatedDeltaNetBase: Qwen3NextGatedDeltaNet,
}


def install_capturing_gdn(layers) -> int:
    """Swap every GatedDeltaNet in `layers` to the capturing forward; returns the count."""
    n = 0
    for layer in layers:
        gdn = getattr(layer, "linear_attn", None)
        if gdn is not None and type(gdn) in _REPLACEMENTS:
            gdn.__class__ = _REPLACEMENTS[type(gdn)]
            n += 1
    return n

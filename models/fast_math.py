"""exp, sigmoid and SiLU from fusable MLX operations, for long inputs on CPU.

On x86 Linux the `mlx[cpu]` wheel has no SIMD types, so `mx.exp` (and with it
softmax, sigmoid, SiLU) evaluates its polynomial one element at a time through
library calls for `fma` and `floor`: ~13 ns an element, 17 ns for SiLU
(measured). A long prefill computes hundreds of millions of them (8,192 tokens
on the demo model: ~130M exps per attention layer, 57M sigmoids in the MLPs).
The same Cephes polynomial from plain multiply-adds, in loops `mx.compile`
fuses and the compiler vectorizes, runs at ~2 ns an element:

    exp(x) = 2^r * p(f),  x log2(e) = r + f,  r integer, |f| <= 1/2

r comes from the round-to-nearest trick (t + 1.5*2^23) - 1.5*2^23, 2^r from an
integer shift, p is MLX's own polynomial for 2^f (values agree with `mx.exp`
to ~1 ulp; differences come from rounding without fma). Only arguments <= 0
are needed (softmax after its max, sigmoid via exp(-|x|)): below -43 (2^-62)
the result saturates at 2^-62 instead of going to zero, an absolute error
under 2.2e-19, far below what fp32 sums of these values resolve, and no
denormal ever comes out (denormal arithmetic is ~100x slower on x86).

GPU backends have fast transcendental kernels and never call these.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

_LOG2E = 1.4426950408889634
_ROUND = 12582912.0  # 1.5 * 2**23: (t + _ROUND) - _ROUND rounds t to an integer
_MIN_EXP2 = 62  # 2^-62 is the smallest value produced (int64 shift range)
# MLX's (Cephes') polynomial for 2^f on [-1/2, 1/2], lowest degree first.
_C0, _C1, _C2, _C3, _C4, _C5, _C6 = (
    1.0,
    6.931472028550421e-1,
    2.402264791363012e-1,
    5.550332471162809e-2,
    9.618437357674640e-3,
    1.339887440266574e-3,
    1.535336188319500e-4,
)


def _split(x: mx.array):
    """(f, r) with x log2(e) = r + f, r an integer in [-62, 0], |f| <= 1/2, for x <= 0."""
    t = mx.maximum(x * _LOG2E, -float(_MIN_EXP2))
    r = (t + _ROUND) - _ROUND  # nearest integer, without a floor() library call
    return t - r, r


def _poly(f: mx.array) -> mx.array:
    """2^f, Estrin's scheme: 5 operations deep instead of Horner's 12, so one
    fused loop holds it (MLX fuses at most 11 levels)."""
    f2 = f * f
    return (_C0 + _C1 * f) + f2 * (_C2 + _C3 * f) + (f2 * f2) * ((_C4 + _C5 * f) + _C6 * f2)


def _exp_nonpositive(x: mx.array) -> mx.array:
    """exp(x) for x <= 0 in one shapeless-compilable graph (2^r from an int64 shift)."""
    f, r = _split(x)
    two_r = mx.left_shift(mx.array(1, mx.int64), (r + _MIN_EXP2).astype(mx.int64)).astype(mx.float32)
    return _poly(f) * two_r * (2.0**-_MIN_EXP2)


class _ExpFunction:
    """y = finish(exp(arg(*xs)), *xs) with arg(*xs) <= 0, compiled two ways.

    `fixed` is the fast form, compiled per input shape (callers keep the set of
    shapes small): a first loop computes f and the float bits of 2^r (an int32
    shift the compiler vectorizes), `mx.view` turns the bits into floats, a second
    loop does the polynomial and `finish`. Splitting it there ourselves keeps
    each part within what MLX fuses into one loop (measured: SiLU 7.6 ns an
    element when MLX chose the split, 2.0 ns this way). `mx.view` has no
    shapeless form, so `anyshape` computes 2^r with an int64 shift instead.
    """

    def __init__(self, arg: Callable, finish: Callable):
        def bits(*xs):
            f, r = _split(arg(*xs))
            return f, mx.left_shift(r.astype(mx.int32) + 127, 23)

        self._bits = mx.compile(bits)
        self._finish = mx.compile(lambda f, two_r, *xs: finish(_poly(f) * two_r, *xs))
        self.anyshape = mx.compile(lambda *xs: finish(_exp_nonpositive(arg(*xs)), *xs), shapeless=True)

    def fixed(self, *xs: mx.array) -> mx.array:
        f, bits = self._bits(*xs)
        return self._finish(f, bits.view(mx.float32), *xs)

    def by_rows(self, *xs: mx.array) -> mx.array:
        """For same-shape inputs [..., C]: the leading rows, a multiple of ROW_STEP,
        through `fixed` (at most max_rows / ROW_STEP shapes per C), the rest through `anyshape`."""
        shape = xs[0].shape
        flat = [x.reshape(-1, shape[-1]) for x in xs]
        n = flat[0].shape[0]
        n0 = n - n % ROW_STEP
        if n0 == n:
            return self.fixed(*flat).reshape(shape)
        if n0 == 0:
            return self.anyshape(*flat).reshape(shape)
        head = self.fixed(*(x[:n0] for x in flat))
        return mx.concatenate([head, self.anyshape(*(x[n0:] for x in flat))]).reshape(shape)


ROW_STEP = 64


def _negative_abs(x: mx.array, *_) -> mx.array:
    return -mx.abs(x)


def _sigmoid_from(e: mx.array, x: mx.array) -> mx.array:
    """sigmoid(x) given e = exp(-|x|)."""
    return mx.where(x >= 0, 1.0, e) / (1.0 + e)


# exp(s - m) for m >= s (m broadcast against s, e.g. a row max)
exp_shifted = _ExpFunction(lambda s, m: s - m, lambda e, s, m: e)
_sigmoid = _ExpFunction(_negative_abs, _sigmoid_from)
_silu = _ExpFunction(_negative_abs, lambda e, x: x * _sigmoid_from(e, x))
_swiglu = _ExpFunction(_negative_abs, lambda e, gate, x: gate * _sigmoid_from(e, gate) * x)


def sigmoid(x: mx.array) -> mx.array:
    return _sigmoid.by_rows(x)


def silu(x: mx.array) -> mx.array:
    return _silu.by_rows(x)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x, as mlx-lm's MLPs combine their two projections."""
    return _swiglu.by_rows(gate, x)

"""mtp-serve's decode-sized quantized matmul (mtp_serve/quantized_matmul.py, native/quantized_matmul.cpp).

Tolerances:
- exact numerics against MLX's `quantized_matmul` / `gather_qmm`: both compute the
  same dequantized product in fp32 with different summation orders (the kernel sums
  q * x per chunk and scales per chunk, then adds bias * sum(x)), so they agree to
  a few fp32 ulps of the row's magnitude: max |ours - mlx| <= 2e-5 * max |mlx|.
- int8 numerics against a numpy float64 reference of the same scheme (x rounded
  per quantization group of W (the group form, the default; the block form: per 32
  values) to d * int8 exactly as the kernel does, integer sums, then
  s * d * sum(q * xq) + bias * sum(d * xq)): only the float summation order
  differs, max error <= 1e-5 * max |ref|. Against MLX's exact product the int8
  rounding of x shows: <= 2e-2 * max |mlx| on N(0, 1) inputs.
Across row counts the kernel gives each row the same bits in both numerics
(asserted exactly).
"""

import os
import subprocess
import sys
from contextlib import contextmanager

import numpy as np

import mlx.core as mx
import mlx.nn as nn
import pytest

from mtp_serve import BACKEND, skinny_gemm
from mtp_serve import quantized_matmul as qmm_ext
from mtp_serve.models.quantized_layers import (
    DecodeQuantizedEmbedding,
    DecodeQuantizedLinear,
    DecodeQuantizedSwitchLinear,
    install_decode_qmm,
    project,
)
from mtp_serve.testing.quantized import QUANT_TEXT, quantize_loaded, quantize_mlx_lm_model
from mtp_serve.testing.synthetic import FAMILIES
from support.greedy import batched_greedy, greedy
from support.native import needs_qmm_kernel

REL_TOL = 2e-5
INT8_REF_TOL = 1e-5  # int8 numerics against the numpy reference of the same scheme
INT8_MLX_TOL = 2e-2  # int8 numerics against MLX's exact product (x's int8 rounding)

needs_kernel = needs_qmm_kernel()


@contextmanager
def numerics(mode):
    before = qmm_ext._numerics
    qmm_ext.set_numerics(mode)
    try:
        yield
    finally:
        qmm_ext.set_numerics(before)


@pytest.fixture
def exact():
    with numerics("exact"):
        yield


@contextmanager
def kernel_setting(name, value):
    """The extension's setting `name` (its `name()` / `set_name(v)` pair) at `value` for the block."""
    ext = qmm_ext.load()
    before = getattr(ext, name)()
    getattr(ext, "set_" + name)(value)
    try:
        yield
    finally:
        getattr(ext, "set_" + name)(before)


def x_block(values):
    """The group form's values of x per int8 scale (32, or 0: W's group size)."""
    return kernel_setting("x_block", values)


def int8_form(group):
    """int8 numerics on the group form (True) or the earlier block form (False)."""
    return kernel_setting("int8_group", group)


@contextmanager
def group_mutation():
    """The group form mutated to add a window's bias term before its scaled sums (rows of several-row
    blocks only): a negative control the row checks must catch."""
    ext = qmm_ext.load()
    ext.set_group_mutation(True)
    try:
        yield
    finally:
        ext.set_group_mutation(False)


def rows_differing(alone, windows) -> list:
    """The window sizes M whose rows are not bit for bit the first M rows computed alone."""
    return [M for M, together in windows if not mx.array_equal(together, alone[:M]).item()]


def int8_reference(x, w, s, b, gs, bits):
    """The int8 scheme in numpy, float64 after the integer sums: x [M, K] -> [M, N]. x is rounded per
    block of 32 values (the group form's default and the block form), or of `gs` (the group form with
    set_x_block(0))."""
    x = np.array(x.astype(mx.float32), dtype=np.float32)
    M, K = x.shape
    ext = qmm_ext.load()
    blk = (min(ext.x_block(), gs) if ext.x_block() > 0 else gs) if ext.int8_group() else 32
    q = np.array(mx.dequantize(w, mx.ones(s.shape), mx.zeros(b.shape), group_size=gs, bits=bits)).astype(np.int64)
    blocks = x.reshape(M, K // blk, blk)
    amax = np.abs(blocks).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    xq = np.rint(blocks * inv).astype(np.int64)  # float32 product, round half to even: as the kernel
    d = (amax / np.float32(127))[..., 0].astype(np.float64)
    isum = np.einsum("mbk,nbk->mnb", xq, q.reshape(-1, K // blk, blk)).astype(np.float64)
    scale = np.repeat(np.array(s.astype(mx.float32), dtype=np.float64), gs // blk, axis=1)
    xsum = (xq.sum(-1) * d).reshape(M, K // gs, gs // blk).sum(-1)  # sums of the rounded x
    return np.einsum("mnb,nb,mb->mn", isum, scale, d) + xsum @ np.array(b.astype(mx.float32), dtype=np.float64).T


def _close_int8(ours, x, w, s, b, gs, bits):
    ref = int8_reference(x.reshape(-1, x.shape[-1]), w, s, b, gs, bits)
    err = np.abs(np.array(ours.reshape(ref.shape), dtype=np.float64) - ref).max()
    assert err <= INT8_REF_TOL * np.abs(ref).max(), f"max error {err:.3g} vs max |ref| {np.abs(ref).max():.3g}"


def _quantized(N, K, bits, gs, dtype, seed=0, experts=None):
    key = mx.random.key(seed)
    shape = (N, K) if experts is None else (experts, N, K)
    w, s, b = mx.quantize(0.05 * mx.random.normal(shape, key=key), group_size=gs, bits=bits)
    return w, s.astype(dtype), b.astype(dtype)


def _close(ours, ref):
    err = mx.abs(ours - ref).max().item()
    assert err <= REL_TOL * mx.abs(ref).max().item(), f"max error {err:.3g} vs max |ref| {mx.abs(ref).max().item():.3g}"


@needs_kernel
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_kernel_matches_mlx(bits, gs, exact):
    mx.random.seed(bits * gs)
    for i, dtype in enumerate((mx.float32, mx.bfloat16, mx.float16)):
        N, K = [(72, 256), (133, 512), (40, 384)][i]
        K = max(K, 8 * 32 // bits)
        w, s, b = _quantized(N, K, bits, gs, dtype, seed=i)
        for M in (1, 3, 8, 11):
            x = mx.random.normal((M, K))
            ref = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=gs, bits=bits)
            _close(qmm_ext.qmm(x, w, s, b, gs, bits), ref)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("form", ["group", "group-x-per-group", "block"])
def test_int8_numerics_match_their_reference(bits, gs, form):
    mx.random.seed(7 * bits + gs)
    worst = 0.0
    with numerics("int8"), int8_form(form != "block"), x_block(0 if form == "group-x-per-group" else 32):
        for i, dtype in enumerate((mx.float32, mx.bfloat16, mx.float16)):
            N, K = [(72, 256), (133, 512), (40, 384)][i]
            w, s, b = _quantized(N, K, bits, gs, dtype, seed=i)
            for M in (1, 3, 8, 11):
                x = mx.random.normal((M, K))
                ours = qmm_ext.qmm(x, w, s, b, gs, bits)
                _close_int8(ours, x, w, s, b, gs, bits)
                ref = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=gs, bits=bits)
                err = (mx.abs(ours - ref).max() / mx.abs(ref).max()).item()
                assert err <= INT8_MLX_TOL, f"int8 against MLX's product: {err:.3g} of max |ref|"
                worst = max(worst, err)
    print(f"{bits}-bit gs {gs}: int8 numerics within {worst:.2g} of max |MLX's product|")


@needs_kernel
def test_int8_two_bits_stay_exact():
    w, s, b = _quantized(64, 256, 2, 64, mx.float32)
    x = mx.random.normal((3, 256))
    with numerics("int8"):
        ours = qmm_ext.qmm(x, w, s, b, 64, 2)
    _close(ours, mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=2))


@needs_kernel
def test_x_dtypes_and_batch_shapes(exact):
    w, s, b = _quantized(64, 256, 4, 64, mx.float32)
    for dtype in (mx.bfloat16, mx.float16):
        x = mx.random.normal((2, 3, 256)).astype(dtype)
        y = qmm_ext.qmm(x, w, s, b, 64, 4)
        assert y.dtype == dtype and y.shape == (2, 3, 64)
        ref = mx.quantized_matmul(x.astype(mx.float32), w, s, b, transpose=True, group_size=64, bits=4)
        assert mx.allclose(y.astype(mx.float32), ref, atol=3e-2 * mx.abs(ref).max().item()).item()


@needs_kernel
@pytest.mark.parametrize("mode", ["exact", "int8"])
@pytest.mark.parametrize("bits,gs,dtype", [(4, 64, mx.float32), (8, 32, mx.bfloat16)])
def test_several_products_of_one_x_in_one_call(bits, gs, dtype, mode):
    """A GatedDeltaNet's input projections (or q/k/v, gate/up) in one call: each result has the
    bits of its own product, for 1-8 rows; project() falls back to the layers one by one where
    they differ, and a bad weight is refused."""
    ws = [_quantized(N, 256, bits, gs, dtype, seed=N) for N in (96, 32, 8, 8)]
    with numerics(mode):
        for M in (1, 4, 8):
            x = mx.random.normal((1, M, 256))
            for ours, (w, s, b) in zip(qmm_ext.qmm_multi(x, ws, gs, bits), ws):
                assert ours.shape == (1, M, w.shape[0])
                assert np.array_equal(np.asarray(ours), np.asarray(qmm_ext.qmm(x, w, s, b, gs, bits)))
        layers = []
        for (w, s, b) in ws:
            lin = DecodeQuantizedLinear(256, w.shape[0], bias=False, group_size=gs, bits=bits)
            lin.weight, lin.scales, lin.biases = w, s, b
            layers.append(lin)
        x = mx.random.normal((2, 3, 256))
        separate = [lin(x) for lin in layers]
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(project(x, layers), separate))
        other = nn.Linear(256, 8)
        mixed = project(x, layers[:2] + [other])
        assert np.array_equal(np.asarray(mixed[2]), np.asarray(other(x)))
        with pytest.raises(ValueError):
            qmm_ext.qmm_multi(x, [ws[0], (ws[1][0][:, :16], ws[1][1], ws[1][2])], gs, bits)


@needs_kernel
@pytest.mark.parametrize("mode", ["exact", "int8"])
def test_strided_inputs_read_as_their_contiguous_copies(mode):
    """The primitives take inputs as they come (no contiguous copy in the graph): a transposed,
    sliced or broadcast x, and sliced weights, give the bits of their contiguous copies."""
    w, s, b = _quantized(96, 256, 4, 64, mx.float32)
    x = mx.random.normal((256, 6))
    with numerics(mode):
        for strided, ws in [(x.T, (w, s, b)), (x.T[1::2], (w, s, b)), (mx.broadcast_to(x.T[:1], (3, 256)), (w, s, b)),
                            (x.T, tuple(a[::2] for a in (w, s, b)))]:
            ours = qmm_ext.qmm(strided, *ws, 64, 4)
            ref = qmm_ext.qmm(mx.contiguous(strided), *(mx.contiguous(a) for a in ws), 64, 4)
            assert np.array_equal(np.asarray(ours), np.asarray(ref))


@needs_kernel
@pytest.mark.parametrize("mode", ["exact", "int8"])
@pytest.mark.parametrize("bits,gs,dtype", [(4, 32, mx.float32), (4, 64, mx.bfloat16), (8, 128, mx.float16),
                                           (8, 32, mx.float32), (2, 64, mx.float32)])
def test_rows_bit_identical_across_row_counts(bits, gs, dtype, mode):
    w, s, b = _quantized(96, 512, bits, gs, dtype, seed=3)
    x = mx.random.normal((64, 512), key=mx.random.key(4))
    with numerics(mode):
        alone = mx.concatenate([qmm_ext.qmm(x[i:i + 1], w, s, b, gs, bits) for i in range(x.shape[0])])
        for M in list(range(1, 9)) + [13, 64]:
            together = qmm_ext.qmm(x[:M], w, s, b, gs, bits)
            assert mx.array_equal(together, alone[:M]).item(), f"M={M}"


@needs_kernel
@pytest.mark.skipif(qmm_ext.load() is None or not qmm_ext.load().vnni_supported(), reason="no AVX-512 VNNI/VBMI here")
@pytest.mark.parametrize("bits", [4, 8])
def test_vnni_and_avx2_forms_give_the_same_bits(bits):
    """int8 numerics on AVX-512 VNNI (vpdpbusd) and on AVX2 (maddubs/madd) sum the same products into
    the same lanes: the same bits for every group size, scale dtype and row count, dense and
    gathered, so a model's output does not depend on which of the two a CPU runs."""
    ext = qmm_ext.load()
    before = ext.vnni()

    def both(product):
        out = []
        for on in (False, True):
            ext.set_vnni(on)
            assert ext.vnni() == on
            out.append(product())
            mx.eval(out[-1])
        return out

    try:
        with numerics("int8"):
            for gs in (32, 64, 128):
                for i, dtype in enumerate((mx.float32, mx.bfloat16, mx.float16)):
                    w, s, b = _quantized(72 + 8 * i, 512, bits, gs, dtype, seed=gs + i)
                    for M in (1, 3, 4, 5, 8, 13):
                        x = mx.random.normal((M, 512), key=mx.random.key(M)) * 3
                        avx2, vnni = both(lambda: qmm_ext.qmm(x, w, s, b, gs, bits))
                        assert mx.array_equal(avx2, vnni).item(), f"gs {gs} {dtype} M={M}"
            E, N, K = 4, 48, 256
            w, s, b = _quantized(N, K, bits, 64, mx.bfloat16, seed=9, experts=E)
            xs, ids = mx.random.normal((6, 2, K)), mx.array([0, 1, 1, 3, 3, 3], dtype=mx.uint32)
            avx2, vnni = both(lambda: qmm_ext.gather_qmm(xs, w, s, b, ids, 64, bits))
            assert mx.array_equal(avx2, vnni).item()
    finally:
        ext.set_vnni(before)


def pair_rows(rows):
    """Products of at least `rows` rows on the AVX-512 pair form (0: never)."""
    return kernel_setting("pair_rows", rows)


@needs_kernel
@pytest.mark.skipif(qmm_ext.load() is None or not qmm_ext.load().vnni_supported(), reason="no AVX-512 VNNI/VBMI here")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_windows_of_up_to_64_rows_keep_each_rows_bits_on_the_pair_form(bits, gs):
    """int8 numerics on the block form, verify windows of 1-64 rows on the pair form (two rows a 512-bit
    register, W unpacked once for 8 rows): every row equals, bit for bit, the row alone and the 256-bit
    form's result, for every scale dtype, dense and gathered."""
    with numerics("int8"), int8_form(False):
        for i, dtype in enumerate((mx.float32, mx.bfloat16, mx.float16)):
            w, s, b = _quantized(37 + 8 * i, 512, bits, gs, dtype, seed=gs + i)
            x = mx.random.normal((64, 512), key=mx.random.key(i)) * 3
            with pair_rows(0):
                alone = mx.concatenate([qmm_ext.qmm(x[m:m + 1], w, s, b, gs, bits) for m in range(64)])
                wide = qmm_ext.qmm(x, w, s, b, gs, bits)
                mx.eval(alone, wide)
            assert mx.array_equal(wide, alone).item()
            with pair_rows(2):
                for M in range(1, 65):
                    together = qmm_ext.qmm(x[:M], w, s, b, gs, bits)
                    assert mx.array_equal(together, alone[:M]).item(), f"{dtype} M={M}"
        E, N, K = 4, 48, 256  # gathered: 40 (token, expert) rows, 2-17 an expert
        w, s, b = _quantized(N, K, bits, gs, mx.bfloat16, seed=9, experts=E)
        xs = mx.random.normal((20, 2, K))
        ids = mx.array([0, 1, 1, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 0, 3, 3, 3, 3, 1], dtype=mx.uint32)
        with pair_rows(0):
            ref = qmm_ext.gather_qmm(xs, w, s, b, ids, gs, bits)
            mx.eval(ref)
        with pair_rows(2):
            assert mx.array_equal(qmm_ext.gather_qmm(xs, w, s, b, ids, gs, bits), ref).item()


def _group_form_windows(bits, gs, dtype, seed):
    """(rows alone, [(M, window of M rows)] for M = 1..64) on the group form: W of 37 rows (two blocks of
    16 and a partial one) and K = 1536 (a full panel of 1024 and a partial one)."""
    w, s, b = _quantized(37, 1536, bits, gs, dtype, seed=seed)
    x = mx.random.normal((64, 1536), key=mx.random.key(seed)) * 3
    alone = mx.concatenate([qmm_ext.qmm(x[m:m + 1], w, s, b, gs, bits) for m in range(64)])
    mx.eval(alone)
    return alone, [(M, qmm_ext.qmm(x[:M], w, s, b, gs, bits)) for M in range(1, 65)]


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("vnni", [True, False], ids=["avx512-vnni", "avx2"])
@pytest.mark.parametrize("xblk", [32, 0], ids=["x-per-32", "x-per-group"])
def test_group_form_windows_of_1_to_64_rows_keep_each_rows_bits(bits, gs, vnni, xblk):
    """int8 numerics on the group form (the default), on AVX-512 VNNI and on AVX2: every row of a window
    of 1-64 rows equals the row alone bit for bit, for every scale dtype, across blocks of W's rows and
    panels of K, dense and gathered; the row alone agrees with the scheme's reference."""
    ext = qmm_ext.load()
    if vnni and not ext.vnni_supported():
        pytest.skip("no AVX-512 VNNI here")
    with kernel_setting("vnni", vnni), kernel_setting("avx_vnni", False), numerics("int8"), int8_form(True), \
            x_block(xblk):
        for i, dtype in enumerate((mx.float32, mx.bfloat16, mx.float16)):
            alone, windows = _group_form_windows(bits, gs, dtype, seed=gs + i)
            for M, together in windows:
                assert mx.array_equal(together, alone[:M]).item(), f"{dtype} M={M}"
        w, s, b = _quantized(37, 1536, bits, gs, mx.float32, seed=1)
        x = mx.random.normal((5, 1536))
        _close_int8(qmm_ext.qmm(x, w, s, b, gs, bits), x, w, s, b, gs, bits)
        E, N, K = 4, 48, 256  # gathered: 40 (token, expert) rows, 2-17 an expert
        w, s, b = _quantized(N, K, bits, gs, mx.bfloat16, seed=9, experts=E)
        xs = mx.random.normal((20, 2, K))
        ids = mx.array([0, 1, 1, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 0, 3, 3, 3, 3, 1], dtype=mx.uint32)
        together = qmm_ext.gather_qmm(xs, w, s, b, ids, gs, bits)
        for p in range(20):
            e = ids[p].item()
            assert mx.array_equal(together[p], qmm_ext.qmm(xs[p], w[e], s[e], b[e], gs, bits)).item(), p


@needs_kernel
@pytest.mark.parametrize("vnni", [True, False], ids=["avx512-vnni", "avx2"])
def test_group_form_row_check_catches_a_window_that_sums_in_another_order(vnni):
    """Negative control: with the kernel mutated to add a window's bias term before its scaled sums (rows
    of several-row blocks only), the windows check above finds rows whose bits differ from the row alone."""
    if vnni and not qmm_ext.load().vnni_supported():
        pytest.skip("no AVX-512 VNNI here")
    with group_mutation(), kernel_setting("vnni", vnni), numerics("int8"), int8_form(True):
        differ = rows_differing(*_group_form_windows(4, 64, mx.bfloat16, seed=2))
    assert differ and 1 not in differ, differ


@needs_kernel
@pytest.mark.parametrize("mode", ["exact", "int8"])
def test_threads_give_the_same_bits(mode):
    w, s, b = _quantized(4096, 1024, 4, 64, mx.float32, seed=5)  # large enough to split over threads
    x = mx.random.normal((4, 1024))
    before = qmm_ext._EXT.threads()
    try:
        with numerics(mode):
            qmm_ext.set_threads(1)
            one = qmm_ext.qmm(x, w, s, b, 64, 4)
            mx.eval(one)
            qmm_ext.set_threads(2)
            assert mx.array_equal(qmm_ext.qmm(x, w, s, b, 64, 4), one).item()
    finally:
        qmm_ext.set_threads(before)


@needs_kernel
@pytest.mark.parametrize("bits,gs", [(4, 64), (8, 32)])
def test_gathered_experts_int8(bits, gs):
    """int8 numerics on gathered experts: each (token, expert) row against the reference on its expert,
    and bit-identical to the dense kernel on that expert."""
    E, N, K = 6, 80, 256
    w, s, b = _quantized(N, K, bits, gs, mx.float32, seed=6, experts=E)
    xs, ids = mx.random.normal((9, 1, K)), mx.array([0, 0, 1, 2, 2, 2, 4, 5, 5], dtype=mx.uint32)
    with numerics("int8"):
        ours = qmm_ext.gather_qmm(xs, w, s, b, ids, gs, bits)
        for p in range(9):
            e = ids[p].item()
            _close_int8(ours[p], xs[p], w[e], s[e], b[e], gs, bits)
            assert mx.array_equal(ours[p], qmm_ext.qmm(xs[p], w[e], s[e], b[e], gs, bits)).item()


@needs_kernel
@pytest.mark.parametrize("bits,gs", [(4, 64), (8, 32)])
def test_gathered_experts_match_gather_qmm(bits, gs, exact):
    E, N, K, k = 6, 80, 256, 2
    w, s, b = _quantized(N, K, bits, gs, mx.float32, seed=6, experts=E)
    # mlx-lm's unsorted layout: x [B, L, 1, 1, K], indices [B, L, k]
    x = mx.random.normal((2, 3, 1, 1, K))
    idx = mx.random.randint(0, E, (2, 3, k)).astype(mx.uint32)
    ref = mx.gather_qmm(x, w, s, b, rhs_indices=idx, transpose=True, group_size=gs, bits=bits)
    ours = qmm_ext.gather_qmm(x, w, s, b, idx, gs, bits)
    assert ours.shape == ref.shape
    _close(ours, ref)
    # its sorted layout (many tokens): x [P, 1, K], indices [P]
    xs, ids = mx.random.normal((9, 1, K)), mx.array([0, 0, 1, 2, 2, 2, 4, 5, 5], dtype=mx.uint32)
    _close(qmm_ext.gather_qmm(xs, w, s, b, ids, gs, bits),
           mx.gather_qmm(xs, w, s, b, rhs_indices=ids, transpose=True, group_size=gs, bits=bits, sorted_indices=True))
    # each row has the dense kernel's bits on its expert
    for p in (0, 4, 8):
        e = ids[p].item()
        assert mx.array_equal(qmm_ext.gather_qmm(xs, w, s, b, ids, gs, bits)[p],
                              qmm_ext.qmm(xs[p], w[e], s[e], b[e], gs, bits)).item()


@needs_kernel
def test_layers_switch_and_run_inside_compile(exact):
    lin = nn.QuantizedLinear(256, 96, bias=True, group_size=64, bits=4)
    emb = nn.QuantizedEmbedding(200, 128, group_size=64, bits=8)
    from mtp_serve.models.mlx_lm_compat import QuantizedSwitchLinear

    sw = QuantizedSwitchLinear(128, 64, 4, bias=False, group_size=32, bits=4)
    root = nn.Module()
    root.lin, root.emb, root.sw = lin, emb, sw
    mx.eval(root.parameters())
    x = mx.random.normal((1, 3, 256))
    h = mx.random.normal((1, 2, 128))
    idx = mx.array([[[0, 3], [1, 2]]], dtype=mx.uint32)
    ref = (lin(x), emb.as_linear(h), sw(mx.expand_dims(h, (-2, -3)), idx))
    assert install_decode_qmm([root]) == 3
    assert type(lin) is DecodeQuantizedLinear and type(emb) is DecodeQuantizedEmbedding
    assert type(sw) is DecodeQuantizedSwitchLinear
    calls = qmm_ext.calls()
    eager = (lin(x), emb.as_linear(h), sw(mx.expand_dims(h, (-2, -3)), idx))
    compiled = mx.compile(lambda a, b, i: (lin(a), emb.as_linear(b), sw(mx.expand_dims(b, (-2, -3)), i)))(x, h, idx)
    mx.eval(eager, compiled)
    assert qmm_ext.calls() - calls == 6  # all on the kernel
    for e, c, r in zip(eager, compiled, ref):
        assert mx.array_equal(e, c).item()
        _close(e, r)
    # prefill-sized inputs: dequantized to fp32 for the call, not on the kernel
    calls = qmm_ext.calls()
    xp = mx.random.normal((1, 100, 256))
    hp = mx.random.normal((1, 100, 128))
    _close(lin(xp), mx.quantized_matmul(xp, lin.weight, lin.scales, lin.biases, transpose=True, group_size=64,
                                        bits=4) + lin.bias)
    _close(emb.as_linear(hp), mx.quantized_matmul(hp, emb.weight, emb.scales, emb.biases, transpose=True,
                                                  group_size=64, bits=8))
    assert qmm_ext.calls() == calls


@needs_kernel
def test_prefill_products_dequantize_in_slices(monkeypatch):
    from mtp_serve.models import quantized_layers

    monkeypatch.setattr(quantized_layers, "DEQUANT_SLICE", 40 * 256)  # 40 rows of W a slice: 3 slices
    w, s, b = _quantized(96, 256, 4, 64, mx.bfloat16)
    x = mx.random.normal((2, 70, 256))
    y = quantized_layers.dequantized_matmul(x, w, s, b, 64, 4)
    assert y.shape == (2, 70, 96) and y.dtype == mx.float32
    # MLX's product with bf16 scales rounds to bf16: the reference takes them as fp32
    _close(y, mx.quantized_matmul(x, w, s.astype(mx.float32), b.astype(mx.float32), transpose=True, group_size=64,
                                  bits=4))


def test_fallback_when_the_extension_is_off():
    code = (
        "import mtp_serve, mlx.core as mx, mlx.nn as nn\n"
        "from mtp_serve import quantized_matmul as q\n"
        "from mtp_serve.models.quantized_layers import install_decode_qmm, quantized_matmul\n"
        "lin = nn.QuantizedLinear(128, 64, bias=False, group_size=64, bits=4)\n"
        "root = nn.Module(); root.lin = lin\n"
        "x = mx.random.normal((2, 128))\n"
        "assert install_decode_qmm([root]) == 0 and type(lin) is nn.QuantizedLinear\n"
        "y = quantized_matmul(x, lin.weight, lin.scales, lin.biases, 64, 4)\n"
        "assert mx.array_equal(y, lin(x)).item() and q.calls() == 0\n"
        "print(q.status())\n"
    )
    env = {**os.environ, "MTP_SERVE_NO_QMM": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "MLX's kernel" in out.stdout and "MTP_SERVE_NO_QMM=1" in out.stdout


def test_numerics_setting():
    """Default int8 where the other decode products are row-invariant (the skinny sgemm shim in
    front of OpenBLAS, or no OpenBLAS), exact where OpenBLAS computes them alone;
    MTP_SERVE_QUANTIZED_MATMUL or --quantized-matmul (mtp-serve, mtp-tune) choose."""
    from mtp_serve.cli.serve import build_parser as serve_parser
    from mtp_serve.cli.tune import build_parser as tune_parser

    if skinny_gemm.active():
        assert qmm_ext.default_numerics() == "int8" and "int8 numerics" in qmm_ext.status()
        code = "import mtp_serve\nfrom mtp_serve import quantized_matmul as q\nprint(q.numerics())\n"
        env = {**os.environ, "MTP_SERVE_NO_ROW_INVARIANT": "1"}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == "exact", out.stderr
    assert serve_parser().parse_args(["--quantized-matmul", "int8"]).quantized_matmul == "int8"
    assert tune_parser().parse_args(["m", "--quantized-matmul", "exact"]).quantized_matmul == "exact"
    with pytest.raises(ValueError):
        qmm_ext.set_numerics("int4")
    code = "import mtp_serve\nfrom mtp_serve import quantized_matmul as q\nprint(q.numerics())\n"
    env = {**os.environ, "MTP_SERVE_QUANTIZED_MATMUL": "int8"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "int8", out.stderr


# ---------------------------------------------------------------- end to end on quantized synthetic models

N_TOKENS = 24
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 11], list(range(30, 100, 3))]


@pytest.fixture(scope="module")
def quantized(checkpoint_dir):
    from mtp_serve.models.loader import load_model

    cache = {}

    def make(family, bits, mode=None):
        """A model per numerics: its compiled steps keep the numerics of their first trace."""
        mode = mode or qmm_ext.default_numerics()
        if (family, bits, mode) not in cache:
            lm = load_model(str(checkpoint_dir(family, agreeable=True, **QUANT_TEXT)))
            assert quantize_loaded(lm.model, bits, 64 if bits == 4 else 32) > 0
            cache[family, bits, mode] = lm
        return cache[family, bits, mode]

    return make


def _greedy(lm, prompt, depth):
    return greedy(lm, prompt, depth, N_TOKENS)


def _batched(lm, prompts, depth):
    return batched_greedy(lm, prompts, depth, N_TOKENS)


def _plain_gap(lm, prompt, tokens, i):
    """The top-two logit gap of plain decoding's step i (prompt, then tokens[:i] one step each)."""
    model = lm.model
    cache = model.make_cache()
    _, logits = model.forward(mx.array([prompt]), cache, last_logits=True)
    for t in tokens[:i]:
        _, logits = model.forward(mx.array([[t]]), cache)
    top2 = mx.sort(logits[0, -1])[-2:]
    return (top2[1] - top2[0]).item()


def _assert_same(ours, plain, label):
    """MTP's tokens are plain's, exactly: the quantized kernel and every other decode product
    (the shim's row-invariant small products) give a row the same bits whatever the rows beside
    it, so a verify window scores as T single steps do."""
    first = next((i for i, (a, b) in enumerate(zip(ours, plain)) if a != b), None)
    assert first is None, f"{label}: token {first} differs ({ours[first]} vs {plain[first]})"
    assert len(ours) == len(plain), label


needs_row_invariance = pytest.mark.skipif(
    not (skinny_gemm.row_invariant() or not BACKEND.blas),
    reason="OpenBLAS computes the small products here: a verify window's attention differs from single steps")


@needs_kernel
@needs_row_invariance
@pytest.mark.parametrize("family,bits,mode", [(f, b, m) for f in FAMILIES for b in (4, 8) for m in ("int8", "exact")])
def test_greedy_mtp_identical_to_plain_quantized(family, bits, mode, quantized):
    """Both numerics, with the preloaded OpenBLAS: greedy MTP (depths 1 and 3, and batched) gives
    plain decoding's tokens exactly. int8 rounds x, so any difference between a verify window and
    single steps would be amplified to token changes (it was, before the shim took attention's small
    products: qwen3_next 8-bit, token 17 of prompt 2, where plain's top-two gap is 1.1)."""
    lm = quantized(family, bits, mode)
    with numerics(mode):
        calls = qmm_ext.calls()
        plain = [_greedy(lm, p, 0)[0] for p in PROMPTS]
        assert qmm_ext.calls() > calls  # the kernel computed the decode steps
        for depth in (1, 3):
            for p, ref in zip(PROMPTS, plain):
                ours, stats = _greedy(lm, p, depth)
                _assert_same(ours, ref, f"{family} {bits}-bit {mode} depth {depth}")
        assert stats.acceptance_rate > 0  # drafts were accepted: verify windows of several rows ran
        for p, ours, ref in zip(PROMPTS, _batched(lm, PROMPTS, 2), plain):
            _assert_same(ours, ref, f"{family} {bits}-bit {mode} batched")


INT8_IDENTITY = """
import sys
import mtp_serve
from mtp_serve import quantized_matmul as q
from mtp_serve.engine.generator import generate
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.models.loader import load_model
from mtp_serve.testing.quantized import QUANT_TEXT, quantize_loaded
from mtp_serve.testing.synthetic import write_synthetic_checkpoint
assert q.numerics() == "int8", q.numerics()  # the default without OpenBLAS
family, bits, where = sys.argv[1], int(sys.argv[2]), sys.argv[3]
lm = load_model(str(write_synthetic_checkpoint(where, family, agreeable=True, **QUANT_TEXT)))
quantize_loaded(lm.model, bits, 64 if bits == 4 else 32)
def greedy(p, depth):
    return [t for c in generate(lm.model, lm.tokenizer, p, SamplingParams(max_tokens=24, ignore_eos=True),
                                depth=depth) for t in c.token_ids]
for p in ([5, 17, 99, 3, 42, 7, 250, 11], list(range(30, 100, 3))):
    plain = greedy(p, 0)
    assert all(greedy(p, d) == plain for d in (1, 3)), (family, bits, p)
print("identical")
"""


@needs_kernel
@pytest.mark.parametrize("family,bits", [("qwen3_next", 8), ("qwen3_5_moe", 4)])
def test_int8_mtp_identical_to_plain_without_openblas(family, bits, tmp_path):
    """Without OpenBLAS (MTP_SERVE_NO_OPENBLAS=1: MLX's own fp32 matmuls, row-invariant too) int8
    is the default and greedy MTP stays token-identical to plain."""
    env = {**os.environ, "MTP_SERVE_NO_OPENBLAS": "1"}
    out = subprocess.run([sys.executable, "-c", INT8_IDENTITY, family, str(bits), str(tmp_path / "ckpt")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "identical" in out.stdout, out.stderr[-2000:]


def _mlx_lm_greedy(path, prompt, bits, gs):
    from mlx.utils import tree_map
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.generate import generate_step

    model, _ = mlx_lm_load(str(path))
    model.update(tree_map(lambda x: x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating) else x, model.parameters()))
    quantize_mlx_lm_model(model, bits, gs)
    toks, gaps = [], []
    for (tok, logprobs), _ in zip(generate_step(mx.array(prompt), model, max_tokens=N_TOKENS), range(N_TOKENS)):
        top2 = mx.sort(logprobs)[-2:]
        toks.append(int(tok))
        gaps.append(float(top2[1] - top2[0]))
    return toks, gaps


@needs_kernel
@pytest.mark.parametrize("mode", ["exact", "int8"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_6_moe"])
def test_plain_agrees_with_mlx_lm_on_the_same_quantized_model(family, bits, mode, quantized, checkpoint_dir):
    """mlx-lm's greedy output (its kernels) on the same quantized weights. Exact numerics:
    identical, or diverging first at a near tie (top-two logits within 1e-4), as in
    test_greedy_identity. int8 numerics (x rounded to int8 in decode steps): the
    agreement is reported; the first token comes from the prefill (fp32), so it agrees
    up to a near tie, and the run must agree over most of its tokens."""
    lm = quantized(family, bits, mode)
    path = checkpoint_dir(family, agreeable=True, **QUANT_TEXT)
    agree = total = 0
    gaps_at = []
    with numerics(mode):
        for p in PROMPTS:
            ref, gaps = _mlx_lm_greedy(path, p, bits, 64 if bits == 4 else 32)
            ours, _ = _greedy(lm, p, 0)
            first = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
            if first is not None:
                gaps_at.append(f"token {first} (gap {gaps[first]:.2g})")
            if mode == "exact" or first == 0:
                assert first is None or gaps[first] < 1e-4, f"token {first} differs with reference gap {gaps[first]:.3g}"
            agree += len(ref) if first is None else first
            total += len(ref)
    report = (f"{family} {bits}-bit {mode}: {agree}/{total} tokens agree with mlx-lm's greedy output"
              + (f"; first differences at {', '.join(gaps_at)}" if gaps_at else ""))
    print(report)
    assert 2 * agree > total, report  # int8: most tokens (exact numerics checked token by token above)


@needs_kernel
def test_loading_a_quantized_checkpoint_switches_its_layers(stock_converted, checkpoint_dir):
    """`mlx_lm convert -q`'s output, loaded: its quantized layers run on the kernel."""
    from mtp_serve.models.loader import load_model

    lm = load_model(str(stock_converted(checkpoint_dir("qwen3_5", agreeable=True), True)))
    kinds = {type(m) for _, m in lm.model.model.named_modules()}
    assert DecodeQuantizedLinear in kinds and nn.QuantizedLinear not in kinds
    calls = qmm_ext.calls()
    assert len(_greedy(lm, PROMPTS[0], 0)[0]) == N_TOKENS
    assert qmm_ext.calls() > calls


@needs_kernel
def test_calibration_times_quantized_models(quantized):
    from mtp_serve.backend import set_decode_blas_threads
    from mtp_serve.engine.warmup import calibrate_blas_threads, decode_matmuls_note

    lm = quantized("qwen3_5", 4)
    try:
        threads = calibrate_blas_threads(lm.model, lm.tokenizer, 2, steps=2, rounds=1)
        assert "quantized weights, GatedDeltaNet steps and activations: mtp-serve's native kernels" in decode_matmuls_note(threads)
    finally:
        set_decode_blas_threads(None)


@needs_kernel
@needs_row_invariance
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_int8_verify_window_scores_bit_for_bit_as_plain_steps(family, quantized):
    """With int8 numerics a verify window's logits and the GatedDeltaNet states it keeps are the
    bits of T plain steps. (A WY-form window, exact only to fp32 rounding, once turned int8 rounding
    of the next product's x into token changes at 0.8B shapes: windows step token by token.)"""
    from support.verify_windows import assert_window_is_plain_steps

    lm = quantized(family, 4, "int8")
    with numerics("int8"):
        assert_window_is_plain_steps(lm.model, PROMPTS[1], [7, 300, 42, 9], family)

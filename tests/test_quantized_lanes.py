"""The quantized kernel's lane layout (mtp_serve/native/qmm_lanes.inc): weights repacked once at load
so that the int8 group form needs no per-call transpose or unpacking.

Bits: the lane form runs the group form's integer dots and float chain, so each row's result is
asserted equal, bit for bit, to the group form's on the original layout for that row alone, in
windows of 1-64 rows (with a mutated kernel as the negative control). Layers: the lanes replace the
packed weight, scales and biases, and what reads the original layout (prefill slices, embedding
lookups, draft-vocabulary rows, `.weight`, MLX's own class) gets exactly the original arrays.
"""

from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
import pytest

from mtp_serve import quantized_matmul as qmm_ext
from mtp_serve.models import quantized_layers
from mtp_serve.models.quantized_layers import (
    DecodeQuantizedEmbedding,
    DecodeQuantizedLinear,
    install_decode_qmm,
    project,
    rows_of,
    use_kernel,
)
from test_quantized_matmul import (_quantized, group_mutation, int8_form, kernel_setting, needs_kernel, numerics,
                                  rows_differing, x_block)

N, K = 37, 1536  # two blocks of 16 rows and a partial one; a full panel of K (1024) and a partial one


def _lane_windows(bits, gs, dtype, seed):
    """(each row alone on the group form over the original layout, [(M, a window of M rows on the lanes)])."""
    w, s, b = _quantized(N, K, bits, gs, dtype, seed=seed)
    lanes = (qmm_ext.to_lanes(w), qmm_ext.to_lanes(s), qmm_ext.to_lanes(b), N)
    x = mx.random.normal((64, K), key=mx.random.key(seed)) * 3
    alone = mx.concatenate([qmm_ext.qmm(x[m:m + 1], w, s, b, gs, bits) for m in range(64)])
    mx.eval(alone)
    return alone, [(M, qmm_ext.qmm_lanes(x[:M], [lanes], gs, bits)[0]) for M in range(1, 65)]


ISAS = ["amx", "avx512-vnni", "avx-vnni", "avx2"]


@contextmanager
def amx_rows(rows):
    """Windows of at least `rows` rows on AMX tiles, at 4 and 8 bits (0: never)."""
    ext = qmm_ext.load()
    before = ext.amx_rows(4), ext.amx_rows(8)
    ext.set_amx_rows(rows)
    try:
        yield
    finally:
        ext.set_amx_rows(before[0], 4)
        ext.set_amx_rows(before[1], 8)


@contextmanager
def instruction_set(isa):
    """The int8 forms on AMX tiles (windows of 2+ rows; one row on AVX-512 VNNI), on AVX-512 VNNI alone,
    on AVX-VNNI (256-bit dpbusd) or on AVX2 alone."""
    ext = qmm_ext.load()
    if isa in ("amx", "avx512-vnni") and not ext.vnni_supported():
        pytest.skip("no AVX-512 VNNI here")
    if isa == "amx" and not ext.amx_supported():
        pytest.skip("no AMX here (or the kernel did not grant its tile state)")
    if isa == "avx-vnni" and not ext.avx_vnni_supported():
        pytest.skip("no AVX-VNNI here")
    with kernel_setting("vnni", isa in ("amx", "avx512-vnni")), kernel_setting("avx_vnni", isa == "avx-vnni"), \
            kernel_setting("amx", isa == "amx"), amx_rows(2):
        assert ext.vnni() == (isa in ("amx", "avx512-vnni")) and ext.avx_vnni() == (isa == "avx-vnni")
        assert ext.amx() == (isa == "amx")
        yield


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("xblk", [32, 0], ids=["x-per-32", "x-per-group"])
def test_lane_form_windows_of_1_to_64_rows_keep_each_rows_group_form_bits(bits, gs, isa, xblk):
    """Every row of a 1-64-row window on the lanes equals the group form's row alone on the original
    layout, for every scale dtype, on each instruction set, across blocks of rows and panels of K."""
    with instruction_set(isa), numerics("int8"), int8_form(True), x_block(xblk):
        for i, dtype in enumerate((mx.float32, mx.bfloat16, mx.float16)):
            alone, windows = _lane_windows(bits, gs, dtype, seed=gs + i)
            for M, together in windows:
                assert together.shape == (M, N)
                assert mx.array_equal(together, alone[:M]).item(), f"{dtype} M={M}"


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
def test_lane_form_row_check_catches_a_window_that_sums_in_another_order(isa):
    """Negative control: the kernel mutated to add the bias term first in several-row blocks makes the
    check above find windows whose rows differ from the row alone (and never the one-row window)."""
    with instruction_set(isa), numerics("int8"), int8_form(True):
        alone, _ = _lane_windows(4, 64, mx.bfloat16, seed=2)
        mx.eval(alone)
        with group_mutation():  # (the windows are evaluated while it is on)
            differ = rows_differing(alone, _lane_windows(4, 64, mx.bfloat16, seed=2)[1])
    assert differ and 1 not in differ, differ


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_avx_vnni_gives_the_avx2_forms_bits(bits, gs):
    """AVX-VNNI's dpbusd sums what AVX2's maddubs/madd sum: on both layouts, windows of 1-64 rows and
    every scale dtype, each row's bits are the AVX2 form's."""
    for i, dtype in enumerate((mx.float32, mx.bfloat16, mx.float16)):
        w, s, b = _quantized(N, K, bits, gs, dtype, seed=gs + i)
        lanes = (qmm_ext.to_lanes(w), qmm_ext.to_lanes(s), qmm_ext.to_lanes(b), N)
        x = mx.random.normal((64, K), key=mx.random.key(i)) * 3
        forms = {}
        for isa in ("avx-vnni", "avx2"):
            with instruction_set(isa), numerics("int8"), int8_form(True):
                forms[isa] = [(qmm_ext.qmm(x[:M], w, s, b, gs, bits), qmm_ext.qmm_lanes(x[:M], [lanes], gs, bits)[0])
                              for M in (1, 2, 3, 4, 5, 8, 13, 64)]
                mx.eval(forms[isa])
        for (a, la), (c, lc) in zip(forms["avx-vnni"], forms["avx2"]):
            assert mx.array_equal(a, c).item() and mx.array_equal(la, lc).item(), (dtype, a.shape)


def _layers(monkeypatch=None):
    """Quantized layers of both kinds; with `monkeypatch`, switched to the kernel without repacking."""
    root = nn.Module()
    root.lin = nn.QuantizedLinear(256, 200, bias=True, group_size=64, bits=4)  # 200 rows: a partial block
    root.emb = nn.QuantizedEmbedding(203, 256, group_size=32, bits=8)
    root.q, root.k = (nn.QuantizedLinear(256, n, bias=False, group_size=64, bits=4) for n in (96, 40))
    mx.eval(root.parameters())
    if monkeypatch is not None:
        monkeypatch.setenv("MTP_SERVE_NO_LANES", "1")
        assert install_decode_qmm([root]) == 4
        monkeypatch.delenv("MTP_SERVE_NO_LANES")
    return root


@needs_kernel
def test_repacked_layers_hold_the_lanes_instead_of_the_original_and_give_its_results(monkeypatch):
    """Repacked (int8 numerics) each dense layer and embedding holds only the lane arrays (the original's
    bytes plus the last block's padding); its kernel products, prefill products, lookups, draft-vocabulary
    rows and `.weight` are exactly what the original layout gives."""
    with numerics("int8"):
        root = _layers(monkeypatch)
        original = {name: {k: m[k] for k in ("weight", "scales", "biases")} for name, m in root.children().items()}
        x = mx.random.normal((5, 256))
        xp = mx.random.normal((1, 100, 256))  # prefill-sized: dequantized in slices
        ids = mx.array([[0, 202, 17], [16, 15, 31]])
        before = (root.lin(x), root.emb.as_linear(x), root.lin(xp), root.emb.as_linear(xp), root.emb(ids),
                  *project(x, [root.q, root.k]))
        mx.eval(before)
        assert quantized_layers.repack_lanes(list(root.children().values())) == 4
        for name, m in root.children().items():
            assert type(m) in (DecodeQuantizedLinear, DecodeQuantizedEmbedding)
            assert "weight" not in m and "scales" not in m and "biases" not in m, name
            rows = original[name]["weight"].shape[0]
            pad = -rows % 16
            for k, a in original[name].items():
                assert m[k + "_lanes"].nbytes == a.nbytes * (rows + pad) // rows
                assert mx.array_equal(getattr(m, k), a).item(), (name, k)
        calls = qmm_ext.calls()
        after = (root.lin(x), root.emb.as_linear(x), root.lin(xp), root.emb.as_linear(xp), root.emb(ids),
                 *project(x, [root.q, root.k]))
        mx.eval(after)
        assert qmm_ext.calls() - calls == 3  # lin, emb, q and k in one call; prefill not on the kernel
        for a, b in zip(before, after):
            assert mx.array_equal(a, b).item()
        for got, want in zip(rows_of(root.emb, ids[0]), original["emb"].values()):
            assert mx.array_equal(got, want[ids[0]]).item()
        with use_kernel([root], on=False):  # MLX's own classes read the original layout
            assert type(root.lin) is nn.QuantizedLinear
            mlx = root.lin(x)
        assert "weight" not in root.lin and type(root.lin) is DecodeQuantizedLinear
        w = original["lin"]
        ref = mx.quantized_matmul(x, w["weight"], w["scales"], w["biases"], transpose=True, group_size=64,
                                  bits=4) + root.lin.bias
        assert mx.array_equal(mlx, ref).item()


@needs_kernel
def test_exact_numerics_keep_the_original_layout():
    """Installed under exact numerics the layers are not repacked (the lane form is int8 only)."""
    with numerics("exact"):
        root = _layers()
        install_decode_qmm([root])
        assert all("weight" in m and "weight_lanes" not in m for m in root.children().values())


@needs_kernel
def test_installing_under_int8_numerics_repacks():
    with numerics("int8"):
        root = _layers()
        assert install_decode_qmm([root]) == 4
        assert all("weight_lanes" in m and "weight" not in m for m in root.children().values())


@needs_kernel
def test_lanes_and_original_alternate_in_one_model(monkeypatch):
    """Benchmarks keep both layouts (`keep_original`) and switch between them: the same bits."""
    with numerics("int8"):
        root = _layers(monkeypatch)
        assert quantized_layers.repack_lanes(list(root.children().values()), keep_original=True) == 4
        x = mx.random.normal((7, 256))
        try:
            quantized_layers.set_lanes(False)
            off = root.lin(x)
            quantized_layers.set_lanes(True)
            on = root.lin(x)
        finally:
            quantized_layers.set_lanes(True)
        mx.eval(on, off)
        assert mx.array_equal(on, off).item()

"""The skinny sgemm (mtp_serve/native/skinny_sgemm.c): MLX's decode-sized matmuls go
through it, its results are right, a row's result never depends on the other rows
of the product (so a verify window's logits equal the one-token steps'), and every
other product still reaches OpenBLAS unchanged."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from mtp_serve import BACKEND, skinny_gemm
from mtp_serve.backend import set_blas_threads

expected_active = bool(BACKEND.blas) and skinny_gemm._cpu_has_avx2_fma() and not os.environ.get("MTP_SERVE_NO_SKINNY_GEMM")
needs_shim = pytest.mark.skipif(not expected_active, reason="no OpenBLAS or no AVX2/FMA here: the shim is not loaded")


@pytest.fixture(autouse=True)
def skinny_on():
    """An in-process server's start-up calibration may have switched it off for its model."""
    was = skinny_gemm.enabled()
    skinny_gemm.set_enabled(True, min_elements=0)  # the test models' small matrices too
    yield
    skinny_gemm.set_enabled(was)


def _reference(x: mx.array, w: mx.array) -> np.ndarray:
    return np.asarray(x, dtype=np.float64) @ np.asarray(w, dtype=np.float64).T


def _close(y: mx.array, x: mx.array, w: mx.array) -> None:
    # fp32 accumulation over K terms: error bound relative to the sum of |products|
    scale = np.abs(np.asarray(x, dtype=np.float64)) @ np.abs(np.asarray(w, dtype=np.float64)).T
    err = np.abs(np.asarray(y, dtype=np.float64) - _reference(x, w))
    assert (err <= 1e-6 * scale * np.sqrt(x.shape[-1]) + 1e-30).all(), float((err / scale).max())


def test_loaded_wherever_openblas_and_avx2_are():
    assert skinny_gemm.active() == expected_active
    if expected_active:
        assert "skinny sgemm" in BACKEND.note


@needs_shim
@pytest.mark.parametrize("N,K", [(300, 200), (37, 13), (4096, 1024), (1000, 8)])
def test_decode_sized_products_are_computed_by_it_and_right(N, K):
    w = mx.random.normal((N, K), key=mx.random.key(N + K))
    for M in (*range(1, 10), 16, 31, 32, 64):  # decode steps and verify windows
        x = mx.random.normal((1, M, K), key=mx.random.key(M))
        before = skinny_gemm.calls()
        y = x @ w.T
        mx.eval(y)
        assert skinny_gemm.calls() > before, f"M={M} did not reach the shim"
        _close(y[0], x[0], w)


@needs_shim
@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_result_does_not_depend_on_the_other_rows(threads):
    set_blas_threads(threads)
    try:
        for N, K in [(576, 192), (1 << 12, 1 << 10)]:  # the second is large enough to be split over threads
            w = mx.random.normal((N, K), key=mx.random.key(7))
            x = mx.random.normal((8, K), key=mx.random.key(8))
            alone = [x[i : i + 1] @ w.T for i in range(8)]
            for M in range(1, 9):
                together = x[:M] @ w.T
                for i in range(M):
                    assert mx.array_equal(together[i : i + 1], alone[i]).item(), (N, K, M, i)
    finally:
        set_blas_threads(None)


@needs_shim
def test_threads_added_later_take_only_new_products():
    """Workers started after earlier parallel products must not replay the last one."""
    w = mx.random.normal((1 << 12, 1 << 10), key=mx.random.key(11))
    try:
        for threads in (2, 3, 4, 2, 4):
            set_blas_threads(threads)
            x = mx.random.normal((3, 1 << 10), key=mx.random.key(threads))
            _close(x @ w.T, x, w)
    finally:
        set_blas_threads(None)


def test_other_products_are_passed_to_openblas_unchanged():
    w = mx.random.normal((640, 96), key=mx.random.key(1))
    for M in (65, 300):  # more rows than a verify window
        x = mx.random.normal((M, 96), key=mx.random.key(M))
        _close(x @ w.T, x, w)
    x = mx.random.normal((4, 96), key=mx.random.key(2))
    _close(x @ mx.contiguous(w.T), x, w)  # B not transposed
    c = mx.random.normal((4, 640), key=mx.random.key(3))
    y = mx.addmm(c, x, w.T, alpha=0.5, beta=2.0)  # alpha, beta
    assert np.allclose(np.asarray(y), 0.5 * _reference(x, w) + 2.0 * np.asarray(c), rtol=1e-4, atol=1e-4)


def test_calibration_picks_a_path_and_both_paths_decode_exactly(checkpoint_dir, loaded):
    """Start-up calibration measures rounds at the server's depth on OpenBLAS and on the
    skinny sgemm; whichever it keeps (and the other), greedy MTP stays mlx-lm's output."""
    from test_greedy_identity import PROMPTS, assert_identical_or_near_tie, mtp_greedy, reference_greedy

    from mtp_serve.engine.warmup import calibrate_blas_threads, decode_matmuls_note

    lm = loaded("qwen3_5", agreeable=True)
    try:
        threads = calibrate_blas_threads(lm.model, lm.tokenizer, 3)
        assert threads in (1, None)
        assert ("skinny" in decode_matmuls_note(threads)) == skinny_gemm.enabled()
        ref, gaps = reference_greedy(checkpoint_dir("qwen3_5", agreeable=True), PROMPTS[1], 48)
        for skinny in (True, False):
            skinny_gemm.set_enabled(skinny, min_elements=0)
            for depth in (0, 3):
                ours, _ = mtp_greedy(lm, PROMPTS[1], depth, 48)
                assert_identical_or_near_tie(ours, ref, gaps, f"skinny={skinny} depth {depth}")
    finally:
        set_blas_threads(None)
        from mtp_serve.backend import set_decode_blas_threads

        set_decode_blas_threads(None)


@needs_shim
@pytest.mark.parametrize("transpose_b", [True, False])
def test_small_products_give_a_row_the_same_bits_at_any_row_count(transpose_b):
    """Products of up to 64 rows on weights under the skinny threshold (attention's q.k and p.v,
    small layers): OpenBLAS gave row 0 of a 40 x 32 product different bits alone and among 4 rows,
    which made int8 decode numerics leave plain's tokens under MTP."""
    skinny_gemm.set_enabled(True)  # the default threshold: these products are all under it
    assert skinny_gemm.row_invariant()
    for N, K in [(40, 32), (300, 256), (77, 5), (13, 129)]:
        b = mx.random.normal((N, K) if transpose_b else (K, N), key=mx.random.key(N))
        w = b if transpose_b else mx.contiguous(b.T)  # w [N, K] for the reference
        bop = b.T if transpose_b else b
        x = mx.random.normal((64, K), key=mx.random.key(K))
        before = skinny_gemm.small_calls()
        alone = [x[i : i + 1] @ bop for i in range(64)]
        mx.eval(alone)
        assert skinny_gemm.small_calls() > before
        for M in (2, 4, 5, 9, 64):
            together = x[:M] @ bop
            _close(together, x[:M], w)
            for i in range(M):
                assert mx.array_equal(together[i : i + 1], alone[i]).item(), (N, K, M, i)
        xt = mx.contiguous(x[:4].T).T  # A transposed in memory
        assert mx.array_equal(xt @ bop, x[:4] @ bop).item()
    # attention-shaped: per-head batched products, a window of 4 queries against one query
    q = mx.random.normal((1, 8, 4, 64), key=mx.random.key(5))
    k = mx.random.normal((1, 8, 100, 64), key=mx.random.key(6))
    scores = q @ k.swapaxes(-1, -2)
    assert mx.array_equal(scores[:, :, 2:3], q[:, :, 2:3] @ k.swapaxes(-1, -2)).item()
    p = mx.softmax(scores, axis=-1)
    assert mx.array_equal((p @ k)[:, :, 1:2], p[:, :, 1:2] @ k).item()
    c = mx.random.normal((4, 40), key=mx.random.key(3))
    x4, b4 = mx.random.normal((4, 32), key=mx.random.key(4)), mx.random.normal((40, 32), key=mx.random.key(9))
    y = mx.addmm(c, x4, b4.T, alpha=0.5, beta=2.0)
    assert np.allclose(np.asarray(y), 0.5 * _reference(x4, b4) + 2.0 * np.asarray(c), rtol=1e-4, atol=1e-4)
    assert mx.array_equal(y[1:2], mx.addmm(c[1:2], x4[1:2], b4.T, alpha=0.5, beta=2.0)).item()


FORMS = {"avx2": 0, "avx512": 2}  # rows from which the AVX-512 form takes a product (0: never)


@pytest.fixture(params=list(FORMS))
def form(request):
    if request.param == "avx512" and not skinny_gemm.set_wide_rows(FORMS["avx512"]):
        pytest.skip("no AVX-512 here")
    skinny_gemm.set_wide_rows(FORMS[request.param])
    yield request.param
    skinny_gemm.set_wide_rows(FORMS["avx512"])


def _rows_that_differ(x: mx.array, w: mx.array, rows) -> list:
    """(M, row) where row `row` of the M-row product x[:M] @ w.T differs in any bit from the row alone."""
    alone = [x[i : i + 1] @ w.T for i in range(max(rows))]
    mx.eval(alone)
    bad = []
    for M in rows:
        together = x[:M] @ w.T
        mx.eval(together)
        bad += [(M, i) for i in range(M) if not mx.array_equal(together[i : i + 1], alone[i]).item()]
    return bad


@needs_shim
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("N,K", [(4099, 1030), (3584, 1024), (300, 200), (37, 13)])
def test_windows_of_up_to_64_rows_give_each_row_its_single_step_bits(form, threads, N, K):
    """Verify windows of 1-64 rows, on each kernel form (AVX2; AVX-512 where the CPU has it),
    on weights over the skinny threshold (split over threads) and under it (the small products):
    every row has the bits of the one-row product, and a K that is not a multiple of 8 takes the
    scalar tail too."""
    set_blas_threads(threads)
    try:
        skinny_gemm.set_enabled(True)  # the default threshold: the first two shapes are over it
        w = mx.random.normal((N, K), key=mx.random.key(N))
        x = mx.random.normal((64, K), key=mx.random.key(K))
        before = skinny_gemm.calls() + skinny_gemm.small_calls()
        rows = list(range(1, 65)) if N * K < 1 << 20 else [1, 2, 3, 5, 8, 9, 13, 16, 17, 32, 33, 63, 64]
        assert _rows_that_differ(x, w, rows) == []
        assert skinny_gemm.calls() + skinny_gemm.small_calls() >= before + len(rows) + 64
        _close(x @ w.T, x, w)
    finally:
        set_blas_threads(None)


@needs_shim
def test_the_kernel_forms_give_the_same_bits():
    """AVX2 and AVX-512 compute each output as the same chain of operations: a window on one form
    equals a step on the other."""
    if not skinny_gemm.set_wide_rows(FORMS["avx512"]):
        pytest.skip("no AVX-512 here")
    w = mx.random.normal((4099, 1030), key=mx.random.key(3))
    x = mx.random.normal((33, 1030), key=mx.random.key(4))
    try:
        out = {}
        for name, rows in FORMS.items():
            skinny_gemm.set_wide_rows(rows)
            out[name] = [x @ w.T, x[:1] @ w.T]
            mx.eval(out[name])
        assert mx.array_equal(out["avx2"][0], out["avx512"][0]).item()
        assert mx.array_equal(out["avx512"][0][:1], out["avx2"][1]).item()
    finally:
        skinny_gemm.set_wide_rows(FORMS["avx512"])


@needs_shim
def test_the_row_check_finds_rows_that_differ():
    """Negative control for the row checks above: on OpenBLAS (the shim off), whose one-row and
    many-row paths round differently (on its SSE3 kernels at both shapes, on its AVX-512 ones at
    the smaller), the same check reports rows."""
    skinny_gemm.set_enabled(False)
    skinny_gemm.set_row_invariant(False)
    try:
        differ = []
        for N, K in [(4099, 1030), (333, 777)]:
            w = mx.random.normal((N, K), key=mx.random.key(5))
            x = mx.random.normal((16, K), key=mx.random.key(6))
            differ += _rows_that_differ(x, w, [4, 16])
        assert differ != []
    finally:
        skinny_gemm.set_row_invariant(True)

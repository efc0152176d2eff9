"""mtp-serve's decode-sized quantized matmul (mtp_serve/quantized_matmul.py, native/quantized_matmul.cpp).

Tolerance against MLX's `quantized_matmul` / `gather_qmm`: both compute the same
dequantized product in fp32 with different summation orders (the kernel sums
q * x per chunk and scales per chunk, then adds bias * sum(x)), so they agree to
a few fp32 ulps of the row's magnitude: max |ours - mlx| <= 2e-5 * max |mlx|.
Across row counts the kernel gives each row the same bits (asserted exactly).
"""

import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest

from mtp_serve import quantized_matmul as qmm_ext
from mtp_serve.engine.generator import generate
from mtp_serve.engine.policy import DepthPolicy
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.engine.scheduler import Scheduler
from mtp_serve.models.quantized_layers import (
    DecodeQuantizedEmbedding,
    DecodeQuantizedLinear,
    DecodeQuantizedSwitchLinear,
    install_decode_qmm,
)
from mtp_serve.testing.quantized import QUANT_TEXT, quantize_loaded, quantize_mlx_lm_model
from mtp_serve.testing.synthetic import FAMILIES

REL_TOL = 2e-5

needs_kernel = pytest.mark.skipif(qmm_ext.load() is None, reason=f"kernel unavailable: {qmm_ext.status()}")


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
def test_kernel_matches_mlx(bits, gs):
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
def test_x_dtypes_and_batch_shapes():
    w, s, b = _quantized(64, 256, 4, 64, mx.float32)
    for dtype in (mx.bfloat16, mx.float16):
        x = mx.random.normal((2, 3, 256)).astype(dtype)
        y = qmm_ext.qmm(x, w, s, b, 64, 4)
        assert y.dtype == dtype and y.shape == (2, 3, 64)
        ref = mx.quantized_matmul(x.astype(mx.float32), w, s, b, transpose=True, group_size=64, bits=4)
        assert mx.allclose(y.astype(mx.float32), ref, atol=3e-2 * mx.abs(ref).max().item()).item()


@needs_kernel
@pytest.mark.parametrize("bits,gs", [(4, 32), (4, 64), (8, 128), (2, 64)])
def test_rows_bit_identical_across_row_counts(bits, gs):
    w, s, b = _quantized(96, 512, bits, gs, mx.float32, seed=3)
    x = mx.random.normal((64, 512), key=mx.random.key(4))
    alone = mx.concatenate([qmm_ext.qmm(x[i:i + 1], w, s, b, gs, bits) for i in range(x.shape[0])])
    for M in list(range(1, 9)) + [13, 64]:
        together = qmm_ext.qmm(x[:M], w, s, b, gs, bits)
        assert mx.array_equal(together, alone[:M]).item(), f"M={M}"


@needs_kernel
def test_threads_give_the_same_bits():
    w, s, b = _quantized(4096, 1024, 4, 64, mx.float32, seed=5)  # large enough to split over threads
    x = mx.random.normal((4, 1024))
    before = qmm_ext._EXT.threads()
    try:
        qmm_ext.set_threads(1)
        one = qmm_ext.qmm(x, w, s, b, 64, 4)
        mx.eval(one)
        qmm_ext.set_threads(2)
        assert mx.array_equal(qmm_ext.qmm(x, w, s, b, 64, 4), one).item()
    finally:
        qmm_ext.set_threads(before)


@needs_kernel
@pytest.mark.parametrize("bits,gs", [(4, 64), (8, 32)])
def test_gathered_experts_match_gather_qmm(bits, gs):
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
def test_layers_switch_and_run_inside_compile():
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
    # prefill-sized inputs stay on MLX's kernel
    calls = qmm_ext.calls()
    mx.eval(lin(mx.random.normal((1, 100, 256))))
    assert qmm_ext.calls() == calls


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


# ---------------------------------------------------------------- end to end on quantized synthetic models

N_TOKENS = 24
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 11], list(range(30, 100, 3))]


@pytest.fixture(scope="module")
def quantized(checkpoint_dir):
    from mtp_serve.models.loader import load_model

    cache = {}

    def make(family, bits):
        if (family, bits) not in cache:
            lm = load_model(str(checkpoint_dir(family, agreeable=True, **QUANT_TEXT)))
            assert quantize_loaded(lm.model, bits, 64 if bits == 4 else 32) > 0
            cache[family, bits] = lm
        return cache[family, bits]

    return make


def _greedy(lm, prompt, depth):
    out, stats = [], None
    for chunk in generate(lm.model, lm.tokenizer, prompt, SamplingParams(max_tokens=N_TOKENS, ignore_eos=True), depth=depth):
        out += chunk.token_ids
        stats = chunk.stats
    return out, stats


def _batched(lm, prompts, depth):
    sched = Scheduler(lm.model, lm.tokenizer, max_batch_size=4, prefill_chunk=16,
                      policy=DepthPolicy(max_depth=depth, fixed=True))
    for i, p in enumerate(prompts):
        sched.add(i, p, SamplingParams(max_tokens=N_TOKENS, ignore_eos=True), depth)
    out = {i: [] for i in range(len(prompts))}
    while sched.has_work():
        for key, chunk in sched.step():
            assert not isinstance(chunk, Exception), chunk
            out[key] += chunk.token_ids
    return [out[i] for i in range(len(prompts))]


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_mtp_identical_to_plain_quantized(family, bits, quantized):
    lm = quantized(family, bits)
    calls = qmm_ext.calls()
    plain = [_greedy(lm, p, 0)[0] for p in PROMPTS]
    assert qmm_ext.calls() > calls  # the kernel computed the decode steps
    for depth in (1, 3):
        for p, ref in zip(PROMPTS, plain):
            ours, stats = _greedy(lm, p, depth)
            assert ours == ref, f"{family} {bits}-bit depth {depth}"
    assert stats.acceptance_rate > 0  # drafts were accepted: verify windows of several rows ran
    assert _batched(lm, PROMPTS, 2) == plain, f"{family} {bits}-bit batched"


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
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_6_moe"])
def test_plain_agrees_with_mlx_lm_on_the_same_quantized_model(family, bits, quantized, checkpoint_dir):
    """mlx-lm's greedy output (its kernels) on the same quantized weights: identical,
    or diverging first at a near tie (top-two logits within 1e-4), as in test_greedy_identity."""
    lm = quantized(family, bits)
    path = checkpoint_dir(family, agreeable=True, **QUANT_TEXT)
    agree = total = 0
    for p in PROMPTS:
        ref, gaps = _mlx_lm_greedy(path, p, bits, 64 if bits == 4 else 32)
        ours, _ = _greedy(lm, p, 0)
        first = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        assert first is None or gaps[first] < 1e-4, f"token {first} differs with reference gap {gaps[first]:.3g}"
        agree += len(ref) if first is None else first
        total += len(ref)
    print(f"{family} {bits}-bit: {agree}/{total} tokens agree with mlx-lm's greedy output")


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
        assert "quantized weights: mtp-serve's kernel" in decode_matmuls_note(threads)
    finally:
        set_decode_blas_threads(None)

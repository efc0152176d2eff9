"""The CPU prefill path (blockwise attention, fast exp-based activations)
computes what mlx-lm computes, to fp32 rounding.

References are mlx-lm's own functions and modules: its attention
(`scaled_dot_product_attention`, i.e. MLX's fused op with the causal mask),
mlx-lm's decoder layers with a KVCache, and MLX's sigmoid / SiLU.
"""

import mtp_serve  # noqa: F401  (before mlx.core)

import os
import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache

from mtp_serve.models import fast_math
from mtp_serve.models.prefill_attention import KEY_STEP, causal_attention
from mtp_serve.models.prefill_layers import PrefillLayers

RTOL = 1e-5  # max error relative to the reference's largest magnitude


def rel_err(a: mx.array, b: mx.array) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))


@pytest.mark.parametrize(
    "B, H, Hk, L, S, rows",
    [
        (1, 4, 2, 9, 9, None),  # shortest prefill input, no cache
        (1, 4, 4, 100, 100, 16),  # several blocks, partial last one
        (2, 8, 2, 37, 900, None),  # existing cache (offset 863), batch of 2, 4 heads per key head
        (1, 4, 1, 64, KEY_STEP + 64, 16),  # blocks right after a KEY_STEP boundary
        (1, 2, 2, 300, 2 * KEY_STEP + 77, 32),  # offset not a multiple of anything
    ],
)
def test_matches_mlx_lm_attention(B, H, Hk, L, S, rows):
    D = 32
    mx.random.seed(S + L)
    q = mx.random.normal((B, H, L, D))
    k = mx.random.normal((B, Hk, S, D))
    v = mx.random.normal((B, Hk, S, D))
    scale = D**-0.5 * 3  # peaky softmax: large exponents, many tiny weights
    ref = scaled_dot_product_attention(q, k, v, cache=None, scale=scale, mask="causal")
    out = causal_attention(q, k, v, scale, rows=rows)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) < RTOL


def test_same_bits_on_one_stream_or_several(monkeypatch):
    """The blocks of a wave run on one CPU stream per core; how many cores there
    are, or which thread asks, must not change a bit of the result (a prompt
    restored from a cache snapshot continues exactly as one prefilled cold)."""
    import mtp_serve.models.prefill_attention as pa

    mx.random.seed(5)
    q, k, v = mx.random.normal((1, 8, 200, 32)), mx.random.normal((1, 4, 700, 32)), mx.random.normal((1, 4, 700, 32))
    several = causal_attention(q, k, v, 0.2, rows=32)
    assert len(pa._streams(100)) == min(100, os.cpu_count() or 1)  # (on a machine with one core, both are one stream)
    elsewhere = []  # MLX streams are per thread: the engine loop's thread gets its own
    worker = threading.Thread(target=lambda: elsewhere.append(np.array(causal_attention(q, k, v, 0.2, rows=32))))
    worker.start()
    worker.join()
    assert np.array_equal(np.array(several), elsewhere[0])
    monkeypatch.setattr(pa, "_streams", lambda blocks: [mx.default_stream(mx.cpu)])
    one = causal_attention(q, k, v, 0.2, rows=32)
    assert mx.array_equal(several, one).item()


def test_exp_functions_match_mlx():
    x = mx.concatenate([mx.random.normal((4000,)) * 20, mx.array([0.0, -0.0, 1e-30, 43.0, -43.0, 88.0, -88.0, 1e4, -1e4])])
    rows = x[: 64 * 62].reshape(64, 62)  # a ROW_STEP multiple: the fixed form
    odd = x[: 37 * 7].reshape(37, 7)  # fewer rows than ROW_STEP: the shapeless form
    for a in (rows, odd, x.reshape(1, -1)):
        assert mx.abs(fast_math.sigmoid(a) - mx.sigmoid(a)).max().item() < 2e-7
        y = nn.silu(a)
        assert (mx.abs(fast_math.silu(a) - y) / (1 + mx.abs(y))).max().item() < 2e-7
        u = mx.random.normal(a.shape)
        ref = nn.silu(a) * u
        assert (mx.abs(fast_math.swiglu(a, u) - ref) / (1 + mx.abs(ref))).max().item() < 2e-7
    s = mx.random.normal((2, 300, 8)) * 30
    m = s.max(1, keepdims=True)
    ref = mx.exp(s - m)
    for e in (fast_math.exp_shifted.fixed(s, m), fast_math.exp_shifted.anyshape(s, m)):
        # exact to fp32 rounding down to e^-43, where it saturates at 2^-62
        assert mx.all(mx.abs(e - ref) <= 2e-7 * ref + 2.0**-62).item()


def test_prefill_layers_match_mlx_lm_layers(loaded):
    """Decoder layers over a long input with an existing cache: PrefillLayers
    against mlx-lm's own layers (each on its own copy of the caches)."""
    model = loaded("qwen3_5").model
    prefill = PrefillLayers()
    mx.random.seed(3)
    tokens = mx.random.randint(0, model.vocab_size, (1, 160))
    caches = {"ref": model.make_cache(), "new": model.make_cache()}
    for chunk in (slice(0, 90), slice(90, 160)):  # the second chunk attends to a cache of 90
        outs = {}
        for name, cache in caches.items():
            h = model.inner.embed_tokens(tokens[:, chunk])
            for layer, c in zip(model.layers, cache):
                mask = "causal" if not layer.is_linear else None
                h = layer(h, mask=mask, cache=c) if name == "ref" else prefill(layer, h, mask, c)
            outs[name] = h
        assert rel_err(outs["new"], outs["ref"]) < RTOL
    for c_ref, c_new in zip(caches["ref"], caches["new"]):
        for (_, a), (_, b) in zip(tree_flatten(c_ref.state), tree_flatten(c_new.state)):
            assert (a is None and b is None) or rel_err(b, a) < RTOL


def test_model_forward_uses_prefill_path_and_matches(loaded):
    """MTPModel.forward over a chunked long prompt, and the head over it, give the
    logits mlx-lm's layers give (model.prefill = None runs those)."""
    model = loaded("qwen3_5").model
    tokens = mx.random.randint(0, model.vocab_size, (1, 120))
    assert isinstance(model.prefill, PrefillLayers)
    logits, drafts = {}, {}
    try:
        for name, prefill in (("new", model.prefill), ("ref", None)):
            model.prefill, out = prefill, []
            cache, head_cache = model.make_cache(), model.make_head_cache()
            for i in range(0, 120, 40):  # chunks after the first attend to a cache
                hidden, lg = model.forward(tokens[:, i : i + 40], cache)
                _, dl = model.draft(hidden[:, :-1], tokens[:, i + 1 : i + 40], head_cache)
                out.append(lg)
                drafts.setdefault(name, []).append(dl)
            logits[name] = mx.concatenate(out, axis=1)
    finally:
        model.prefill = PrefillLayers()
    assert rel_err(logits["new"], logits["ref"]) < RTOL
    for a, b in zip(drafts["new"], drafts["ref"]):
        assert rel_err(a, b) < RTOL


def test_full_attention_matches_mlx_attention():
    """The vision tower's unmasked attention over an image's patches, blockwise on CPU."""
    from mtp_serve.models.prefill_attention import full_attention

    for n, heads in ((300, 3), (1100, 2)):
        q, k, v = (mx.random.normal((1, heads, n, 32), key=mx.random.key(i)) for i in range(3))
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=32 ** -0.5)
        out = full_attention(q, k, v, 32 ** -0.5)
        assert out.shape == ref.shape and float(mx.abs(out - ref).max()) < 1e-5

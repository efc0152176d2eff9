"""Decode attention over long caches: the native kernel (`quantized_attention.attention_rows`)
scores a verify window over 8k+ keys as single steps would, bit for bit, at every row (full
precision, 8-bit and 4-bit KV), a row in a batch (left padding, rolled-back holes) as it
scores alone, with the query rows blocked over key tiles (four-row blocks, or tiles of rows x keys
reduced together) as with each row alone (a mutated tile reduction fails that check), and matches
mlx-lm's attention to fp32 rounding; greedy MTP stays token-identical to plain decoding after a
long prompt at each KV setting."""

import mlx.core as mx
import numpy as np
import pytest

from mtp_serve.engine.generator import generate
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.models import quantized_attention
from mtp_serve.models.caches import FULL_KV, KVSetting, merge_kv, trim_per_row
from mtp_serve.models.mlx_lm_compat import scaled_dot_product_attention
from support.native import needs_qmm_kernel

SETTINGS = [FULL_KV, KVSetting(8, 64), KVSetting(4, 64)]
IDS = ["full", "q8", "q4"]
B, HQ, HKV, D = 1, 4, 2, 64
SCALE = 0.125

rng = np.random.default_rng(0)
needs_kernel = needs_qmm_kernel()


def normal(*shape):
    return mx.array(rng.standard_normal(shape).astype(np.float32))


def filled(kv, n, rows=1):
    """A cache at setting `kv` holding n random entries (a batch of `rows` single caches merged: n[i] each)."""
    lengths = n if isinstance(n, list) else [n]
    caches = []
    for length in lengths:
        c = kv.make()
        c.update_and_fetch(normal(1, HKV, length, D), normal(1, HKV, length, D))
        caches.append(c)
    return caches[0] if len(caches) == 1 else merge_kv(caches)


def step(cache, q, k, v, mask):
    """One attention call as a decoder layer makes it: the cache updated with k, v, then attention."""
    keys, values = cache.update_and_fetch(k, v)
    out = quantized_attention.attention_rows(q, keys, values, cache, SCALE, mask)
    assert out is not None, "the native kernel did not take this step"
    return out, keys, values


def reference(q, keys, values, cache, mask):
    """mlx-lm's attention (on a copy of q: its quantized form scales the queries in place)."""
    return scaled_dot_product_attention(mx.array(q), keys, values, cache=cache, scale=SCALE, mask=mask)


@needs_kernel
@pytest.mark.parametrize("kv", SETTINGS, ids=IDS)
@pytest.mark.parametrize("T", [4, 8, 33])
def test_window_over_8k_keys_scores_every_row_as_its_single_step(kv, T):
    S = 8300
    cache = filled(kv, S - T)
    q, k, v = normal(B, HQ, T, D), normal(B, HKV, T, D), normal(B, HKV, T, D)
    window, keys, values = step(cache, q, k, v, "causal")
    assert mx.allclose(window, reference(q, keys, values, cache, "causal"), atol=1e-5, rtol=1e-4).item()
    for t in range(T):  # back to the state before the window, then row t's single step
        cache.trim(cache.offset - (S - T + t))
        one, _, _ = step(cache, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], None)
        assert mx.array_equal(one[:, :, 0], window[:, :, t]).item(), f"row {t}"
        cache.update_and_fetch(k[:, :, t + 1 :], v[:, :, t + 1 :])


@needs_kernel
@pytest.mark.parametrize("kv", SETTINGS, ids=IDS)
def test_a_row_in_a_batch_scores_as_it_does_alone(kv):
    """Rows of different lengths (left padding), one of them with rolled-back entries (holes):
    each row's window equals, bit for bit, the same window on its own single cache."""
    lengths, T = [8200, 3000], 4
    batch = filled(kv, lengths, rows=2)
    singles = [filled(kv, n) for n in lengths]
    for c, b_row in zip(singles, range(2)):  # the same entries as the batch's rows
        c.keys, c.values = (batch.extract(b_row).keys, batch.extract(b_row).values)
    k0, v0 = normal(2, HKV, 3, D), normal(2, HKV, 3, D)  # a window both rows take, then rows 0 and 1 drop 1 and 3
    batch.update_and_fetch(k0, v0)
    trim_per_row(batch, [1, 3])
    for i, c in enumerate(singles):
        c.update_and_fetch(k0[i : i + 1], v0[i : i + 1])
        trim_per_row(c, [[1, 3][i]])
    q, k, v = normal(2, HQ, T, D), normal(2, HKV, T, D), normal(2, HKV, T, D)
    mask = batch.make_mask(T, return_array=True)
    together, keys, values = step(batch, q, k, v, mask)
    assert mx.allclose(together, reference(q, keys, values, batch, mask), atol=1e-5, rtol=1e-4).item()
    for i, c in enumerate(singles):
        alone, _, _ = step(c, q[i : i + 1], k[i : i + 1], v[i : i + 1], "causal")
        assert mx.array_equal(alone, together[i : i + 1]).item(), f"row {i}"


FORMS = {"tiles": (True, True, True), "wide": (True, True, False), "8-lane": (True, False, False),
         "alone": (False, False, False)}  # set_row_blocks(on, wide, tiles); wide and tiles: AVX-512 where the CPU has it


def blocked_and_alone(kv, T, forms=FORMS):
    """A window (causal, 8k+ keys) and a padded batch of T rows per sequence through each form."""
    cache = filled(kv, 8300 - T)
    q, k, v = normal(B, HQ, T, D), normal(B, HKV, T, D), normal(B, HKV, T, D)
    keys, values = cache.update_and_fetch(k, v)
    batch = filled(kv, [4100, 700], rows=2)
    qb, kb, vb = normal(2, HQ, T, D), normal(2, HKV, T, D), normal(2, HKV, T, D)
    bmask = batch.make_mask(T, return_array=True)
    bkeys, bvalues = batch.update_and_fetch(kb, vb)
    outs = {}
    try:
        for form in forms:
            assert quantized_attention.set_row_blocks(*FORMS[form])
            window = quantized_attention.attention_rows(q, keys, values, cache, SCALE, "causal" if T > 1 else None)
            rows = quantized_attention.attention_rows(qb, bkeys, bvalues, batch, SCALE, bmask)
            mx.eval(window, rows)
            outs[form] = (window, rows)
    finally:
        quantized_attention.set_row_blocks(True)
    return outs, reference(q, keys, values, cache, "causal" if T > 1 else None)


@needs_kernel
@pytest.mark.parametrize("kv", SETTINGS, ids=IDS)
@pytest.mark.parametrize("T", [1, 5, 16, 33])
def test_rows_blocked_over_key_tiles_give_each_row_alone_bits(kv, T):
    """Blocking the rows that share a key tile (four-row blocks; tiles of 8 or 4 rows x several
    keys, runs of rows taken whole and the rest in blocks) changes which loads serve which rows,
    never a row's bits: a window and a padded batch, each form against row by row."""
    outs, ref = blocked_and_alone(kv, T)
    for form in ("tiles", "wide", "8-lane"):
        assert mx.array_equal(outs[form][0], outs["alone"][0]).item(), form
        assert mx.array_equal(outs[form][1], outs["alone"][1]).item(), form
    assert mx.allclose(outs["tiles"][0], ref, atol=1e-5, rtol=1e-4).item()


@needs_kernel
def test_row_check_catches_tiles_that_sum_in_another_tree():
    """Negative control: with the tiles' reduction mutated to another addition tree, the check
    above finds the tiled window's rows differ from the rows alone."""
    ext = quantized_attention.rows_kernel()
    if not ext.tiles_supported():
        pytest.skip("the tiles need AVX-512 (this CPU takes the four-row blocks)")
    ext.set_tile_mutation(True)
    try:
        outs, _ = blocked_and_alone(FULL_KV, 33, forms=("tiles", "alone"))
    finally:
        ext.set_tile_mutation(False)
    assert not mx.array_equal(outs["tiles"][0], outs["alone"][0]).item()


def generated(lm, prompt, depth, max_tokens=24):
    out, stats = [], None
    for chunk in generate(lm.model, lm.tokenizer, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), depth):
        out += chunk.token_ids
        stats = chunk.stats
    return out, stats


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("kv", SETTINGS, ids=IDS)
def test_greedy_mtp_equals_plain_after_a_long_prompt(kv, loaded, monkeypatch):
    """An 8.2k-token prompt on a synthetic Qwen3.5 model (head_dim 64, so every decode and verify
    attention runs on the native kernel): MTP at depth 3 emits plain decoding's tokens."""
    lm = loaded("qwen3_5", agreeable=True, head_dim=64)
    lm.model.use_kv(kv)
    taken = []
    native = quantized_attention.attention_rows
    monkeypatch.setattr(quantized_attention, "attention_rows", lambda *a: taken.append(a[0].shape[2]) or native(*a))
    try:
        prompt = rng.integers(0, 250, 8200).tolist()
        plain, _ = generated(lm, prompt, 0)
        ours, stats = generated(lm, prompt, 3)
        assert ours == plain and sum(stats.accepted) > 0
    finally:
        lm.model.use_kv(FULL_KV)
    assert 1 in taken and 4 in taken  # single steps and depth-3 windows

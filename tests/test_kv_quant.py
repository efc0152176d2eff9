"""Quantized attention KV (--kv-bits 8|4): greedy MTP output is token-identical to
greedy plain output at the same setting (single, batched, after a prompt-cache
restore from memory and from disk, every family); rolled-back rows hold what a
cold forward at that setting holds; the prompt cache counts quantized blocks at
their real bytes and never mixes settings; the server says which setting it runs.

The synthetic checkpoints here have head_dim 32 (MLX quantizes in groups of 32,
64 or 128 along the head dimension), so the group size is 32.
"""

import re

import httpx
import mlx.core as mx
import numpy as np
import pytest

from mtp_serve.engine.batch import Batch
from mtp_serve.engine.generator import generate
from mtp_serve.engine.policy import DepthPolicy
from mtp_serve.engine.prefill import prefill
from mtp_serve.engine.prompt_cache import PromptCache
from mtp_serve.engine.prompt_cache.disk import DiskTier
from mtp_serve.engine.prompt_cache.setup import snapshot_costs
from mtp_serve.engine.prompt_cache.snapshot import block_hashes, kv_salt, materialize, snapshot_key
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.engine.scheduler import Scheduler
from mtp_serve.engine.sequence import new_sequence
from mtp_serve.engine.speculative import accept, commit, draft, verify
from mtp_serve import quantized_matmul as qmm_ext
from mtp_serve.models import prefill_layers, quantized_attention
from mtp_serve.models.caches import (FULL_KV, KVSetting, QuantizedKVCache, RollbackBatchQuantizedKVCache,
                                     SpeculativeGDNCache, kv_arrays, merge_kv)
from mtp_serve.models.fingerprint import weights_fingerprint
from mtp_serve.models.loader import weight_files
from mtp_serve.models.mlx_lm_compat import quantized_scaled_dot_product_attention, scaled_dot_product_attention
from mtp_serve.testing.server_process import ServerProcess
from mtp_serve.testing.synthetic import MLX_LM_FAMILIES
from support.native import needs_qmm_kernel

GROUP = 32
SETTINGS = [KVSetting(8, GROUP), KVSetting(4, GROUP)]
IDS = [s.tag for s in SETTINGS]

rng = np.random.default_rng(0)
SHARED = rng.integers(0, 250, 300).tolist()  # one full block and a tail
CONV_A = SHARED + rng.integers(0, 250, 60).tolist()
CONV_B = SHARED + rng.integers(0, 250, 180).tolist()


@pytest.fixture
def at(loaded):
    """at(family, kv): the agreeable synthetic model (head_dim 32) keeping KV at `kv`."""
    used = []

    def get(family, kv):
        lm = loaded(family, agreeable=True, head_dim=32)
        lm.model.use_kv(kv)
        used.append(lm)
        return lm

    yield get
    for lm in used:
        lm.model.use_kv(FULL_KV)


def run(lm, prompt, depth, cache=None, max_tokens=32, checkpoints=()):
    out, stats = [], None
    for chunk in generate(lm.model, lm.tokenizer, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), depth,
                          cache, checkpoints=checkpoints):
        out += chunk.token_ids
        stats = chunk.stats
    return out, stats


def drive(lm, prompts, depth, arrivals, prefill_chunk=8):
    sched = Scheduler(lm.model, lm.tokenizer, max_batch_size=8, prefill_chunk=prefill_chunk,
                      policy=DepthPolicy(max_depth=depth, fixed=True))
    out = {k: [] for k in prompts}
    step = 0
    while step == 0 or sched.has_work() or any(a >= step for a in arrivals.values()):
        for k, a in arrivals.items():
            if a == step:
                sched.add(k, prompts[k], SamplingParams(max_tokens=28, ignore_eos=True), depth)
        for key, chunk in sched.step():
            assert not isinstance(chunk, Exception), chunk
            out[key] += chunk.token_ids
        step += 1
        assert step < 2000
    return out


# ---------------------------------------------------------------- the caches alone


def kv(n, H=2, D=64):
    return tuple(mx.array(rng.standard_normal((1, H, n, D)).astype(np.float32)) for _ in range(2))


def check_rows(batch, rows):
    """Each row of the batched cache holds its own cache's bits and attends as it does."""
    assert batch.offset.tolist() == [r.offset for r in rows]
    q = mx.array(rng.standard_normal((len(rows), 4, 1, 64)).astype(np.float32))
    k, v = batch.keys_and_values()
    out = scaled_dot_product_attention(mx.array(q), k, v, cache=batch, scale=0.125, mask=batch.make_mask(1)[..., :-1])
    for i, ref in enumerate(rows):
        got = batch.extract(i)
        assert isinstance(got, QuantizedKVCache) and got.offset == ref.offset
        rk, rv = ref.keys_and_values()
        for a, b in zip(kv_arrays(got.keys) + kv_arrays(got.values), kv_arrays(rk) + kv_arrays(rv)):
            assert mx.array_equal(a, b).item()
        want = scaled_dot_product_attention(mx.array(q[i : i + 1]), rk, rv, cache=ref, scale=0.125, mask=None)
        assert mx.allclose(out[i : i + 1], want, atol=1e-5).item()


@pytest.mark.parametrize("kv_setting", [KVSetting(8, 64), KVSetting(4, 64)], ids=["q8", "q4"])
def test_quantized_rows_roll_back_independently_through_leave_and_join(kv_setting):
    rows = []
    for n in (5, 9, 2):
        c = kv_setting.make()
        c.update_and_fetch(*kv(n))
        rows.append(c)
    batch = merge_kv(rows)
    assert isinstance(batch, RollbackBatchQuantizedKVCache) and batch.bits == kv_setting.bits
    saw_holes = False
    for step in range(10):
        new_k, new_v = kv(3)
        ks = mx.concatenate([new_k] * len(rows)) + mx.arange(len(rows)).reshape(-1, 1, 1, 1)
        vs = mx.concatenate([new_v] * len(rows)) - mx.arange(len(rows)).reshape(-1, 1, 1, 1)
        batch.update_and_fetch(ks, vs)
        rejected = [int(x) for x in rng.integers(0, 3, size=len(rows))]
        for i, (r, n) in enumerate(zip(rows, rejected)):
            r.update_and_fetch(ks[i : i + 1], vs[i : i + 1])
            r.trim(n)
        batch.trim_rows(rejected)
        saw_holes |= batch.holes is not None and bool(batch.holes.any().item())
        check_rows(batch, rows)
        if step == 3:  # row 1 leaves
            batch.filter(mx.array([0, 2]))
            rows = [rows[0], rows[2]]
            check_rows(batch, rows)
        if step == 6:  # a newcomer joins
            c = kv_setting.make()
            c.update_and_fetch(*kv(11))
            batch.extend(merge_kv([c]))
            rows.append(c)
            check_rows(batch, rows)
    assert saw_holes
    empty = merge_kv([kv_setting.make(), kv_setting.make()])
    assert isinstance(empty, RollbackBatchQuantizedKVCache) and empty.bits == kv_setting.bits


def test_settings_are_checked_and_counted():
    with pytest.raises(ValueError, match="head dimension 48"):
        KVSetting(8, 32).check([48])
    with pytest.raises(ValueError, match="--kv-bits"):
        KVSetting(3, 64).check([64])
    assert KVSetting(8, 64).bytes_per_vector(128, 2) == 128 + 2 * 2 * 2  # bf16: about half
    assert KVSetting(4, 64).bytes_per_vector(128, 4) == 64 + 2 * 2 * 4


# ---------------------------------------------------------------- exactness within a setting


@pytest.mark.parametrize("kv_setting", SETTINGS, ids=IDS)
@pytest.mark.parametrize("family", MLX_LM_FAMILIES + ("qwen4_exp",))
def test_greedy_mtp_equals_plain_single_and_batched(family, kv_setting, at):
    lm = at(family, kv_setting)
    prompts = {"a": [5, 17, 99, 3, 42, 7, 250, 11], "b": list(range(30, 130, 3)), "c": [200] * 5 + [201, 202]}
    plain = {k: run(lm, p, 0, max_tokens=28)[0] for k, p in prompts.items()}
    accepted = 0
    for k, p in prompts.items():
        ours, stats = run(lm, p, 2, max_tokens=28)
        assert ours == plain[k], f"{family} {kv_setting.tag} prompt {k}: MTP differs from plain"
        accepted += sum(stats.accepted)
    assert accepted > 0
    batched = drive(lm, prompts, 2, {"a": 0, "b": 1, "c": 4})
    assert batched == plain


@pytest.mark.parametrize("kv_setting", SETTINGS, ids=IDS)
def test_rejecting_rows_hold_what_a_cold_forward_holds(kv_setting, at):
    """Three rows at depths 3, 1, 0: after rounds with partial acceptance, each row's
    quantized KV (backbone and head) equals a cold forward's over its committed tokens
    at the same setting: the same entries, nothing of a rejected draft left."""
    lm = at("qwen3_5", kv_setting)
    model = lm.model
    prompts = {"a": [3, 14, 15, 92, 65, 35], "b": list(range(40, 60)), "c": [9] * 12}
    batch = Batch()
    committed = {}
    for key, prompt in prompts.items():
        seq = new_sequence(model, lm.tokenizer, key, prompt, SamplingParams(max_tokens=200, ignore_eos=True), 3)
        committed[key] = prefill(model, seq)[0]
        batch.add(seq)
    assert isinstance(batch.cache[1], RollbackBatchQuantizedKVCache)
    seen_partial = False
    for _ in range(12):
        drafts = draft(model, batch, [3, 1, 0])
        accepted = accept(verify(model, batch, drafts), batch.rows)
        commit(batch, accepted)
        for s, tokens in zip(batch.rows, accepted.tokens):
            committed[s.key] += tokens
        seen_partial |= 0 < accepted.counts[0] < 3
    assert seen_partial
    for s in batch.rows:
        tokens = prompts[s.key] + committed[s.key][:-1]
        caches = batch.row_caches(s)
        cold = model.make_cache()
        hidden, _ = model.forward(mx.array([tokens]), cold)
        for ours, ref in zip(caches.backbone, cold):
            if isinstance(ours, SpeculativeGDNCache):
                continue
            assert isinstance(ours, QuantizedKVCache) and ours.offset == ref.offset == len(tokens)
            assert_same_quantized(ours, ref, ref.offset)
        n = caches.head.offset
        head_ref = model.make_head_cache()
        model.draft(hidden[:, :n], mx.array([tokens[1 : n + 1]]), head_ref)
        assert_same_quantized(caches.head, head_ref, n)


@pytest.mark.parametrize("kv_setting", SETTINGS, ids=IDS)
def test_qwen4_exp_rejected_verify_leaves_the_quantized_and_indexer_keys_of_plain_steps(kv_setting, at):
    """qwen4_exp keeps its indexer's keys in the layer's KV cache: a captured verify of 4 tokens
    cut at 1 leaves the quantized keys and values and the (full-precision) indexer keys of
    plain steps over the kept token, and the next logits are plain steps' bit for bit."""
    from mtp_serve.models.caches import keep_verified, set_capture
    from mtp_serve.models.qwen4_exp import IndexedQuantizedKVCache

    model = at("qwen4_exp", kv_setting).model
    prompt, window = [5, 17, 257, 3, 42, 7, 9, 250, 11], [12, 13, 14, 15]
    spec, plain = model.make_cache(), model.make_cache()
    for c in (spec, plain):
        model.forward(mx.array([prompt]), c)
    set_capture(spec, True)
    model.forward(mx.array([window]), spec)
    set_capture(spec, False)
    keep_verified(spec, [1], len(window))
    model.forward(mx.array([window[:1]]), plain)
    indexed = [(a, b) for a, b in zip(spec, plain) if not isinstance(a, SpeculativeGDNCache)]
    assert indexed and all(isinstance(a, IndexedQuantizedKVCache) and a.bits == kv_setting.bits for a, _ in indexed)
    n = len(prompt) + 1
    for a, b in indexed:
        assert a.offset == b.offset == n
        assert_same_quantized(a, b, n)
        assert mx.allclose(a.index_keys[:, :n], b.index_keys[:, :n], atol=1e-6).item()
    la = model.forward(mx.array([[99]]), spec)[1]
    lb = model.forward(mx.array([[99]]), plain)[1]
    assert mx.allclose(la, lb, atol=1e-5).item()
    assert snapshot_costs(model).kv_bytes_per_token == model.kv_bytes_per_token()  # the indexer keys counted


def assert_same_quantized(ours, ref, n):
    """Dequantized entries agree within one quantization step (a cold forward computes the
    same values up to fp32 rounding, which may move a value across a rounding boundary),
    and almost every packed word is identical."""
    for a, b in ((ours.keys, ref.keys), (ours.values, ref.values)):
        a, b = tuple(x[..., :n, :] for x in a), tuple(x[..., :n, :] for x in b)
        da = mx.dequantize(*a, group_size=ours.group_size, bits=ours.bits)
        db = mx.dequantize(*b, group_size=ours.group_size, bits=ours.bits)
        step = mx.repeat(mx.maximum(mx.abs(a[1]), mx.abs(b[1])), ours.group_size, axis=-1)
        assert mx.all(mx.abs(da - db) <= step * 1.01 + 1e-5).item()
        assert mx.mean(a[0] == b[0]).item() > 0.99


def test_prefill_over_dequantized_kv_equals_mlx_lm_quantized_attention(at, monkeypatch):
    """The blockwise CPU prefill attends over the cache's dequantized values: the logits of
    mlx-lm's quantized attention (scores through quantized_matmul) up to rounding (fp32, the
    fast exp, and a value that rounding moves across a quantization boundary), a small
    fraction of what quantizing the KV itself changes."""
    tokens = mx.array([CONV_A])
    lm = at("qwen3_5", FULL_KV)
    full = lm.model.forward(tokens, lm.model.make_cache())[1]
    lm.model.use_kv(KVSetting(8, GROUP))
    ours = lm.model.forward(tokens, lm.model.make_cache())[1]
    monkeypatch.setattr(prefill_layers, "DEQUANTIZE_QUANTIZED_KV", False)
    theirs = lm.model.forward(tokens, lm.model.make_cache())[1]
    gap, drift = mx.abs(ours - theirs).max().item(), mx.abs(ours - full).max().item()
    assert gap < 1e-3 and gap < 0.2 * drift, (gap, drift)
    assert mx.array_equal(mx.argmax(ours, -1), mx.argmax(theirs, -1)).item()


needs_kernel = needs_qmm_kernel()


@needs_kernel
@pytest.mark.parametrize("bits", [8, 4])
def test_native_quantized_attention_equals_mlx_lm_and_scores_a_window_as_single_steps(bits):
    """Decode and verify attention over quantized KV on the native kernel: mlx-lm's quantized
    attention up to fp32 rounding (a single row, a causal window, a batch with a holes mask),
    and each row of a 4-token window bit-identical to the single step at its position."""
    B, Hq, Hkv, S, D, T = 2, 4, 2, 300, 64, 4
    k, v = (mx.quantize(mx.array(rng.standard_normal((B, Hkv, S, D)).astype(np.float32)), group_size=64, bits=bits)
            for _ in range(2))
    q = mx.array(3 * rng.standard_normal((B, Hq, T, D)).astype(np.float32))
    holes = mx.array(rng.random((B, 1, T, S)) > 0.2) & (mx.arange(S - T, S)[:, None] >= mx.arange(S)[None])
    assert quantized_attention.native_supported(D, 64, bits, k[1].dtype)
    for qs, mask in ((q[:1, :, :1], None), (q[:1], "causal"), (q, holes)):
        sub = lambda p: tuple(a[: qs.shape[0]] for a in p)  # noqa: E731
        ours = quantized_attention.quantized_attention(qs, sub(k), sub(v), 0.125, mask, 64, bits)
        theirs = quantized_scaled_dot_product_attention(mx.array(qs), sub(k), sub(v), 0.125, mask, 64, bits)
        assert mx.allclose(ours, theirs, atol=1e-5, rtol=1e-5).item()
        # the cache's longer value buffer (entries past S unused) in place of the fetched slice: the same bits
        bufs = tuple(mx.concatenate([a, mx.ones_like(a[:, :, :7])], axis=2) for a in sub(v))
        from_buffers = quantized_attention.quantized_attention(qs, sub(k), sub(v), 0.125, mask, 64, bits, bufs)
        assert mx.array_equal(ours, from_buffers).item()
    one = lambda p, n: tuple(a[:1, :, :n] for a in p)  # noqa: E731
    window = quantized_attention.quantized_attention(q[:1], one(k, S), one(v, S), 0.125, "causal", 64, bits)
    for j in range(T):
        step = quantized_attention.quantized_attention(q[:1, :, j : j + 1], one(k, S - T + 1 + j), one(v, S - T + 1 + j),
                                                       0.125, None, 64, bits)
        assert mx.array_equal(step[:, :, 0], window[:, :, j]).item(), f"row {j}"


@needs_kernel
@pytest.mark.parametrize("kv_setting", [KVSetting(8, 64), KVSetting(4, 64)], ids=["q8g64", "q4g64"])
def test_greedy_mtp_equals_plain_on_the_native_quantized_attention(kv_setting, at, loaded, monkeypatch):
    """head_dim 64: both settings' decode and verify attention run on the native kernel
    (`attention_rows`, the whole attention in one primitive)."""
    lm = loaded("qwen3_5", agreeable=True, head_dim=64)
    lm.model.use_kv(kv_setting)
    used = []
    native = quantized_attention.attention_rows

    def recorded(*a):
        out = native(*a)
        used.append(out is not None)
        return out

    monkeypatch.setattr(quantized_attention, "attention_rows", recorded)
    try:
        prompts = {"a": [5, 17, 99, 3, 42, 7, 250, 11], "b": list(range(30, 130, 3))}
        plain = {k: run(lm, p, 0, max_tokens=28)[0] for k, p in prompts.items()}
        for k, p in prompts.items():
            ours, stats = run(lm, p, 2, max_tokens=28)
            assert ours == plain[k] and sum(stats.accepted) > 0, k
        assert drive(lm, prompts, 2, {"a": 0, "b": 1}) == plain
    finally:
        lm.model.use_kv(FULL_KV)
    assert used and all(used)


# ---------------------------------------------------------------- the prompt cache


def state_after(cache, tokens):
    caches, owed = materialize(cache.by_key[snapshot_key(tokens, kv_salt(cache.kv))], cache.blocks)
    arrays = []
    for c in caches.backbone + [caches.head]:
        arrays += [a for p in c.state[:2] for a in kv_arrays(p)] if hasattr(c, "keys") else list(c.cache)
        if getattr(c, "index_keys", None) is not None:  # qwen4_exp: the indexer's keys, the PLE windows
            arrays.append(c.index_keys[:, : c.offset])
        if getattr(c, "ple", None) is not None:
            arrays += [c.ple.ngram, c.ple.conv]
    return arrays + [owed]


def assert_same_state(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape and mx.array_equal(x, y).item()


@pytest.mark.parametrize("kv_setting", SETTINGS, ids=IDS)
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_6_moe", "qwen3_next", "qwen4_exp"])
def test_restored_from_memory_and_disk_equals_cold_plain(family, kv_setting, at, tmp_path):
    """Conversation B restores the quantized snapshot A left at the shared prefix, from
    memory and (in a restarted cache) from disk: its MTP output equals cold plain output at
    the same setting, and the restored state is bit for bit a cold prefill's."""
    lm = at(family, kv_setting)
    points = (len(SHARED),)
    fp = weights_fingerprint(weight_files(lm.path), f"kv={kv_setting.tag}")
    layout = tuple(layer.is_linear for layer in lm.model.layers)
    first = PromptCache(interval=256, disk=DiskTier(tmp_path, "m", fp, 1 << 30, layout, kv_setting), kv=kv_setting)
    run(lm, CONV_A, 2, first, checkpoints=points)
    warm, warm_stats = run(lm, CONV_B, 2, first, checkpoints=points)
    first.close()
    restarted = PromptCache(interval=256, disk=DiskTier(tmp_path, "m", fp, 1 << 30, layout, kv_setting), kv=kv_setting)
    from_disk, disk_stats = run(lm, CONV_B, 2, restarted, checkpoints=points)
    cold_cache = PromptCache(interval=256, kv=kv_setting)
    cold_plain, _ = run(lm, CONV_B, 0)
    cold, cold_stats = run(lm, CONV_B, 2, cold_cache, checkpoints=points)
    assert warm_stats.cached_tokens == len(SHARED) and first.counts["hits_ram"] >= 1
    assert disk_stats.cached_tokens == len(SHARED) and restarted.counts["hits_disk"] == 1
    assert warm == from_disk == cold == cold_plain
    assert warm_stats.accepted == cold_stats.accepted
    assert_same_state(state_after(first, CONV_B), state_after(cold_cache, CONV_B))
    restarted.close()


def test_snapshot_bytes_are_the_quantized_bytes(at):
    """Blocks hold the KV once at its real (quantized) size: 8-bit KV over fp32 compute
    takes 1 + 8/32 bytes a value instead of 4."""
    prompt = rng.integers(0, 250, 1100).tolist()
    sizes = {}
    for setting in (FULL_KV, KVSetting(8, GROUP), KVSetting(4, GROUP)):
        lm = at("qwen3_5", setting)
        cache = PromptCache(interval=256, kv=setting)
        run(lm, prompt, 2, cache, max_tokens=2)
        per_token = snapshot_costs(lm.model).kv_bytes_per_token
        assert per_token == lm.model.kv_bytes_per_token()
        full_blocks = len(prompt) // 256 * 256
        assert cache.blocks.nbytes <= per_token * full_blocks
        assert cache.blocks.nbytes >= per_token * (full_blocks - 256)  # (the head's entries lag one token)
        held = sum(a.nbytes for b in cache.blocks.blocks.values() for pair in b.kv + [b.head] if pair
                   for part in pair for a in kv_arrays(part))
        assert held == cache.blocks.nbytes
        sizes[setting.tag] = cache.blocks.nbytes
    D = 32  # head_dim: 8-bit = D bytes + 2 fp32 per group of 32; full = 4 D
    assert sizes["q8g32"] / sizes["full"] == pytest.approx((D + 8) / (4 * D), rel=0.01)
    assert sizes["q4g32"] / sizes["full"] == pytest.approx((D / 2 + 8) / (4 * D), rel=0.01)


def test_a_snapshot_is_never_restored_at_another_setting(at, tmp_path, caplog):
    q8, q4 = KVSetting(8, GROUP), KVSetting(4, GROUP)
    assert block_hashes(np.array(SHARED, np.int32), salt="") != block_hashes(np.array(SHARED, np.int32), salt=q8.tag)
    lm = at("qwen3_5", q8)
    # Quantized caches offered to a full-precision prompt cache: refused (logged), the request still served.
    full = PromptCache(interval=0)
    out, _ = run(lm, CONV_A, 2, full, checkpoints=(len(SHARED),))
    assert len(out) == 32 and len(full) == 0 and "q8g32 offered to a prompt cache at KV full" in caplog.text
    # Files written at 8 bits in a folder read at 4 bits (the same weights fingerprint on purpose):
    # the index is not trusted, every file is skipped, the prompt prefills.
    fp = weights_fingerprint(weight_files(lm.path))
    layout = tuple(layer.is_linear for layer in lm.model.layers)
    first = PromptCache(interval=0, disk=DiskTier(tmp_path, "m", fp, 1 << 30, layout, q8), kv=q8)
    run(lm, CONV_A, 2, first, checkpoints=(len(SHARED),))
    first.close()
    assert len(first.disk) >= 2
    other = PromptCache(interval=0, disk=DiskTier(tmp_path, "m", fp, 1 << 30, layout, q4), kv=q4)
    assert len(other.disk) == 0 and other.disk.stats["skipped_files"] > 0
    lm.model.use_kv(q4)
    _, stats = run(lm, CONV_B, 2, other, checkpoints=(len(SHARED),))
    assert stats.cached_tokens == 0 and other.counts["hits_disk"] == 0
    with pytest.raises(ValueError):
        PromptCache(disk=first.disk, kv=q4)


# ---------------------------------------------------------------- the server


@pytest.mark.e2e
def test_server_reports_its_kv_setting(checkpoint_dir):
    path = checkpoint_dir("qwen3_5", agreeable=True, head_dim=32)
    with ServerProcess(["--model", path, "--enable-mtp", "--mtp-depth", "2", "--kv-bits", "4", "--kv-group-size", "32",
                        "--prompt-cache-bytes", "64M"]) as server:
        r = httpx.post(server.base_url + "/completions", json={"prompt": "abc", "max_tokens": 8}, timeout=60)
        assert r.status_code == 200
        metrics = httpx.get(server.root + "/metrics", timeout=10).text
        log = server.stop()
    assert 'mtp_kv_bits{setting="q4g32"} 4.0' in metrics
    per_token = float(re.search(r"^mtp_kv_bytes_per_token (\S+)", metrics, re.M).group(1))
    assert per_token == 2 * 3 * 2 * (16 + 2 * 4)  # (2 attention layers + the head) x 2 KV heads x K and V
    # head_dim 32 at 4 bits is narrower than the native kernel's chunk: mlx-lm's attention computes
    assert "KV 4-bit, groups of 32 (288 bytes a token; decode attention: mlx-lm's quantized attention)" in log

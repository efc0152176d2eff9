"""The prompt cache in the engine: a restored snapshot is exactly the state a cold
prefill computes (MTP head included: the same drafts, the same acceptance),
snapshots sharing a prefix share its KV, eviction keeps shared prefixes, the
disk tier survives a restart, stays within its budget and skips bad files."""

import logging
import shutil

import mlx.core as mx
import numpy as np
import pytest

from mtp_serve.engine.generator import generate
from mtp_serve.engine.policy import DepthPolicy
from mtp_serve.engine.prompt_cache import PromptCache
from mtp_serve.engine.prompt_cache.disk import DiskTier
from mtp_serve.engine.prompt_cache.setup import snapshot_costs
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.engine.scheduler import Scheduler
from mtp_serve.engine.prompt_cache.snapshot import materialize, snapshot_key
from mtp_serve.models.fingerprint import weights_fingerprint
from mtp_serve.models.loader import weight_files

rng = np.random.default_rng(0)
SHARED = rng.integers(0, 250, 300).tolist()  # a "system prompt": 300 tokens, one full block and a tail
CONV_A = SHARED + rng.integers(0, 250, 60).tolist()
CONV_B = SHARED + rng.integers(0, 250, 450).tolist()  # crosses more block and interval boundaries


def run(lm, prompt, cache, depth=2, max_tokens=16):
    out, stats = [], None
    for chunk in generate(lm.model, lm.tokenizer, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), depth,
                          cache, checkpoints=(len(SHARED),)):
        out += chunk.token_ids
        stats = chunk.stats
    return out, stats


def state_after(cache, tokens):
    """The state stored after `tokens` (the snapshot the scheduler takes after a prompt)."""
    caches, owed = materialize(cache.by_key[snapshot_key(tokens)], cache.blocks)
    arrays = [a for c in caches.backbone for a in (c.state[:2] if hasattr(c, "keys") else c.cache)]
    for c in caches.backbone:  # qwen4_exp: the indexer's keys, the PLE windows
        if getattr(c, "index_keys", None) is not None:
            arrays.append(c.index_keys[:, : c.offset])
        if getattr(c, "ple", None) is not None:
            arrays += [c.ple.ngram, c.ple.conv]
    return arrays + list(caches.head.state[:2]) + [owed]


def assert_same_state(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape and mx.array_equal(x, y).item()


def disk_tier(lm, root, max_bytes=1 << 30, name="m"):
    fp = weights_fingerprint(weight_files(lm.path))
    return DiskTier(root, name, fp, max_bytes, tuple(layer.is_linear for layer in lm.model.layers))


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "qwen4_exp"])
def test_restored_state_equals_a_cold_prefill(family, loaded):
    """Conversation B starts from the snapshot conversation A left at the end of the shared
    prefix: every cache (backbone KV, GatedDeltaNet states, qwen4_exp's indexer keys and PLE
    windows, the head's KV and owed hiddens)
    ends up bit for bit as a cold prefill leaves it, so B's tokens, drafts and acceptance
    equal the cold run's."""
    lm = loaded(family, agreeable=True)
    warm_cache, cold_cache = PromptCache(interval=256), PromptCache(interval=256)
    run(lm, CONV_A, warm_cache)
    warm, warm_stats = run(lm, CONV_B, warm_cache)
    cold, cold_stats = run(lm, CONV_B, cold_cache)
    assert (warm_stats.cached_tokens, cold_stats.cached_tokens) == (len(SHARED), 0)
    assert warm == cold
    assert warm_stats.drafted == cold_stats.drafted and warm_stats.accepted == cold_stats.accepted
    assert sum(warm_stats.accepted) > 0
    assert_same_state(state_after(warm_cache, CONV_B), state_after(cold_cache, CONV_B))


def test_snapshots_of_one_prompt_share_its_kv(loaded):
    lm = loaded("qwen3_5")
    cache = PromptCache(interval=256)
    prompt = rng.integers(0, 250, 2100).tolist()
    run(lm, prompt, cache, max_tokens=2)
    costs = snapshot_costs(lm.model)
    assert len(cache) >= 9  # every 256 tokens, the shared prefix, the end of the prompt
    # The KV once, in blocks (each token in exactly one block); each snapshot adds its own
    # states and a tail shorter than a block.
    assert cache.blocks.nbytes <= costs.kv_bytes_per_token * len(prompt)
    per_snapshot = costs.state_bytes + costs.kv_bytes_per_token * 256 + 4 * 2100 + 4096
    assert cache.own_bytes < len(cache) * per_snapshot
    assert cache.nbytes < costs.kv_bytes_per_token * len(prompt) * 2  # a copy per snapshot would be 9x


def test_over_budget_the_oldest_unshared_snapshots_go_first(loaded):
    """Least recently used first, except a branch point (the shared prefix, while two
    conversations continue after it), which outlives more recently used snapshots."""
    lm = loaded("qwen3_5")
    cache = PromptCache(interval=0)
    other = rng.integers(0, 250, 40).tolist()
    a2, b2 = CONV_A + [1] * 30, CONV_B + [2] * 30  # each conversation's second turn
    prompts = {"other": other, "a1": CONV_A, "b1": CONV_B, "a2": a2, "b2": b2}
    for prompt in prompts.values():  # in this order: the shared prefix is last used when b1 starts
        run(lm, prompt, cache, max_tokens=1)
    keys = {name: snapshot_key(t) for name, t in [*prompts.items(), ("shared", SHARED)]}
    assert set(keys.values()) == set(cache.by_key)
    order = []
    while len(cache):
        before = set(cache.by_key)
        cache.max_bytes = cache.nbytes - 1
        cache._evict()
        order += [name for name, k in keys.items() if k in before - set(cache.by_key)]
    assert order == ["other", "a1", "a2", "shared", "b1", "b2"]
    assert cache.counts["evictions_ram"] == 6 and cache.nbytes == 0 and len(cache.blocks) == 0


def test_a_request_joining_a_running_batch_restores_its_snapshot(loaded):
    lm = loaded("qwen3_5", agreeable=True)
    cache = PromptCache(interval=0)
    run(lm, CONV_A, cache, max_tokens=1)
    sched = Scheduler(lm.model, lm.tokenizer, prefill_chunk=64, prompt_cache=cache, policy=DepthPolicy(max_depth=2, fixed=True))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    sched.add("running", [7, 8, 9, 10], SamplingParams(max_tokens=40, ignore_eos=True), 2)
    out, stats = [], None
    for step in range(200):
        if step == 2:
            assert len(sched.batch) == 1  # "running" decodes; the newcomer joins it
            sched.add("late", CONV_B, params, 2, (len(SHARED),))
        for key, chunk in sched.step():
            if key == "late":
                out += chunk.token_ids
                stats = chunk.stats
        if not sched.has_work():
            break
    assert stats.cached_tokens == len(SHARED)
    assert out == run(lm, CONV_B, None, max_tokens=12)[0]


@pytest.mark.parametrize("family", ["qwen3_5", "qwen4_exp"])
def test_disk_tier_survives_a_restart_exactly(family, loaded, tmp_path):
    """A snapshot read back from disk (qwen4_exp: with its indexer keys and PLE n-gram and conv
    windows) is bit for bit a cold prefill's state, and so is everything decoded from it."""
    lm = loaded(family, agreeable=True)
    first = PromptCache(interval=256, disk=disk_tier(lm, tmp_path))
    run(lm, CONV_A, first)
    first.close()
    stored = len(first)
    # A new process builds the same; the same weights served under another name find the folder.
    restarted = PromptCache(interval=256, disk=disk_tier(lm, tmp_path, name="renamed"))
    assert len(restarted.disk) == stored and len(restarted) == 0 and restarted.disk.dir == first.disk.dir
    warm, warm_stats = run(lm, CONV_B, restarted)
    cold_cache = PromptCache(interval=256)
    cold, cold_stats = run(lm, CONV_B, cold_cache)
    assert warm_stats.cached_tokens == len(SHARED) and restarted.counts["hits_disk"] == 1
    assert warm == cold and warm_stats.accepted == cold_stats.accepted
    assert_same_state(state_after(restarted, SHARED), state_after(cold_cache, SHARED))  # as read from disk
    assert_same_state(state_after(restarted, CONV_B), state_after(cold_cache, CONV_B))
    restarted.close()


def test_disk_tier_stays_within_its_budget(loaded, tmp_path):
    lm = loaded("qwen3_5")
    cache = PromptCache(interval=0, disk=disk_tier(lm, tmp_path, max_bytes=400_000))
    for i in range(12):
        run(lm, SHARED + [i] * 40, cache, max_tokens=1)
    cache.disk.flush()
    on_disk = sum(f.stat().st_size for f in cache.disk.dir.glob("*.safetensors"))
    assert 0 < on_disk <= 400_000 and cache.disk.stats["evictions"] > 0
    assert cache.disk.nbytes == on_disk
    # The shared prefix (a branch point) outlives the conversations' own snapshots.
    assert snapshot_key(SHARED) in cache.disk.entries
    cache.close()


def test_corrupt_partial_and_foreign_files_are_skipped(loaded, tmp_path, caplog):
    lm, other_lm = loaded("qwen3_5", agreeable=True), loaded("qwen3_5")
    cache = PromptCache(interval=0, disk=disk_tier(lm, tmp_path))
    run(lm, CONV_A, cache, max_tokens=1)
    run(lm, CONV_B[:-10], cache, max_tokens=1)
    cache.close()
    other = PromptCache(interval=0, disk=disk_tier(other_lm, tmp_path))  # another model, same folder
    run(other_lm, CONV_A, other, max_tokens=1)
    other.close()
    folder = cache.disk.dir
    assert other.disk.dir != folder
    assert len(disk_tier(other_lm, tmp_path)) == len(other.disk) and len(disk_tier(lm, tmp_path)) == len(cache.disk)

    # A file whose bytes changed (same size, so the index still lists it) fails its checksum when read:
    # the request falls back to the next longest snapshot and its output is unchanged.
    longest = folder / f"{cache.disk.prefix}-s-{snapshot_key(CONV_B[:-10])}.safetensors"
    data = bytearray(longest.read_bytes())
    data[-3] ^= 0xFF
    longest.write_bytes(bytes(data))
    restarted = PromptCache(interval=0, disk=disk_tier(lm, tmp_path))
    with caplog.at_level(logging.WARNING, logger="mtp_serve.prompt_cache"):
        warm, stats = run(lm, CONV_B, restarted, max_tokens=8)
    assert "fails its checksum" in caplog.text and not longest.exists()
    assert stats.cached_tokens == len(SHARED)
    assert warm == run(lm, CONV_B, None, max_tokens=8)[0]
    restarted.close()

    # A truncated file, a partial write, another model's file and a garbage index at start-up.
    caplog.clear()
    victim = folder / f"{cache.disk.prefix}-s-{snapshot_key(CONV_A)}.safetensors"
    victim.write_bytes(victim.read_bytes()[:-100])
    (folder / "x.safetensors.123.tmp").write_bytes(b"partial")
    foreign = next(other.disk.dir.glob("*-s-*.safetensors"))
    shutil.copy(foreign, folder / foreign.name)
    (folder / "index.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="mtp_serve.prompt_cache"):
        tier = disk_tier(lm, tmp_path)
    assert "partial" in caplog.text and "not a prompt-cache file of this model" in caplog.text
    assert "cannot read it" in caplog.text or "not a readable safetensors file" in caplog.text
    assert not (folder / "x.safetensors.123.tmp").exists() and (folder / foreign.name).exists()
    assert tier.stats["skipped_files"] == 2
    assert snapshot_key(SHARED) in tier.entries and snapshot_key(CONV_A) not in tier.entries

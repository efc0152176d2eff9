"""Cache bookkeeping: a commit after a rejection leaves the caches exactly as a
cold forward over the committed tokens would; multi-turn reuse of a snapshot
gives the same output as a cold run."""

import mlx.core as mx
import pytest

from mtp_serve.engine.generator import generate
from mtp_serve.engine.prompt_cache import PromptCache
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.engine.batch import Batch
from mtp_serve.engine.prefill import prefill
from mtp_serve.engine.sequence import new_sequence
from mtp_serve.engine.speculative import run_round
from mtp_serve.models.caches import SpeculativeGDNCache

TOL = 1e-5


def _close(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert mx.allclose(a, b, atol=TOL, rtol=TOL).item(), float(mx.abs(a - b).max())


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_commit_after_rejection_equals_cold_forward(family, loaded):
    lm = loaded(family, agreeable=True)
    model = lm.model
    seq = new_sequence(model, lm.tokenizer, "r", [3, 14, 15, 92, 65, 35], SamplingParams(max_tokens=64, ignore_eos=True), 3)
    emitted = prefill(model, seq)[0]
    batch = Batch()
    batch.add(seq)
    seen_partial = False
    for _ in range(20):
        accepted = run_round(model, batch, [3])
        emitted += accepted.tokens[0]
        if accepted.counts[0] < 3:
            seen_partial = True
            break
    assert seen_partial, "no round rejected a draft"
    seq.committed = emitted
    caches = batch.row_caches(seq)

    cold = model.make_cache()
    committed = seq.cache_tokens()
    hidden, _ = model.forward(mx.array([committed]), cold)
    for ours, ref in zip(caches.backbone, cold):
        if isinstance(ours, SpeculativeGDNCache):
            _close(ours[0], ref[0])  # conv window
            _close(ours[1], ref[1])  # recurrent state
        else:
            assert ours.offset == ref.offset == len(committed)
            _close(ours.keys[..., : ours.offset, :], ref.keys[..., : ref.offset, :])
            _close(ours.values[..., : ours.offset, :], ref.values[..., : ref.offset, :])

    # Head KV: entries p < offset are f(H[p], x[p+1]) over the committed tokens.
    n = caches.head.offset
    head_ref = model.make_head_cache()
    model.draft(hidden[:, :n], mx.array([committed[1 : n + 1]]), head_ref)
    _close(caches.head.keys[..., :n, :], head_ref.keys[..., :n, :])
    _close(caches.head.values[..., :n, :], head_ref.values[..., :n, :])
    # ... and the owed pairs cover the rest up to the primary.
    assert seq.owed.hidden.shape[1] == len(committed) - n
    _close(seq.owed.hidden, hidden[:, n:])
    assert seq.owed.tokens == committed[n + 1 :] + [seq.primary]


def _run(lm, prompt, depth, cache=None, max_tokens=24, checkpoints=()):
    out, stats = [], None
    for chunk in generate(lm.model, lm.tokenizer, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), depth, cache,
                          checkpoints):
        out += chunk.token_ids
        stats = chunk.stats
    return out, stats


@pytest.mark.parametrize("depth", [0, 2])
def test_multi_turn_reuse_matches_cold_run(depth, loaded):
    lm = loaded("qwen3_5", agreeable=True)
    cache = PromptCache()
    turn1 = [7, 8, 9, 10, 11, 12, 13]
    reply1, stats1 = _run(lm, turn1, depth, cache)
    assert stats1.cached_tokens == 0
    # The next turn resends the conversation plus new tokens.
    turn2 = turn1 + reply1 + [40, 41, 42]
    warm, stats2 = _run(lm, turn2, depth, cache)
    cold, _ = _run(lm, turn2, depth)
    assert warm == cold
    # Everything but the last reply token is in the caches (or all of it, when the
    # final round had already forwarded past max_tokens).
    assert len(turn1) + len(reply1) - 1 <= stats2.cached_tokens <= len(turn1) + len(reply1)
    # A prompt that only extends turn 1's prompt reuses the prompt snapshot.
    turn2b = turn1 + [99, 98]
    warm_b, stats_b = _run(lm, turn2b, depth, cache)
    assert stats_b.cached_tokens == len(turn1)
    assert warm_b == _run(lm, turn2b, depth)[0]


@pytest.mark.parametrize("depth", [0, 2])
def test_checkpoint_serves_a_prompt_that_diverges_after_it(depth, loaded):
    """A snapshot taken mid-prefill (where the server puts the generation prompt's
    start) serves a next prompt that shares only the tokens before it."""
    lm = loaded("qwen3_5", agreeable=True)
    cache = PromptCache()
    shared = list(range(10, 50))
    _run(lm, shared + [7, 8, 9], depth, cache, checkpoints=(len(shared),))
    nxt = shared + [60, 61, 62, 63]
    warm, stats = _run(lm, nxt, depth, cache)
    assert stats.cached_tokens == len(shared)
    assert warm == _run(lm, nxt, depth)[0]

"""The four steps of the speculative round, each on its own, on a small real model:
draft -> verify -> accept -> commit, for a batch whose rows draft different depths."""

import mlx.core as mx
import pytest

from mtp_serve.engine.batch import Batch
from mtp_serve.engine.prefill import prefill
from mtp_serve.engine.sampling import SamplingParams, target_logprobs
from mtp_serve.engine.sequence import new_sequence
from mtp_serve.engine.speculative import Drafts, Verified, accept, commit, draft, verify
from mtp_serve.models.caches import SpeculativeGDNCache

TOL = 1e-5
PROMPTS = {"a": [3, 14, 15, 92, 65, 35], "b": [40, 41, 42], "c": [9] * 7}


def close(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert mx.allclose(a, b, atol=TOL, rtol=TOL).item(), float(mx.abs(a - b).max())


def running_batch(lm, params_by_key, depth=3):
    """Prefilled rows in one batch; returns (batch, committed tokens per row)."""
    batch, committed = Batch(), {}
    for key, params in params_by_key.items():
        seq = new_sequence(lm.model, lm.tokenizer, key, PROMPTS[key], params, depth)
        committed[key] = prefill(lm.model, seq)[0]
        batch.add(seq)
    return batch, committed


def greedy(n=64):
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def lm(loaded):
    return loaded("qwen3_5", agreeable=True)


def test_draft_chains_the_head_per_row_and_pads_short_rows(lm):
    batch, _ = running_batch(lm, {"a": greedy(), "b": SamplingParams(temperature=1.0, max_tokens=64),
                                  "c": SamplingParams(temperature=1.0, seed=5, max_tokens=64)})
    rows = batch.rows
    owed = [(s.owed.hidden, list(s.owed.tokens)) for s in rows]
    head_before = batch.head_cache.offset.tolist()
    drafts = draft(lm.model, batch, [3, 2, 0])
    assert drafts.width == 4 and drafts.tokens.shape == (3, 3)
    V = lm.model.vocab_size
    assert drafts.q[0] is None and drafts.q[2] is None  # greedy and seeded rows keep no q
    assert drafts.q[1].shape == (2, V)  # the rejection sampler's q for row b's two drafts
    assert drafts.noise[0] is None and drafts.noise[1] is None and drafts.noise[2].shape == (4, V)
    # Row a (greedy) alone through the head gives the same chain.
    hidden, tokens = owed[0]
    head = lm.model.make_head_cache()
    ref = []
    out, logits = lm.model.draft(hidden, mx.array([tokens]), head)
    out, logits = out[:, -1:], logits[:, -1]
    for j in range(3):
        ref.append(int(mx.argmax(logits, axis=-1).item()))
        out, logits = lm.model.draft(out, mx.array([[ref[-1]]]), head)
        logits = logits[:, -1]
    assert drafts.tokens[0].tolist() == ref
    # Every row's owed pairs went into the head (all rows run through it), plus the
    # chained entries of drafts 2..3 (dropped again by the commit).
    assert batch.head_cache.offset.tolist() == [b + len(t) + 2 for b, (_, t) in zip(head_before, owed)]
    assert all(len(s.owed) == 0 for s in rows)


def test_verify_scores_every_window_position_like_a_plain_forward(lm):
    batch, _ = running_batch(lm, {"a": greedy(), "b": SamplingParams(temperature=0.7, top_k=5, max_tokens=64)})
    inputs = [[s.primary] for s in batch.rows]
    per_row = [batch.row_caches(s).backbone for s in batch.rows]  # copies, before the verify
    drafts = draft(lm.model, batch, [2, 1])
    verified = verify(lm.model, batch, drafts)
    assert verified.hidden.shape[:2] == (2, 3)
    assert not any(c.capturing for c in batch.cache if isinstance(c, SpeculativeGDNCache))
    for i, s in enumerate(batch.rows):
        window = mx.array([inputs[i] + drafts.tokens[i].tolist()])
        hidden, logits = lm.model.forward(window, per_row[i])
        close(verified.hidden[i : i + 1], hidden)
        want = target_logprobs(logits[0], s.params, s.history, drafts.tokens[i])
        close(verified.p[i], want)
    close(verified.argmax[0], mx.argmax(verified.p[0], axis=-1))


def test_accept_caps_each_row_at_its_own_depth():
    """Padding positions are never accepted, even where they match the target."""
    V = 8
    logits = mx.full((2, 4, V), -5.0)
    target = mx.array([[1, 2, 3, 4], [5, 6, 7, 0]])
    logits = logits + 10.0 * (mx.arange(V)[None, None] == target[..., None])
    drafts = Drafts([3, 1], mx.array([[1, 2, 0], [5, 6, 7]]), [None, None], [None, None], [None, None], [0, 0])  # row 1 pads with would-be hits

    class Row:
        params = SamplingParams()
        grammar = None

    verified = Verified(drafts, mx.zeros((2, 4, 1)), [logits[0], logits[1]], mx.argmax(logits, axis=-1))
    accepted = accept(verified, [Row(), Row()])
    assert accepted.counts == [2, 1]
    assert accepted.tokens == [[1, 2, 3], [5, 6]]


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_commit_leaves_each_row_as_a_cold_forward_would(family, loaded):
    lm = loaded(family, agreeable=True)
    batch, committed = running_batch(lm, {"a": greedy(), "b": greedy(), "c": greedy()})
    depths = [3, 1, 0]
    seen_partial = False
    for _ in range(12):
        drafts = draft(lm.model, batch, depths)
        accepted = accept(verify(lm.model, batch, drafts), batch.rows)
        commit(batch, accepted)
        for s, tokens in zip(batch.rows, accepted.tokens):
            committed[s.key] += tokens
        seen_partial |= 0 < accepted.counts[0] < 3
        assert accepted.counts[2] == 0 and accepted.counts[1] <= 1
    assert seen_partial
    for s in batch.rows:
        tokens = PROMPTS[s.key] + committed[s.key][:-1]  # all but the primary
        assert s.primary == committed[s.key][-1]
        caches = batch.row_caches(s)
        cold = lm.model.make_cache()
        hidden, _ = lm.model.forward(mx.array([tokens]), cold)
        for ours, ref in zip(caches.backbone, cold):
            if isinstance(ours, SpeculativeGDNCache):
                close(ours[0], ref[0])
                close(ours[1], ref[1])
            else:
                assert ours.offset == ref.offset == len(tokens)
                close(ours.keys[..., : ours.offset, :], ref.keys[..., : ref.offset, :])
        n = caches.head.offset  # head entries f(H[p], x[p+1]) for p < n, owed pairs for the rest
        head_ref = lm.model.make_head_cache()
        lm.model.draft(hidden[:, :n], mx.array([tokens[1 : n + 1]]), head_ref)
        close(caches.head.keys[..., :n, :], head_ref.keys[..., :n, :])
        close(s.owed.hidden, hidden[:, n:])
        assert s.owed.tokens == tokens[n + 1 :] + [s.primary]

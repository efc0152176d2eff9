"""A draft vocabulary changes what the head proposes, never what is emitted: greedy
output stays token-identical, seeded output the same tokens, and unseeded sampling keeps
the plain distribution (the subset's renormalised distribution is the rejection test's q)."""

import json

import pytest
from scipy.stats import chi2_contingency

from mtp_serve.engine.generator import generate
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.models.draft_vocab import DRAFT_VOCAB_FILE, load_draft_ids, measure_draft_vocab, save_draft_vocab

PROMPT = [11, 22, 33, 44, 55, 66]


def run(lm, params, depth, prompt=PROMPT):
    out, stats = [], None
    for chunk in generate(lm.model, lm.tokenizer, prompt, params, depth):
        out += chunk.token_ids
        stats = chunk.stats
    return out, stats


@pytest.fixture
def subset_model(loaded):
    """The agreeable model drafting from the 48 tokens its own greedy output uses most."""
    lm = loaded("qwen3_5", agreeable=True)
    text = [run(lm, SamplingParams(max_tokens=200, ignore_eos=True), 0, [p, p + 1])[0] for p in range(20, 200, 30)]
    ids = measure_draft_vocab(lambda toks: toks, text)[:48]
    lm.model.use_draft_vocab(ids)
    yield lm, ids
    lm.model.use_draft_vocab(None)


def test_greedy_and_seeded_output_do_not_change(subset_model):
    lm, ids = subset_model
    greedy = SamplingParams(max_tokens=60, ignore_eos=True)
    seeded = SamplingParams(max_tokens=60, ignore_eos=True, temperature=1.0, top_k=5, seed=7)
    for params in (greedy, seeded):
        plain, _ = run(lm, params, 0)
        for depth in (1, 3):
            out, stats = run(lm, params, depth)
            assert out == plain, (params.greedy, depth)
    _, stats = run(lm, greedy, 2)
    assert 0 < sum(stats.accepted) < sum(stats.drafted)


def test_drafts_come_from_the_subset(subset_model):
    lm, ids = subset_model
    from mtp_serve.engine.batch import Batch
    from mtp_serve.engine.prefill import prefill
    from mtp_serve.engine.sequence import new_sequence
    from mtp_serve.engine.speculative import draft

    batch = Batch()
    for key, params in (("g", SamplingParams()), ("s", SamplingParams(temperature=1.5))):
        seq = new_sequence(lm.model, lm.tokenizer, key, PROMPT, params, 3)
        prefill(lm.model, seq)
        batch.add(seq)
    d = draft(lm.model, batch, [3, 3])
    assert set(d.tokens.reshape(-1).tolist()) <= set(ids)
    q = d.q[1]  # the sampled row's draft distribution: the subset's, renormalised
    outside = [t for t in range(lm.model.vocab_size) if t not in set(ids)]
    assert (q[:, outside] == -float("inf")).all().item()


@pytest.mark.distribution
def test_unseeded_sampling_keeps_the_plain_distribution(subset_model):
    lm, _ = subset_model
    # (max_tokens 4: the round after the first token may emit the other 3, so it drafts 2)
    kw = dict(temperature=1.0, top_k=4, max_tokens=4, ignore_eos=True)
    plain = [run(lm, SamplingParams(**kw), 0)[0] for _ in range(500)]
    mtp, accepted, drafted = [], 0, 0
    for _ in range(500):
        out, stats = run(lm, SamplingParams(**kw), 2)
        mtp.append(out)
        accepted, drafted = accepted + sum(stats.accepted), drafted + sum(stats.drafted)
    assert accepted >= 30 and drafted - accepted >= 30, (accepted, drafted)
    for pos in range(4):
        a, b = [s[pos] for s in plain], [s[pos] for s in mtp]
        keys = sorted(set(a) | set(b))
        assert chi2_contingency([[a.count(k) for k in keys], [b.count(k) for k in keys]])[1] > 0.001


def test_draft_vocab_file_round_trip(tmp_path):
    ids = measure_draft_vocab(lambda t: list(t.encode()), ["aab", "abc"], always=[255])
    assert ids[:3] == [255, ord("a"), ord("b")]
    save_draft_vocab(tmp_path, ids, "test")
    assert json.loads((tmp_path / DRAFT_VOCAB_FILE).read_text())["source"] == "test"
    assert load_draft_ids(tmp_path, 2) == [255, ord("a")]
    assert load_draft_ids(tmp_path, 0) is None and load_draft_ids(tmp_path / "none", 5) is None


def test_tune_measures_stores_and_uses_a_draft_vocab(tmp_path, checkpoint_dir):
    """`mtp-tune --draft-vocab-text FILE --draft-vocab N`: the frequencies land in
    draft_vocab.json (special tokens first, then by count), N in mtp_serve.json, and a
    later load drafts from those N tokens."""
    import shutil

    from mtp_serve.cli import tune
    from mtp_serve.models.loader import load_model

    model = tmp_path / "model"
    shutil.copytree(checkpoint_dir("qwen3_5", agreeable=True), model)
    lm = load_model(str(model))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("return x\n" * 50 + "yield y\n" * 5 + lm.tokenizer.decode(list(range(lm.model.vocab_size))))
    args = ["--draft-vocab-text", str(corpus), "--draft-vocab", "100", "--tune-tokens", "8", "--tune-repeats", "1",
            "--max-depth", "1"]
    assert tune.main([str(model)] + args) == 0  # not 3: drafts from the 100 tokens are accepted

    lm = load_model(str(model))
    ids = load_draft_ids(model, 10_000)
    encode = lambda t: lm.tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
    special = set(lm.tokenizer.eos_token_ids)
    assert special <= set(ids[: len(special) + 8])
    assert ids.index(encode("return x\n")[0]) < ids.index(encode("yield y\n")[0])
    assert json.loads((model / "mtp_serve.json").read_text())["draft_vocab_size"] == 100
    assert lm.model.draft_vocab is not None and lm.model.draft_vocab.size == 100

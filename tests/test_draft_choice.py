"""Cheap drafts: the head quantized for drafting (greedy MTP stays plain's tokens at 4 and
8 bits, single and batched), the acceptance-margin decision, and mtp-tune / mtp-graft
writing the choice that the loader (mtp-serve, mtp-generate) then drafts from by default."""

import json
import shutil
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mtp_serve.cli import draft_choice
from mtp_serve.cli.draft_choice import MARGIN, REFERENCE, DraftSetting, choose, ladder, within_margin
from mtp_serve.models.draft_head import head_is_quantized, quantized_head
from mtp_serve.models.draft_vocab import DRAFT_VOCAB_FILE, tokenizer_order
from mtp_serve.models.graft import graft
from mtp_serve.models.loader import load_model
from mtp_serve.models.model_card import load_card
from mtp_serve.testing.quantized import QUANT_TEXT, quantize_loaded
from support.greedy import batched_greedy, greedy
from support.native import needs_qmm_kernel

N_TOKENS = 24
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 11], list(range(30, 100, 3))]


# ---------------------------------------------------------------- the decision


def test_ladder_tries_the_cheapest_drafts_first():
    assert ladder(4, 248_320) == [DraftSetting(4, 16384), DraftSetting(8, 16384), DraftSetting(0, 16384),
                                  DraftSetting(4, 32768), DraftSetting(8, 32768), DraftSetting(0, 32768),
                                  DraftSetting(4, 0), DraftSetting(8, 0)]
    # An 8-bit body: 8 bits is the body's precision; a vocabulary no larger than the model's is the whole one.
    assert ladder(8, 4096) == [DraftSetting(8, 0)]
    # The user's --draft-vocab is the only vocabulary tried.
    assert ladder(4, 248_320, fixed_vocab=32768) == [DraftSetting(4, 32768), DraftSetting(8, 32768), DraftSetting(0, 32768)]
    assert REFERENCE not in ladder(4, 248_320, fixed_vocab=0)


def test_the_first_setting_within_the_margin_is_chosen_and_the_rest_not_measured():
    acc = {DraftSetting(4, 16384): 0.60, DraftSetting(8, 16384): 0.77, DraftSetting(0, 16384): 0.80}
    measured = []

    def measure(s):
        measured.append(s)
        return acc[s]

    c = choose(0.80, list(acc), measure)
    assert c.setting == DraftSetting(8, 16384) and measured == [DraftSetting(4, 16384), DraftSetting(8, 16384)]
    assert c.as_dict()["acceptance"] == {"4-bit head, 16384 most frequent tokens": 0.6, "8-bit head, 16384 most frequent tokens": 0.77}
    # Nothing within the margin: the unquantized head over the whole vocabulary stays.
    assert choose(0.80, [DraftSetting(4, 16384)], lambda s: 0.70).setting == REFERENCE


def test_margin_is_relative_to_the_reference():
    assert MARGIN == 0.05
    assert within_margin(0.76, 0.80) and not within_margin(0.759, 0.80)
    assert within_margin(0.0, 0.0)  # a head nothing accepts: the cheapest drafts cost least


def test_tokenizer_order_puts_the_special_tokens_first():
    assert tokenizer_order(6, always=[4, 1, 4, 9]) == [4, 1, 0, 2, 3, 5]


# ---------------------------------------------------------------- exactness with a quantized draft head


@pytest.fixture(scope="module")
def quantized_body(checkpoint_dir):
    cache = {}

    def make(family, bits):
        if (family, bits) not in cache:
            lm = load_model(str(checkpoint_dir(family, agreeable=True, **QUANT_TEXT)))
            quantize_loaded(lm.model, bits, 64 if bits == 4 else 32, head=False)
            cache[family, bits] = lm
        return cache[family, bits]

    return make


def _greedy(lm, prompt, depth):
    return greedy(lm, prompt, depth, N_TOKENS, copy_max=0)


def _batched(lm, prompts, depth):
    return batched_greedy(lm, prompts, depth, N_TOKENS)


@needs_qmm_kernel()
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_draft_head_keeps_greedy_output_identical_to_plain(family, bits, quantized_body):
    """A quantized body drafting from a quantized copy of its head over a draft vocabulary
    gives plain decoding's tokens, single and batched (the drafts only change speed)."""
    lm = quantized_body(family, bits)
    full = lm.model.head
    plain = [_greedy(lm, p, 0)[0] for p in PROMPTS]
    lm.model.head = quantized_head(full, bits, 32)
    lm.model.use_draft_vocab(tokenizer_order(lm.model.vocab_size, always=[257])[:160])
    try:
        assert head_is_quantized(lm.model.head) and not head_is_quantized(full)
        assert f"drafts from the {bits}-bit head over the 160 most frequent tokens" == lm.model.drafts_note()
        accepted = 0
        for depth in (1, 3):
            for p, ref in zip(PROMPTS, plain):
                ours, stats = _greedy(lm, p, depth)
                assert ours == ref, f"{family} {bits}-bit head depth {depth}"
                accepted += sum(stats.accepted)
        assert accepted > 0  # drafts were accepted: windows of several rows ran
        assert _batched(lm, PROMPTS, 2) == plain
    finally:
        lm.model.head = full
        lm.model.use_draft_vocab(None)


def test_quantized_head_copy_leaves_the_original_and_rejects_other_bits(quantized_body):
    lm = quantized_body("qwen3_5", 4)
    before = {k: v for k, v in tree_flatten(lm.model.head.parameters())}
    q = quantized_head(lm.model.head, 8, 32)
    assert any(isinstance(m, nn.QuantizedLinear) and m.bits == 8 for _, m in q.named_modules())
    after = dict(tree_flatten(lm.model.head.parameters()))
    assert after.keys() == before.keys() and all(mx.array_equal(after[k], before[k]).item() for k in before)
    with pytest.raises(ValueError, match="one of"):
        quantized_head(lm.model.head, 3, 32)


# ---------------------------------------------------------------- tune writes it, the loader uses it


def tune_args(**kw):
    base = dict(max_depth=2, tune_tokens=16, tune_repeats=1, draft_vocab_text=None, draft_vocab=None,
                quantized_matmul=None, no_draft_choice=False)
    return SimpleNamespace(**{**base, **kw})


@pytest.fixture
def grafted_q4(tmp_path, checkpoint_dir, stock_converted):
    """An agreeable checkpoint converted to 4 bits by stock mlx-lm, its head grafted back (stored unquantized)."""
    src = checkpoint_dir("qwen3_5", agreeable=True)
    dst = tmp_path / "q4"
    shutil.copytree(stock_converted(src, quantize=True), dst)
    graft(str(src), dst)
    return dst


def test_tune_writes_the_drafts_it_measured_and_the_loader_drafts_from_them(grafted_q4, monkeypatch):
    from mtp_serve.cli.tune import verify_and_tune

    monkeypatch.setattr(draft_choice, "VOCABS", (96, 192))  # the synthetic vocabulary has 320 tokens
    lines = []
    verify_and_tune(str(grafted_q4), tune_args(), out=lines.append)
    stored = json.loads((grafted_q4 / "mtp_serve.json").read_text())
    choice = stored["draft_choice"]
    reference = choice["reference_acceptance"]
    assert reference > 0.3  # the agreeable head drafts well
    # The stored choice is the first setting of the ladder within the margin of the reference.
    tried = list(choice["acceptance"].items())
    assert [name for name, _ in tried] == [s.describe() for s in ladder(4, 320)][: len(tried)]
    assert all(not within_margin(a, reference) for _, a in tried[:-1])
    chosen = DraftSetting(stored["draft_head_bits"], stored["draft_vocab_size"])
    if within_margin(tried[-1][1], reference):
        assert choice["chosen"] == tried[-1][0] == chosen.describe()
    else:
        assert chosen == REFERENCE
    assert any(line.startswith("drafts: ") for line in lines)
    # The head on disk is untouched (unquantized); the loader drafts from the choice by default.
    card = load_card("qwen3_5", grafted_q4)
    assert (card.draft_head_bits, card.draft_vocab_size) == (chosen.head_bits, chosen.vocab)
    lm = load_model(str(grafted_q4))
    assert head_is_quantized(lm.model.head) == bool(chosen.head_bits)
    assert (lm.model.draft_vocab.size if lm.model.draft_vocab is not None else 0) == chosen.vocab
    if chosen.vocab:
        ids = json.loads((grafted_q4 / DRAFT_VOCAB_FILE).read_text())["ids"]
        assert ids[0] == 257 and sorted(ids) == list(range(320))  # the end of a turn first, then every id
    assert not head_is_quantized(load_model(str(grafted_q4), draft_head_bits=0).model.head)


def test_acceptance_below_the_margin_keeps_the_full_drafts(grafted_q4, monkeypatch):
    """Forcing every cheaper setting's acceptance down (a real run whose measured numbers are
    replaced): the reference stays the choice and is what the loader uses."""
    from mtp_serve.cli.tune import verify_and_tune

    real = draft_choice.acceptance
    calls = []

    def worse_when_cheaper(lm, prompts, depth, tokens):
        a = real(lm, prompts, depth, tokens)
        calls.append(a)
        return a if len(calls) == 1 else 0.5 * a

    monkeypatch.setattr(draft_choice, "acceptance", worse_when_cheaper)
    verify_and_tune(str(grafted_q4), tune_args(), out=lambda _: None)
    stored = json.loads((grafted_q4 / "mtp_serve.json").read_text())
    assert calls[0] > 0.3 and len(calls) == 1 + len(ladder(4, 320))
    assert (stored["draft_head_bits"], stored["draft_vocab_size"]) == (0, 0)
    assert not head_is_quantized(load_model(str(grafted_q4)).model.head)


def test_no_draft_choice_keeps_the_drafts_as_they_were(grafted_q4):
    from mtp_serve.cli.tune import verify_and_tune

    verify_and_tune(str(grafted_q4), tune_args(no_draft_choice=True), out=lambda _: None)
    stored = json.loads((grafted_q4 / "mtp_serve.json").read_text())
    assert "draft_choice" not in stored and "draft_head_bits" not in stored
    assert not head_is_quantized(load_model(str(grafted_q4)).model.head)


def test_tune_stores_the_verify_windows_costs_and_the_server_policy_starts_from_them(grafted_q4):
    from mtp_serve.cli.tune import verify_and_tune

    lines = []
    verify_and_tune(str(grafted_q4), tune_args(no_draft_choice=True), out=lines.append)
    stored = json.loads((grafted_q4 / "mtp_serve.json").read_text())["window_costs"]
    assert list(stored) == ["4", "8", "16", "32", "64"]  # every bucket copies of up to 32 tokens use
    assert all(0 < c < 1000 for c in stored.values())
    assert any(line.startswith("verify windows (copied drafts), in plain steps: 4 tokens") for line in lines)
    card = load_card("qwen3_5", grafted_q4)
    assert dict(card.window_costs) == {int(w): c for w, c in stored.items()}


@pytest.mark.slow
def test_graft_cli_chooses_the_drafts_and_mtp_serve_uses_them(tmp_path, checkpoint_dir, stock_converted):
    """mtp-graft as a user runs it (defaults: verify and tune), then mtp-serve with
    --enable-mtp: its start-up line names the drafts the graft chose."""
    src = checkpoint_dir("qwen3_5", agreeable=True)
    dst = tmp_path / "q4"
    shutil.copytree(stock_converted(src, quantize=True), dst)
    out = subprocess.run([sys.executable, "-m", "mtp_serve.cli.graft", "--from", str(src), "--into", str(dst),
                          "--tune-tokens", "16", "--tune-repeats", "1", "--max-depth", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    stored = json.loads((dst / "mtp_serve.json").read_text())
    assert "draft_head_bits" in stored and "draft_choice" in stored and "choosing the drafts" in out.stdout
    lm = load_model(str(dst))
    note = lm.model.drafts_note()
    assert head_is_quantized(lm.model.head) == bool(stored["draft_head_bits"])
    assert "MTP on, depth 2, " + note in serving_line(dst)
    # --draft-head-bits 0 overrides the card: the head drafts as stored
    assert "MTP on, depth 2, drafts from the unquantized head" in serving_line(dst, "--draft-head-bits", "0")


def serving_line(model, *flags: str) -> str:
    """mtp-serve's start-up line for `model` with --enable-mtp --mtp-depth 2 and `flags`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "mtp_serve.cli.serve", "--model", str(model), "--port", str(port),
                             "--enable-mtp", "--mtp-depth", "2", *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline, line = time.time() + 120, ""
        while time.time() < deadline:
            line = proc.stdout.readline()
            if "mtp-serve: serving" in line or not line:
                break
        return line
    finally:
        proc.terminate()
        proc.wait(timeout=30)

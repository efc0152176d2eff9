"""Speed against acceptance at real shapes: what MTP gives at a known acceptance, and
how close that is to what the measured costs allow.

    python bench/bench_acceptance_speed.py [--shapes 0.8b 2b 4b flash-next] [--acceptance 0.5 0.7 0.9]
                                           [--depths 1 2 3 4] [--tokens 48] [--draft-vocab 0 32768]

Random-weight models with the layer shapes of Qwen3.5-0.8B, 2B and 4B (fp32, the
real 248,320-token vocabulary, tied embeddings), or Qwen3.8-Flash-Next's scaled to fit
(`flash-next`: qwen4_exp, the project's own backbone), decode greedily. A benchmark-only
oracle (a wrapper around the round's `draft` step in this process: nothing the
server can reach) lets the real head run, then replaces each drafted token with the
model's own greedy continuation with probability a, else with a wrong token; so
acceptance is a at every position and E[tokens per round] = 1 + a + ... + a^K.
For each shape, a and depth K it prints decode tokens/s of plain and MTP, their
ratio, and next to it the limit the measured costs allow: E / (verify(K+1) + K *
draft), both in units of one plain step (`bench/cost_model.py`'s measurement on the
same model), and the efficiency: the measured ratio over that limit taken at the
tokens per round the MTP runs really got (the oracle's draws drift from a, most in
short runs). `--draft-vocab N` runs the head with a draft vocabulary of N tokens as
well (the cheap-draft comparison).
"""

from __future__ import annotations

import argparse
import gc
import random
from contextlib import contextmanager

from common import pc  # noqa: I001  (first: sets up the backend, OpenBLAS, before mlx.core is imported)

import mlx.core as mx

from cost_model import (QWEN35_VOCAB, cost_ratios, flash_next_text, measure_costs, qwen35_08b_text, random_mtp_model,
                        random_qwen4_exp_model)
import mtp_serve.engine.speculative as speculative
from mtp_serve import BACKEND
from mtp_serve.engine.generator import generate
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.engine.warmup import calibrate_blas_threads

ROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]}
SHAPES = {
    "0.8b": lambda V: qwen35_08b_text(V),
    # Qwen3.5-2B: hidden 2048 (its GatedDeltaNet and attention widths follow the 0.8B's pattern here)
    "2b": lambda V: dict(qwen35_08b_text(V), hidden_size=2048, intermediate_size=6144),
    # Qwen3.5-4B: hidden 2560, 32 layers, FFN 9216, 16/4 attention heads, 16/32 GatedDeltaNet heads
    "4b": lambda V: dict(hidden_size=2560, num_hidden_layers=32, intermediate_size=9216, linear_num_key_heads=16,
                         linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                         num_attention_heads=16, num_key_value_heads=4, head_dim=256, full_attention_interval=4,
                         vocab_size=V, tie_word_embeddings=True, rope_parameters=ROPE),
    # Qwen3.8-Flash-Next (qwen4_exp) scaled to fit (cost_model.flash_next_text says how)
    "flash-next": flash_next_text,
}
BUILD = {"flash-next": random_qwen4_exp_model}


@contextmanager
def oracle_drafts(reference: list, acceptance: float, vocab: int, seed: int = 0):
    """The head's drafts become the reference continuation with probability `acceptance`
    (else wrong); drafts that came with certainty (copied, forced) stay as they are."""
    rng = random.Random(seed)
    real = speculative.draft

    def draft(model, batch, depths, certain=None):
        drafts = real(model, batch, depths, certain)
        if drafts.tokens is None:
            return drafts
        rows = []
        for i, (s, K, row) in enumerate(zip(batch.rows, depths, drafts.tokens.tolist())):
            n = len(s.committed)
            if drafts.sources is not None and drafts.sources[i]:  # copied or forced: left as drafted
                K = 0
            for j in range(K):
                ref = reference[n + j] if n + j < len(reference) else row[j]
                row[j] = ref if rng.random() < acceptance else (ref + 1) % vocab
            rows.append(row)
        drafts.tokens = mx.array(rows, dtype=drafts.tokens.dtype)
        return drafts

    speculative.draft = draft
    try:
        yield
    finally:
        speculative.draft = real


def decode(lm, prompt, n, depth):
    """Tokens, decode tokens/s (after the first token) and tokens per round (after the first).
    The head's drafts alone (no copies from the context: the oracle sets their acceptance)."""
    toks, first, last, stats = [], None, None, None
    for chunk in generate(lm.model, lm.tokenizer, prompt, SamplingParams(max_tokens=n, ignore_eos=True), depth, copy_max=0):
        last = pc()
        first = first or last
        toks += chunk.token_ids
        stats = chunk.stats
    return toks, (len(toks) - 1) / (last - first), (len(toks) - 1) / max(1, stats.backbone_passes)


class Tok:
    """What generate needs of a tokenizer, for token ids only."""

    eos_token_ids: list = []

    class detokenizer:  # noqa: N801 - mlx-lm's attribute name
        text = ""

        @staticmethod
        def reset():
            pass

        @staticmethod
        def add_token(t):
            pass

        @staticmethod
        def finalize():
            pass


def run_shape(name: str, args) -> list:
    t0 = pc()
    model = BUILD.get(name, random_mtp_model)(SHAPES[name](QWEN35_VOCAB))
    lm = type("LM", (), {"model": model, "tokenizer": Tok()})()
    calibrate_blas_threads(model, lm.tokenizer)
    prompt = mx.random.randint(0, QWEN35_VOCAB, (64,), key=mx.random.key(1)).tolist()
    print(f"[{name}] built in {pc() - t0:.0f}s; measuring costs", flush=True)
    rows = []
    for dv in args.draft_vocab:
        model.use_draft_vocab(list(range(dv)) if dv else None)
        costs = cost_ratios(measure_costs(model, context=64, reps=3))
        reference = decode(lm, prompt, args.tokens + 8, 0)[0]
        decode(lm, prompt, 8, max(args.depths))  # trace the verify shapes
        for a in args.acceptance:
            with oracle_drafts(reference, a, QWEN35_VOCAB):
                for K in args.depths:
                    plain_s, mtp_s, per_round = [], [], []
                    for r in range(args.repeats):  # alternate, so load drift hits both
                        order = (0, K) if r % 2 == 0 else (K, 0)
                        for d in order:
                            toks, tok_s, tpr = decode(lm, prompt, args.tokens, d)
                            assert toks == reference[: len(toks)], "MTP changed the output"
                            (plain_s if d == 0 else mtp_s).append(tok_s)
                            if d:
                                per_round.append(tpr)
                    ratio = max(mtp_s) / max(plain_s)
                    E = sum(a**j for j in range(K + 1))
                    cost = costs["verify"][K + 1] + K * costs["draft"]
                    # The oracle's draws make a run's acceptance drift from a (more in short runs): the
                    # efficiency compares with the limit at the tokens per round the MTP runs really got.
                    seen = sum(per_round) / len(per_round)
                    rows.append(dict(shape=name, draft_vocab=dv or QWEN35_VOCAB, a=a, K=K, plain=max(plain_s),
                                     mtp=max(mtp_s), ratio=ratio, limit=E / cost, per_round=seen,
                                     efficiency=ratio * cost / seen, verify=costs["verify"][K + 1], draft=costs["draft"]))
                    r = rows[-1]
                    print(f"[{name}] vocab {r['draft_vocab']:>6} a {a:.1f} K {K}: plain {r['plain']:.2f} tok/s, "
                          f"mtp {r['mtp']:.2f} ({ratio:.2f}x), limit {r['limit']:.2f}x, {seen:.2f} tokens per round "
                          f"(expected {E:.2f}), efficiency {r['efficiency']:.2f}", flush=True)
    del model, lm
    gc.collect()
    mx.clear_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["0.8b", "2b", "4b"], choices=sorted(SHAPES))
    ap.add_argument("--acceptance", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--draft-vocab", type=int, nargs="+", default=[0], help="0: the whole vocabulary")
    args = ap.parse_args()
    print(BACKEND.note)
    rows = []
    for name in args.shapes:
        rows += run_shape(name, args)
    print(f"\n{'shape':6s} {'draft vocab':>11s} {'a':>4s} {'K':>2s} {'plain tok/s':>11s} {'MTP tok/s':>9s} {'x plain':>8s} "
          f"{'limit':>6s} {'tok/round':>9s} {'effic.':>6s} {'verify':>7s} {'draft':>6s}")
    for r in rows:
        print(f"{r['shape']:6s} {r['draft_vocab']:>11d} {r['a']:4.1f} {r['K']:>2d} {r['plain']:11.2f} {r['mtp']:9.2f} "
              f"{r['ratio']:7.2f}x {r['limit']:5.2f}x {r['per_round']:9.2f} {r['efficiency']:6.2f} {r['verify']:7.2f} "
              f"{r['draft']:6.3f}")
    print("limit: E[tokens per round] / (verify(K+1) + K * draft), costs in plain steps measured on the same model;\n"
          "efficiency: x plain / the same limit at the tokens per round the MTP runs got (tok/round)")


if __name__ == "__main__":
    main()

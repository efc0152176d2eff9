"""Each step of the speculative round timed alone: draft, verify, accept, commit.

    python bench/bench_round.py [--model DIR] [--batch 1 2 4 8] [--depths 0 1 2 3] [--rounds 40]

For each batch size and depth, rows decode greedily (demo model by default)
through `draft -> verify -> accept -> commit`, with `mx.eval` after each step
so its time is its own (the engine itself leaves steps lazy and syncs once, in
accept; the sum here is therefore a little above a real round). Prints the
median milliseconds of each step and the whole round, and each step's share.
"""

from __future__ import annotations

import mtp_serve  # noqa: F401  (backend set-up before mlx)

import argparse
import statistics
import time

import mlx.core as mx

from mtp_serve.engine.batch import Batch
from mtp_serve.engine.prefill import prefill
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.engine.sequence import new_sequence
from mtp_serve.engine.speculative import accept, commit, draft, verify
from mtp_serve.models.demo_model import default_model_path
from mtp_serve.models.loader import load_model

PROMPTS = ["import os\nimport sys\n\ndef main(argv):\n    ", "class Stack:\n    def __init__(self):\n",
           "def read_config(path):\n    with open(path) as f:\n", "for i, line in enumerate(lines):\n"]


def arrays_of(step_result) -> list:
    """What to evaluate so a step's lazy work is done (and timed) inside it."""
    out = []
    for name in ("tokens", "hidden", "p"):
        v = getattr(step_result, name, None)
        if isinstance(v, mx.array):
            out.append(v)
        elif isinstance(v, list):
            out += [x for x in v if isinstance(x, mx.array)]
    return out


def time_rounds(lm, B: int, depth: int, rounds: int) -> dict:
    batch = Batch()
    for i in range(B):
        seq = new_sequence(lm.model, lm.tokenizer, i, lm.tokenizer.encode(PROMPTS[i % len(PROMPTS)]),
                           SamplingParams(max_tokens=1 << 20, ignore_eos=True), depth)
        prefill(lm.model, seq)
        batch.add(seq)
    times = {k: [] for k in ("draft", "verify", "accept", "commit", "round")}
    for r in range(rounds + 3):  # the first rounds trace kernels: not timed
        t0 = time.perf_counter()
        drafts = draft(lm.model, batch, [depth] * B)
        mx.eval(arrays_of(drafts), batch.head_cache.state if batch.head_cache is not None else [])
        t1 = time.perf_counter()
        verified = verify(lm.model, batch, drafts)
        mx.eval(arrays_of(verified), verified.argmax if verified.argmax is not None else [])
        t2 = time.perf_counter()
        accepted = accept(verified, batch.rows)
        t3 = time.perf_counter()
        commit(batch, accepted)
        mx.eval([c.state for c in batch.cache], [s.owed.hidden for s in batch.rows if s.owed.hidden is not None])
        t4 = time.perf_counter()
        for s, tokens in zip(batch.rows, accepted.tokens):
            s.committed += tokens
        if r >= 3:
            for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
                times[k].append(v * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--depths", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    lm = load_model(args.model or default_model_path())
    from mtp_serve.engine.warmup import calibrate_blas_threads, decode_matmuls_note

    threads = calibrate_blas_threads(lm.model, lm.tokenizer, max(args.depths))  # as mtp-serve does at start-up
    print(f"model {lm.path}  {mtp_serve.BACKEND.note}; {decode_matmuls_note(threads)}")
    print(f"{'B':>3} {'K':>2} {'draft ms':>9} {'verify ms':>10} {'accept ms':>10} {'commit ms':>10} {'round ms':>9}   shares")
    for B in args.batch:
        for K in args.depths:
            t = time_rounds(lm, B, K, args.rounds)
            shares = " ".join(f"{k} {100 * t[k] / t['round']:.0f}%" for k in ("draft", "verify", "accept", "commit"))
            print(f"{B:>3} {K:>2} {t['draft']:>9.2f} {t['verify']:>10.2f} {t['accept']:>10.2f} {t['commit']:>10.2f} {t['round']:>9.2f}   {shares}")


if __name__ == "__main__":
    main()

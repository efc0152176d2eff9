"""Continuous batching with per-row MTP vs batched plain vs sequential MTP.

    python bench/bench_batching.py [--model DIR] [--concurrency 1 2 4 8] [--max-tokens 128] [--json out.json]
                                   [--baseline-rev REV]

For each concurrency c, the same c prompts are decoded greedily three ways, in
one run, alternating: (1) batched with MTP (each row's depth chosen by the
measured policy), (2) batched plain (depth 0), (3) sequentially, one request
at a time, with single-stream MTP. Each batched mode first runs once untimed
(tracing kernels for the batch shapes; the policy measuring its round costs,
which a running server does once), then `--repeats` timed runs, the best
reported. Prints aggregate and per-request tokens/s, acceptance per row, and
ratios to single-stream plain decoding and to batched plain.

Then two comparisons:
- mixed depths: one request with `mtp_depth: 0` among three MTP requests; the
  three MTP rows' throughput against the same rows decoded batched plain;
- one stream through the unified round (this tree) against the single-sequence
  path of `--baseline-rev` (default: the revision before the round was unified),
  each in its own worker process, alternating requests; median of paired ratios.
"""

from __future__ import annotations

import mtp_serve  # noqa: F401  (backend set-up before mlx)

import argparse
import json
import statistics
import time
from pathlib import Path

from mtp_serve.engine.policy import DepthPolicy
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.engine.scheduler import Scheduler
from mtp_serve.models.demo_model import default_model_path
from mtp_serve.models.loader import load_model

from common import progress

PROMPTS = [
    "import os\nimport sys\n\ndef main(argv):\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "for i, line in enumerate(lines):\n    if not line.strip():\n",
    "try:\n    import json\nexcept ImportError:\n",
    "def read_config(path):\n    with open(path) as f:\n",
    "    def __repr__(self):\n        return ",
    "if __name__ == '__main__':\n",
]


BASELINE_REV = "dbc9a73"  # the last revision with separate single-sequence and batched rounds


def run(lm, prompts, max_tokens, depth, policy, max_batch):
    """`depth`: one for every request, or a list (one per request)."""
    sched = Scheduler(lm.model, lm.tokenizer, max_batch_size=max_batch, prefill_chunk=512, policy=policy)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    depths = depth if isinstance(depth, list) else [depth] * len(prompts)
    for i, p in enumerate(prompts):
        sched.add(i, p, params, depths[i])
    first_token, done, tokens, stats = {}, {}, {i: [] for i in range(len(prompts))}, {}
    t0 = time.perf_counter()
    while sched.has_work():
        for key, chunk in sched.step():
            tokens[key] += chunk.token_ids
            first_token.setdefault(key, time.perf_counter() - t0)
            if chunk.finish_reason:
                done[key] = time.perf_counter() - t0
                stats[key] = chunk.stats.as_dict()
    wall = time.perf_counter() - t0
    n = sum(len(t) for t in tokens.values())
    per_req = [len(tokens[k]) / (done[k] - first_token[k]) for k in tokens if done[k] > first_token[k]]
    return {
        "tokens": tokens,
        "aggregate_tok_s": n / wall,
        "per_request_tok_s": sum(per_req) / len(per_req) if per_req else 0.0,
        "row_tok_s": [len(tokens[k]) / (done[k] - first_token[k]) for k in sorted(tokens)],
        "acceptance_per_row": [stats[k]["acceptance_rate"] for k in sorted(stats)],
        "drafted_per_row": [stats[k]["drafted"] for k in sorted(stats)],
    }


def mixed_depths(lm, encode, max_tokens, depth, repeats):
    """Three MTP rows beside one `mtp_depth: 0` row, against the same four rows batched plain."""
    prompts = [encode(PROMPTS[i]) for i in range(4)]
    depths = [depth, depth, depth, 0]
    policy = DepthPolicy(max_depth=depth)
    run(lm, prompts, max_tokens, depths, policy, 8)  # untimed: costs measured, shapes traced
    run(lm, prompts, max_tokens, 0, DepthPolicy(max_depth=0), 8)
    ratios, same, drafted = [], True, []
    for _ in range(repeats):
        mixed = run(lm, prompts, max_tokens, depths, policy, 8)
        drafted.append(mixed["drafted_per_row"])
        plain = run(lm, prompts, max_tokens, 0, DepthPolicy(max_depth=0), 8)
        ratios.append(sum(mixed["row_tok_s"][:3]) / sum(plain["row_tok_s"][:3]))
        same &= mixed["tokens"] == plain["tokens"]
    return {"mtp_rows_vs_batched_plain": round(statistics.median(ratios), 3), "ratios": [round(r, 3) for r in ratios],
            "drafted_per_row": drafted[-1], "identical": same}


def unified_vs_baseline(model_path, encode, max_tokens, depth, rev, repeats, blas_threads):
    """One stream: this tree's round (a batch of one) against `rev`'s single-sequence round,
    both with decode matmuls on `blas_threads` (this process's calibrated choice)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from revisions import RevisionWorker

    prompts = [encode(p) for p in PROMPTS]
    ratios, same = [], True
    with RevisionWorker(rev, model_path, blas_threads, calibrate=False) as old, \
            RevisionWorker(None, model_path, blas_threads, calibrate=False) as new:
        for w in (old, new):  # warm up: kernels traced, caches allocated
            w.decode(prompts[0], 32, depth)
        for r in range(repeats):
            for i, p in enumerate(prompts):
                pair = (old, new) if (r + i) % 2 == 0 else (new, old)  # alternate which side goes first
                res = {w: w.decode(p, max_tokens, depth) for w in pair}
                speed = {w: res[w]["generated"] / res[w]["decode_s"] for w in pair}
                ratios.append(speed[new] / speed[old])
                same &= res[old]["tokens"] == res[new]["tokens"]
    return {"baseline_rev": rev, "unified_vs_baseline": round(statistics.median(ratios), 3), "pairs": len(ratios),
            "min": round(min(ratios), 3), "max": round(max(ratios), 3), "identical": same}


def sequential(lm, prompts, max_tokens, depth):
    res = [run(lm, [p], max_tokens, depth, DepthPolicy(max_depth=depth, fixed=True), 1) for p in prompts]
    tokens = {i: r["tokens"][0] for i, r in enumerate(res)}
    total_time = sum(len(r["tokens"][0]) / r["aggregate_tok_s"] for r in res)
    return {
        "tokens": tokens,
        "aggregate_tok_s": sum(len(t) for t in tokens.values()) / total_time,
        "per_request_tok_s": sum(r["per_request_tok_s"] for r in res) / len(res),
        "acceptance_per_row": [r["acceptance_per_row"][0] for r in res],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=None, help="max drafts (default: model card)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per mode; the best is reported")
    ap.add_argument("--baseline-rev", default=BASELINE_REV, help="revision whose single-sequence round B=1 is compared with")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    lm = load_model(args.model or default_model_path())
    from mtp_serve.engine.warmup import calibrate_blas_threads

    depth = args.depth or lm.card.default_mtp_depth
    threads = calibrate_blas_threads(lm.model, lm.tokenizer, depth)  # as mtp-serve does at start-up
    encode = lambda s: lm.tokenizer.encode(s)  # noqa: E731
    print(f"model {lm.path}  depth<={depth}  max_tokens {args.max_tokens}  {mtp_serve.BACKEND.note}")
    # Warm up (compilation, allocation) so the first measured mode is not penalised.
    run(lm, [encode(PROMPTS[0])] * 2, 8, depth, DepthPolicy(max_depth=depth), 8)
    base_plain = sequential(lm, [encode(PROMPTS[0])], args.max_tokens, 0)["aggregate_tok_s"]
    rows, policy = [], DepthPolicy(max_depth=depth)
    for c in args.concurrency:
        prompts = [encode(PROMPTS[i % len(PROMPTS)]) for i in range(c)]
        best = {}
        # One untimed pass per mode first: kernels for this batch size are traced, and the
        # depth policy measures its round costs (a server does that once, not per request).
        for fn in (lambda: run(lm, prompts, args.max_tokens, depth, policy, 8),
                   lambda: run(lm, prompts, args.max_tokens, 0, DepthPolicy(max_depth=0), 8)):
            fn()
        for _ in progress(range(args.repeats), f"concurrency {c}: repeats"):
            for name, fn in (
                ("batched_mtp", lambda: run(lm, prompts, args.max_tokens, depth, policy, 8)),
                ("batched_plain", lambda: run(lm, prompts, args.max_tokens, 0, DepthPolicy(max_depth=0), 8)),
                ("sequential_mtp", lambda: sequential(lm, prompts, args.max_tokens, depth)),
            ):
                r = fn()
                if name not in best or r["aggregate_tok_s"] > best[name]["aggregate_tok_s"]:
                    best[name] = r
        same = best["batched_mtp"]["tokens"] == best["batched_plain"]["tokens"] == best["sequential_mtp"]["tokens"]
        row = {
            "concurrency": c,
            **{f"{k}_tok_s": round(v["aggregate_tok_s"], 1) for k, v in best.items()},
            **{f"{k}_per_request_tok_s": round(v["per_request_tok_s"], 1) for k, v in best.items()},
            "mtp_vs_batched_plain": round(best["batched_mtp"]["aggregate_tok_s"] / best["batched_plain"]["aggregate_tok_s"], 3),
            "mtp_vs_single_plain": round(best["batched_mtp"]["aggregate_tok_s"] / base_plain, 3),
            "acceptance_per_row": best["batched_mtp"]["acceptance_per_row"],
            "greedy_outputs_identical": same,
        }
        rows.append(row)
    print(f"\nsingle-stream plain decoding: {base_plain:.1f} tok/s (the 1.0x reference)")
    print(f"{'conc':>4} {'batched MTP':>12} {'batched plain':>14} {'seq MTP':>9} {'MTP/plain-batch':>16} {'MTP/single-plain':>17} {'identical':>9}  acceptance per row")
    for r in rows:
        print(f"{r['concurrency']:>4} {r['batched_mtp_tok_s']:>12} {r['batched_plain_tok_s']:>14} {r['sequential_mtp_tok_s']:>9} "
              f"{r['mtp_vs_batched_plain']:>15}x {r['mtp_vs_single_plain']:>16}x {str(r['greedy_outputs_identical']):>9}  {r['acceptance_per_row']}")
    print("policy:", json.dumps(policy.summary()))
    mixed = mixed_depths(lm, encode, args.max_tokens, depth, args.repeats + 1)
    print(f"\nmixed depths (3 MTP rows + 1 row at mtp_depth 0): MTP rows {mixed['mtp_rows_vs_batched_plain']}x "
          f"the same rows batched plain (runs: {mixed['ratios']}); drafted per row {mixed['drafted_per_row']}; "
          f"outputs identical: {mixed['identical']}")
    baseline = None
    if not args.skip_baseline:
        baseline = unified_vs_baseline(str(lm.path), encode, args.max_tokens, depth, args.baseline_rev, args.repeats, threads)
        print(f"one stream, depth {depth}: unified round {baseline['unified_vs_baseline']}x the single-sequence round of "
              f"{baseline['baseline_rev']} (median of {baseline['pairs']} paired ratios, min {baseline['min']}, "
              f"max {baseline['max']}); outputs identical: {baseline['identical']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"single_plain_tok_s": base_plain, "rows": rows, "policy": policy.summary(), "mixed": mixed,
                       "unified_vs_baseline": baseline}, f, indent=1)


if __name__ == "__main__":
    main()

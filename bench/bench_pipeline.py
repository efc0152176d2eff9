"""Pipelined plain decoding against the unpipelined loop, side by side in one process.

    python bench/bench_pipeline.py [--model DIR] [--max-tokens 128] [--prompts 6] [--rows 4]
                                   [--depth 3] [--repeats 1] [--skip-mlx-lm] [--json PATH]
    python bench/bench_pipeline.py --dispatch    # how long mx.async_eval holds the caller, by graph size

The demo model by default (the one `mtp-serve` runs with no --model). On held-out code
prompts, greedy, every mode once per prompt in round-robin order (rotated per prompt, to
spread machine noise over the modes), after one untimed warm-up run per mode; the two modes of
each pair run back to back (their order alternating per prompt), and each pair's ratio is the
median of its per-prompt ratios, so load that changes between prompts cancels:

* `plain`: depth 0, the next step's backbone pass started before the current step's token
  reaches the host (`engine/pipeline.py`), against `plain unpipelined`;
* `mlx-lm plain`: `mlx_lm.generate.generate_step` (which pipelines the same way) on a
  stock-loaded copy cast to fp32, for reference;
* `batch xR`: R prompts decoded together in one batch, pipelined and not;
* `mtp dK`: MTP at a fixed depth with pipelining on and off (its rounds draft, so they run
  unpipelined either way: the pair shows what pipelining costs where it does not apply).

Decode tok/s counts tokens after the first over the time from the first to the last token
(prefill excluded). Each pair's tokens must be identical; the script says so per pair.
"""

from __future__ import annotations

import mtp_serve  # noqa: F401  (before mlx.core: OpenBLAS preload, fp32 on CPU)

import argparse
import os
import sys
from pathlib import Path
from typing import Dict, List

import mlx.core as mx

from bench_speed import MlxLmPlain
from common import RunResult, environment, fp32, load_prompts, median, pc, write_json
from mtp_serve import BACKEND
from mtp_serve.engine.policy import DepthPolicy
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.engine.scheduler import Scheduler


def decode(lm, prompts: List[List[int]], n: int, depth: int, pipeline: bool) -> RunResult:
    """The prompts decoded together (one batch), greedy; tokens of every row, in order."""
    sched = Scheduler(lm.model, lm.tokenizer, max_batch_size=len(prompts), prefill_chunk=None,
                      policy=DepthPolicy(max_depth=depth, fixed=True), copy_max=0, pipeline=pipeline)
    for i, p in enumerate(prompts):
        sched.add(i, p, SamplingParams(max_tokens=n, ignore_eos=True), depth)
    out: Dict[int, List[int]] = {i: [] for i in range(len(prompts))}
    t0, t_first, t_last = pc(), None, None
    while sched.has_work():
        for key, chunk in sched.step():
            if isinstance(chunk, BaseException):
                raise chunk
            out[key] += chunk.token_ids
            t_last = pc()
            if t_first is None and len(out) == len(prompts) and all(out.values()):
                t_first = t_last
    tokens = [t for i in range(len(prompts)) for t in out[i]]
    return RunResult(tokens, t_first - t0, t_last - t_first,
                     {"launched": sched.launched, "undone": sched.undone, "rows": len(prompts)})


def dispatch_table(sizes=(10, 25, 50, 100, 200)) -> None:
    """How long `mx.async_eval` holds the caller on this device: a chain of n matmuls (2n nodes),
    the time until the call returns against the time until the result is ready."""
    a = mx.random.normal((384, 384))
    mx.eval(a)
    print(f"{'ops':>5s} {'async_eval returns (ms)':>24s} {'result ready (ms)':>18s} {'share':>6s}")
    for n in sizes:
        x = a
        for _ in range(n):
            x = (x @ a) * 384**-0.5  # (keeps the scale: no denormals)
        t0 = pc()
        mx.async_eval(x)
        t1 = pc()
        mx.eval(x)
        t2 = pc()
        print(f"{n:5d} {1e3 * (t1 - t0):24.1f} {1e3 * (t2 - t0):18.1f} {(t1 - t0) / (t2 - t0):6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the embedded demo model)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--rows", type=int, default=4, help="rows of the batched pair (0 or 1: none)")
    ap.add_argument("--depth", type=int, default=3, help="depth of the MTP pair (0: none)")
    ap.add_argument("--repeats", type=int, default=1, help="passes over the prompts (more back-to-back pairs)")
    ap.add_argument("--skip-mlx-lm", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dispatch", action="store_true", help="only: how long mx.async_eval holds the caller, by graph size")
    args = ap.parse_args()
    if args.dispatch:
        print(f"{BACKEND.note}; load {os.getloadavg()[0]:.2f}")
        dispatch_table()
        return

    from mtp_serve.models.demo_model import default_model_path
    from mtp_serve.models.loader import load_model

    path = args.model or default_model_path()
    lm = load_model(path)
    from mtp_serve.engine.warmup import calibrate_blas_threads

    calibrate_blas_threads(lm.model, lm.tokenizer, max(args.depth, 1))  # as mtp-serve does at start-up
    prompts, source = load_prompts(Path(path), lm.tokenizer, args.prompts, args.prompt_tokens)
    prompts = prompts * args.repeats
    print(f"Pipelined decoding: {path} ({lm.mtp_status}), {BACKEND.note}; {len(prompts)} prompts x "
          f"{args.prompt_tokens} tokens from {source}; {args.max_tokens} new tokens, greedy; "
          f"load {os.getloadavg()[0]:.2f}", flush=True)

    modes = {"plain": lambda p: decode(lm, [p], args.max_tokens, 0, True),
             "plain unpipelined": lambda p: decode(lm, [p], args.max_tokens, 0, False)}
    pairs = [("plain", "plain unpipelined")]
    if not args.skip_mlx_lm:
        from mlx_lm import load as mlx_lm_load

        ref, _ = mlx_lm_load(path)
        fp32(ref)
        mx.eval(ref.parameters())
        modes["mlx-lm plain"] = lambda p, m=MlxLmPlain(ref, blas_threads=1): m.run(p, args.max_tokens)
    if args.rows > 1:
        group = lambda i: [prompts[(i + j) % len(prompts)][1] for j in range(args.rows)]  # noqa: E731
        index = {tuple(p): i for i, (_, p) in enumerate(prompts)}
        modes[f"batch x{args.rows}"] = lambda p: decode(lm, group(index[tuple(p)]), args.max_tokens, 0, True)
        modes[f"batch x{args.rows} unpipelined"] = lambda p: decode(lm, group(index[tuple(p)]), args.max_tokens, 0, False)
        pairs.append((f"batch x{args.rows}", f"batch x{args.rows} unpipelined"))
    if args.depth > 0 and lm.model.has_mtp:
        modes[f"mtp d{args.depth}"] = lambda p: decode(lm, [p], args.max_tokens, args.depth, True)
        modes[f"mtp d{args.depth} unpipelined"] = lambda p: decode(lm, [p], args.max_tokens, args.depth, False)
        pairs.append((f"mtp d{args.depth}", f"mtp d{args.depth} unpipelined"))

    names = list(modes)
    for name in names:  # warm-up: compiled steps, kernel caches
        modes[name](prompts[0][1])
    results: Dict[str, List[RunResult]] = {n: [] for n in names}
    loads = [os.getloadavg()[0]]
    units = [list(pair) for pair in pairs] + [[n] for n in names if not any(n in pair for pair in pairs)]
    for i, (_, prompt) in enumerate(prompts):
        for unit in units[i % len(units):] + units[: i % len(units)]:
            for name in (unit if i % 2 == 0 else unit[::-1]):
                results[name].append(modes[name](prompt))
        loads.append(os.getloadavg()[0])

    rate = {n: median([r.decode_tok_s for r in rs]) for n, rs in results.items()}
    print(f"\n{'mode':28s} {'tok/s':>8s}  {'passes started/undone':>22s}")
    for n in names:
        ex = results[n][0].extra
        started = f"{sum(r.extra.get('launched', 0) for r in results[n])}/{sum(r.extra.get('undone', 0) for r in results[n])}"
        print(f"{n:28s} {rate[n]:8.1f}  {started if 'launched' in ex else '-':>22s}")
    print()
    summary = {}
    for a, b in pairs:
        same = all(x.tokens == y.tokens for x, y in zip(results[a], results[b]))
        ratios = sorted(x.decode_tok_s / y.decode_tok_s for x, y in zip(results[a], results[b]))
        summary[a] = {"ratio": median(ratios), "ratios": ratios, "identical": same}
        best = max(x.decode_tok_s for x in results[a]) / max(y.decode_tok_s for y in results[b])
        summary[a]["best_ratio"] = best
        print(f"{a} / {b}: {median(ratios):.3f}x (median of {len(ratios)} back-to-back pairs, "
              f"{ratios[0]:.2f}-{ratios[-1]:.2f}; best run over best run {best:.3f}x); tokens identical: {same}")
    if "mlx-lm plain" in rate:
        same = sum(x.tokens == y.tokens for x, y in zip(results["plain"], results["mlx-lm plain"]))
        print(f"plain / mlx-lm plain: {rate['plain'] / rate['mlx-lm plain']:.3f}x; "
              f"identical to mlx-lm on {same}/{len(prompts)} prompts")
    print(f"load average during the run: {min(loads):.2f}-{max(loads):.2f}")
    if args.json:
        write_json(args.json, {"environment": environment(sys.argv), "tok_s": rate, "pairs": summary,
                               "load": loads})


if __name__ == "__main__":
    main()

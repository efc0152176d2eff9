"""Decode-sized matmuls: OpenBLAS against mtp-serve's skinny sgemm, side by side in one run.

    python bench/bench_decode_matmuls.py [--shapes 0.8b] [--depths 0 4] [--repeats 3] [--skip-demo]

Modes (switched in this process, alternating, so machine noise spreads over them):
OpenBLAS on one thread / on every core, and the skinny sgemm
(`mtp_serve/native/skinny_sgemm.c`) on one thread / on every core, here taking every
product of at most 8 rows (mtp-serve leaves weights under 4 MB to OpenBLAS). For each mode:

1. y = x W^T with x of M = 1..8 rows, at Qwen3.5-0.8B's LM-head and MLP shapes:
   milliseconds and effective GB/s of weights streamed;
2. the demo model: decode tokens/s, plain and MTP at `--depths` (greedy, held-out
   prompts), and each mode's ratio to OpenBLAS on every core;
3. random weights with Qwen3.5-0.8B's layer shapes (`bench/cost_model.py`): a plain
   step in ms, and each verify window T = 2..5 in plain steps (the cost MTP pays to
   check T-1 drafts), plus one draft.
"""

from __future__ import annotations

from common import median_seconds, pc  # noqa: I001  (first: sets up the backend, OpenBLAS, before mlx.core is imported)

import argparse
import statistics
from typing import Dict, List, Tuple

import mlx.core as mx

from cost_model import QWEN35_VOCAB, measure_costs, qwen35_08b_text, random_mtp_model
from mtp_serve import BACKEND, skinny_gemm
from mtp_serve.backend import set_decode_blas_threads
from mtp_serve.engine.generator import generate
from mtp_serve.engine.sampling import SamplingParams

Mode = Tuple[str, bool, object]  # name, skinny, decode threads (None: every core)
MODES: List[Mode] = [("openblas all", False, None), ("openblas 1thr", False, 1), ("skinny all", True, None),
                     ("skinny 1thr", True, 1)]
PROMPTS = ["import os\nimport sys\n\ndef main(argv):\n    ", "class Stack:\n    def __init__(self):\n",
           "def read_config(path):\n    with open(path) as f:\n", "for i, line in enumerate(lines):\n"]


def use(mode: Mode) -> None:
    _, skinny, threads = mode
    skinny_gemm.set_enabled(skinny, min_elements=0)  # every product of at most 8 rows, small matrices too
    set_decode_blas_threads(threads)


def matmul_table(modes: List[Mode]) -> None:
    from mtp_serve.backend import blas_threads_for

    print("\n1. y = x W^T, milliseconds (GB/s of W streamed)")
    for N, K, what in [(QWEN35_VOCAB, 1024, "0.8B LM head"), (3584, 1024, "0.8B MLP up")]:
        W = mx.random.normal((N, K)) * 0.02
        mx.eval(W)
        print(f"  {what} [{N} x {K}]")
        for mode in modes:
            use(mode)
            blas_threads_for(1)
            cells = []
            for M in (1, 2, 4, 5, 8):
                x = mx.random.normal((M, K))
                mx.eval(x)
                big = N * K > 1 << 24  # a small product is timed 20 at a time, as a decode step issues them
                per_call, reps = (1, 5) if big else (20, 50)
                s = median_seconds(lambda: mx.eval([x @ W.T for _ in range(per_call)]), reps) / per_call
                cells.append(f"M{M} {s * 1e3:6.2f} ({N * K * 4 / s / 1e9:4.1f})")
            print(f"    {mode[0]:14s} " + "  ".join(cells))
        del W


def demo_table(modes: List[Mode], depths: List[int], repeats: int, max_tokens: int) -> None:
    from mtp_serve.models.demo_model import default_model_path
    from mtp_serve.models.loader import load_model

    lm = load_model(default_model_path())
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS]

    def tok_s(depth: int) -> float:
        n, t = 0, 0.0
        for p in prompts:
            it = generate(lm.model, lm.tokenizer, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True), depth)
            next(it)
            t0 = pc()
            n += sum(len(c.token_ids) for c in it)
            t += pc() - t0
        return n / t

    for mode in modes:  # warm-up: every path traced once
        use(mode)
        for d in depths:
            tok_s(d)
    runs: Dict[Tuple[str, int], List[float]] = {}
    for r in range(repeats):
        order = modes[r % len(modes):] + modes[: r % len(modes)]
        for mode in order:
            use(mode)
            for d in depths:
                runs.setdefault((mode[0], d), []).append(tok_s(d))
    print(f"\n2. demo model decode, tok/s (median of {repeats}; x: paired ratio to {modes[0][0]})")
    print("    " + " " * 14 + "".join(f"{'depth ' + str(d):>22s}" for d in depths))
    for mode in modes:
        cells = []
        for d in depths:
            ratio = statistics.median(a / b for a, b in zip(runs[(mode[0], d)], runs[(modes[0][0], d)]))
            cells.append(f"{statistics.median(runs[(mode[0], d)]):8.1f} tok/s {ratio:5.2f}x")
        print(f"    {mode[0]:14s}" + "".join(f"{c:>22s}" for c in cells))


def shape_table(modes: List[Mode]) -> None:
    print("\n3. Qwen3.5-0.8B shapes, random weights: plain step, verify windows and a draft in plain steps")
    model = random_mtp_model(qwen35_08b_text(QWEN35_VOCAB))
    for mode in modes:
        use(mode)
        med = measure_costs(model, reps=3, log=lambda *_: None)
        plain = med["plain"]
        cells = "  ".join(f"T{T} {med[f'verify{T}'] / plain:.2f}" for T in range(2, 6))
        print(f"    {mode[0]:14s} plain {plain * 1e3:6.1f} ms   {cells}   draft {med['draft'] / plain:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", type=int, nargs="+", default=[0, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--skip-demo", action="store_true")
    ap.add_argument("--skip-shapes", action="store_true")
    args = ap.parse_args()
    print(BACKEND.note)
    if not skinny_gemm.active():
        print("the skinny sgemm is not loaded here (no OpenBLAS, no AVX2/FMA, or MTP_SERVE_NO_SKINNY_GEMM=1)")
        return
    matmul_table(MODES)
    if not args.skip_demo:
        demo_table(MODES, args.depths, args.repeats, args.max_tokens)
    if not args.skip_shapes:
        shape_table(MODES)


if __name__ == "__main__":
    main()

"""qwen4_exp's batched backbone against running the rows one by one.

    python bench/bench_qwen4_exp_batch.py [--batch 2 4] [--window 1 3] [--experts 16] [--vocab 32768] [--repeats 7]

A random Qwen3.8-Flash-Next-shaped model (`cost_model.flash_next_text`: hidden 2048, 4 streams,
8 layers: 6 GatedDeltaNet with PLE on 2, 2 QSA attention; `--experts` of the 512 experts, top 10
and a shared one; fp32). B rows are prefilled on prompts of different lengths and merged as the
engine's batch merges them; then a decode step (window 1) or a verify window (window 3) over
all rows is timed two ways, alternating, in one run: the batched backbone (one pass, GatedDeltaNet
states and PLE windows stacked, attention on each row's own cache) and row by row (each row's
own forward on its own caches, the form the batch took before). Prints the medians and the ratio.
"""

from __future__ import annotations

import mtp_serve  # noqa: F401  (backend set-up before mlx)

import argparse
import os
import time

import mlx.core as mx

from common import median
from cost_model import flash_next_text, random_qwen4_exp_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--window", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    from mtp_serve.models.qwen4_exp_mtp import merge_rows

    model = random_qwen4_exp_model({**flash_next_text(args.vocab), "num_experts": args.experts})
    print(f"load {os.getloadavg()[0]:.1f} at start")
    for B in args.batch:
        prompts = [list(range(100 + 7 * i, 100 + 7 * i + 24 + 5 * i)) for i in range(B)]
        rows = [model.make_cache() for _ in prompts]
        for p, c in zip(prompts, rows):
            mx.eval(model.forward(mx.array([p]), c)[1])
        batch = merge_rows([list(layer) for layer in zip(*rows)])
        for T in args.window:
            tokens = mx.array([[5 + i + j for j in range(T)] for i in range(B)])

            def batched():
                mx.eval(model.forward(tokens, batch)[1])

            def row_by_row():
                mx.eval(mx.concatenate([model.forward(tokens[i : i + 1], c)[1] for i, c in enumerate(rows)]))

            batched(), row_by_row()  # trace the shapes
            times = {"batched": [], "rows": []}
            for _ in range(args.repeats):
                for name, f in (("batched", batched), ("rows", row_by_row)):
                    t = time.perf_counter()
                    f()
                    times[name].append(time.perf_counter() - t)
            b, r = median(times["batched"]), median(times["rows"])
            print(f"B={B} T={T}: batched {b * 1e3:.0f} ms, row by row {r * 1e3:.0f} ms, "
                  f"row by row / batched {r / b:.2f}x (load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()

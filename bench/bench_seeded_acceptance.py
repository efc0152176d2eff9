"""Draft acceptance of seeded sampling (the Gumbel coupling) against unseeded sampling
(rejection sampling), same model, same prompts, same depth, at a few temperatures.

A seeded request accepts a draft only when the target's own draw with the position's noise
is that token (so it reproduces plain decoding exactly); an unseeded one accepts d with
probability min(1, p(d)/q(d)). Both emit the plain sampler's distribution; the coupling
gives up some acceptance for reproducibility. For each temperature the modes alternate
prompt by prompt (seeded, unseeded, ...), every run decoding `--new-tokens` tokens at
fixed depth `--depth`; per draft position j, the share of rounds whose j-th draft was
accepted (so the first j were too), and the tokens a round emits on average.

    python bench/bench_seeded_acceptance.py --prompts 6 --new-tokens 64 --depth 3 --temps 0.3 0.7 1.0
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import REPO, environment, load_prompts, write_json

from mtp_serve.engine.generator import generate
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.models.loader import load_model


def run(lm, prompt, temp: float, seed, depth: int, n: int):
    params = SamplingParams(temperature=temp, seed=seed, max_tokens=n, ignore_eos=True)
    stats = None
    for chunk in generate(lm.model, lm.tokenizer, prompt, params, depth):
        stats = chunk.stats
    return stats


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "models" / "demo"))
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--temps", type=float, nargs="+", default=[0.3, 0.7, 1.0])
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    lm = load_model(args.model, enable_mtp=True)
    prompts, source = load_prompts(Path(args.model), lm.tokenizer, args.prompts, args.prompt_tokens)
    print(f"{len(prompts)} prompts: {source}; depth {args.depth}, {args.new_tokens} tokens each")
    rows = []
    for temp in args.temps:
        totals = {"seeded": ([0] * args.depth, [0] * args.depth), "unseeded": ([0] * args.depth, [0] * args.depth)}
        for i, (_, prompt) in enumerate(prompts):
            for mode in ("seeded", "unseeded") if i % 2 == 0 else ("unseeded", "seeded"):
                st = run(lm, prompt, temp, 1000 + i if mode == "seeded" else None, args.depth, args.new_tokens)
                drafted, accepted = totals[mode]
                for j, (d, a) in enumerate(zip(st.drafted, st.accepted)):
                    drafted[j] += d
                    accepted[j] += a
        row = {"temperature": temp}
        for mode, (drafted, accepted) in totals.items():
            row[mode] = {"per_position": [round(a / d, 3) if d else None for a, d in zip(accepted, drafted)],
                         "overall": round(sum(accepted) / max(1, sum(drafted)), 3),
                         "tokens_per_round": round(1 + sum(accepted) / max(1, drafted[0]), 3)}
        row["overall_ratio"] = round(row["seeded"]["overall"] / max(1e-9, row["unseeded"]["overall"]), 3)
        rows.append(row)
        print(f"temp {temp}: seeded (coupling) {row['seeded']['per_position']} overall {row['seeded']['overall']}, "
              f"{row['seeded']['tokens_per_round']} tokens/round | unseeded (rejection) {row['unseeded']['per_position']} "
              f"overall {row['unseeded']['overall']}, {row['unseeded']['tokens_per_round']} tokens/round | "
              f"ratio {row['overall_ratio']}")
    result = {"environment": environment(argv), "prompts": source, "depth": args.depth, "new_tokens": args.new_tokens,
              "rows": rows}
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()

"""Exactness report: greedy identity against mlx-lm and sampled distributions, as numbers.

The tests assert these properties; this prints the figures behind them, using
the tests' own helpers:

* greedy: for every synthetic family (random head, and a head that agrees with
  the backbone often), depths 0-4, 3 prompts x 64 tokens: how many outputs are
  token-identical to mlx-lm's `generate_step`, acceptance and tokens per pass;
* sampled: 1,000 plain vs 1,000 MTP (depth 2) samples of 3 tokens under two
  sampling settings: chi-square p-values per position and for positions 1-2 jointly.

    python bench/exactness_report.py
"""
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import mtp_serve  # noqa: E402,F401  (before mlx.core)
from mtp_serve.testing.synthetic import MLX_LM_FAMILIES, write_synthetic_checkpoint  # noqa: E402
from mtp_serve.models.loader import load_model  # noqa: E402
from test_greedy_identity import N_TOKENS, PROMPTS, mtp_greedy, reference_greedy  # noqa: E402
from test_sampled_exactness import N_POS, chi2_pvalue, sample_many  # noqa: E402

SAMPLING = (
    {"temperature": 1.0, "top_k": 3, "top_p": 0.95},
    {"temperature": 1.0, "min_p": 0.02, "presence_penalty": 0.5, "frequency_penalty": 1.0, "repetition_penalty": 1.2},
)


def greedy_report(root: str) -> None:
    for family in MLX_LM_FAMILIES:
        for agreeable in (False, True):
            path = write_synthetic_checkpoint(f"{root}/{family}-{agreeable}", family, agreeable=agreeable)
            lm = load_model(str(path))
            refs = [reference_greedy(path, prompt, N_TOKENS)[0] for prompt in PROMPTS]
            parts = []
            for depth in (0, 1, 2, 3, 4):
                same, accepted, drafted, per_pass = 0, 0, 0, []
                for prompt, ref in zip(PROMPTS, refs):
                    ours, stats = mtp_greedy(lm, prompt, depth)
                    same += ours == ref
                    accepted += sum(stats.accepted)
                    drafted += sum(stats.drafted)
                    per_pass.append(stats.tokens_per_pass)
                part = f"d{depth}: {same}/{len(PROMPTS)} identical"
                if depth:
                    part += f", acc {accepted / drafted:.2f}, tok/pass {sum(per_pass) / len(per_pass):.2f}"
                parts.append(part)
            print(f"{family}{' (agreeable head)' if agreeable else ''}: " + "; ".join(parts), flush=True)


def sampled_report(root: str) -> None:
    lm = load_model(str(write_synthetic_checkpoint(f"{root}/sampled", "qwen3_5", agreeable=True)))
    for kw in SAMPLING:
        plain, _ = sample_many(lm, 0, 0, kw)
        mtp, (accepted, drafted) = sample_many(lm, 2, 10**6, kw)
        per_pos = [chi2_pvalue([s[p] for s in plain], [s[p] for s in mtp]) for p in range(N_POS)]
        joint = chi2_pvalue([tuple(s[1:3]) for s in plain], [tuple(s[1:3]) for s in mtp])
        print(f"sampled {kw}: {len(plain)} plain vs {len(mtp)} MTP (depth 2) samples of {N_POS} tokens, "
              f"{accepted}/{drafted} drafts accepted; chi-square p per position "
              f"{[round(float(p), 3) for p in per_pos]}, positions 1-2 joint p {joint:.3f}", flush=True)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as root:
        greedy_report(root)
        sampled_report(root)

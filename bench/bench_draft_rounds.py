"""A whole MTP round in plain steps, black-box through `mtp-generate`, with the drafts the
model's defaults choose against the head as stored over the whole vocabulary.

    python bench/bench_draft_rounds.py --build DIR        # a 0.8B-shaped 4-bit model, as a user makes one
    python bench/bench_draft_rounds.py DIR [--depths 3 7] [--repeats 2] [--tokens 64]

`--build DIR` writes a random-weight checkpoint with Qwen3.5-0.8B's shapes (the real
248,320-token vocabulary, bf16) to DIR/hf, converts it with stock `mlx_lm convert -q`
(4 bits, group 64) to DIR/q4 and grafts the head back with `mtp-graft` as it runs by
default (verify and tune: the drafts are chosen and stored there).

Then, alternating in one run: plain decoding (`--no-mtp`), and at each fixed depth
(`--mtp-depth K --fixed-depth`) the model's default drafts and `--draft-head-bits 0
--draft-vocab 0` (the head as grafted, every draft over the whole vocabulary). A round's
cost is its decode time per backbone pass over a plain step's (best of the repeats);
on random weights nothing is accepted, so a round is its K drafts plus one verify
window of K+1 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

PROMPT = "def merge_sorted(a, b):"


def build(out: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).parent))
    import mlx.core as mx

    from cost_model import QWEN35_VOCAB, qwen35_08b_text
    from mtp_serve.testing.synthetic import write_synthetic_checkpoint

    hf, q4 = out / "hf", out / "q4"
    write_synthetic_checkpoint(hf, "qwen3_5", dtype=mx.bfloat16, max_shard_tensors=200, **qwen35_08b_text(QWEN35_VOCAB))
    subprocess.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(hf), "--mlx-path", str(q4), "-q"], check=True)
    subprocess.run([sys.executable, "-m", "mtp_serve.cli.graft", "--from", str(hf), "--into", str(q4)], check=True)
    return q4


def run(model: str, tokens: int, args: list) -> dict:
    out = subprocess.run([sys.executable, "-m", "mtp_serve.cli.generate", "--model", model, "--prompt", PROMPT,
                          "--max-tokens", str(tokens), "--json", *args], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?")
    ap.add_argument("--build", type=Path, metavar="DIR")
    ap.add_argument("--depths", type=int, nargs="+", default=[3, 7])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    if a.build:
        print(f"built {build(a.build)}")
        return
    modes = {"plain": ["--no-mtp"]}
    for d in a.depths:
        fixed = ["--mtp-depth", str(d), "--fixed-depth"]
        modes[f"depth {d}, as grafted"] = fixed + ["--draft-head-bits", "0", "--draft-vocab", "0"]
        modes[f"depth {d}, defaults"] = fixed
    per_pass = {m: [] for m in modes}
    notes = {}
    for r in range(a.repeats):
        for m in (list(modes) if r % 2 == 0 else list(reversed(modes))):
            j = run(a.model, a.tokens, modes[m])
            s = j["stats"]
            per_pass[m].append(s["decode_s"] / s["backbone_passes"])
            notes[m] = (j.get("drafts"), s["generated_tokens"] / s["backbone_passes"])
    plain = min(per_pass["plain"])
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}; plain step {plain * 1e3:.1f} ms (best of {a.repeats})")
    print("| mode | drafts | round (plain steps), best | each run | tokens/pass |")
    print("|---|---|---|---|---|")
    for m in modes:
        if m == "plain":
            continue
        costs = [p / plain for p in per_pass[m]]
        drafts, tpp = notes[m]
        print(f"| {m} | {drafts} | {min(costs):.2f} | {' / '.join(f'{c:.2f}' for c in costs)} | {tpp:.2f} |")


if __name__ == "__main__":
    main()

"""A whole MTP round in plain steps, black-box through `mtp-generate`, with the drafts the
model's defaults choose against the head as stored over the whole vocabulary.

    python bench/bench_draft_rounds.py --build DIR        # a 0.8B-shaped 4-bit model, as a user makes one
    python bench/bench_draft_rounds.py DIR [--depths 3 7] [--repeats 2] [--tokens 64]
    python bench/bench_draft_rounds.py DIR --parts      # where a draft's time goes, per setting

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

`--parts` loads DIR in this process and times, in plain steps (medians): a T=4 window,
and one draft by part (the head's layer with its embedding and norms, the LM head over
the draft vocabulary, the whole draft with its argmax) for the head as stored, at 8 and
at 4 bits, each over the whole vocabulary and its 32,768 and 16,384 most frequent tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import mtp_serve  # noqa: F401  (backend set-up before mlx)

PROMPT = "def merge_sorted(a, b):"


def build(out: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).parent))
    import mlx.core as mx

    from cost_model import QWEN35_VOCAB, qwen35_08b_text
    from mtp_serve.testing.synthetic import write_synthetic_checkpoint

    hf, q4 = out / "hf", out / "q4"
    write_synthetic_checkpoint(hf, "qwen3_5", dtype=mx.bfloat16, max_shard_tensors=200, **qwen35_08b_text(QWEN35_VOCAB))
    subprocess.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(hf), "--mlx-path", str(q4), "-q"], check=True)
    graft = subprocess.run([sys.executable, "-m", "mtp_serve.cli.graft", "--from", str(hf), "--into", str(q4)])
    if graft.returncode not in (0, 3):  # 3: the head's drafts never land, as on random weights
        raise SystemExit(f"mtp-graft failed ({graft.returncode})")
    return q4


def run(model: str, tokens: int, args: list) -> dict:
    out = subprocess.run([sys.executable, "-m", "mtp_serve.cli.generate", "--model", model, "--prompt", PROMPT,
                          "--max-tokens", str(tokens), "--json", *args], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def parts(model_dir: str, reps: int = 15) -> None:
    import time

    import mlx.core as mx

    from mtp_serve.models.draft_head import group_size_of, quantized_head
    from mtp_serve.models.draft_vocab import load_draft_ids, tokenizer_order
    from mtp_serve.models.loader import load_model

    lm = load_model(model_dir, draft_vocab=0, draft_head_bits=0)
    m = lm.model
    ids = load_draft_ids(lm.path, m.vocab_size) or tokenizer_order(m.vocab_size)
    cache, head_cache = m.make_cache(), m.make_head_cache()
    prompt = mx.array([list(range(1, 9))])
    h, _ = m.forward(prompt, cache)
    hd, _ = m.draft(h[:, :4], prompt[:, 1:5], head_cache)
    hd = hd[:, -1:]
    mx.eval(hd)

    def median(fn) -> float:
        for _ in range(3):
            fn()
        xs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            xs.append(time.perf_counter() - t0)
        return sorted(xs)[reps // 2]

    def window(T):
        def f():
            mx.eval(m.forward(mx.array([[5] * T]), cache)[1])
            for c in cache:  # attention caches back to the context (GatedDeltaNet states just move on)
                if hasattr(c, "trim"):
                    c.trim(T)
        return f

    def head_layer():
        mx.eval(m.head_pass(hd, mx.array([[9]]), head_cache))
        head_cache.trim(1)

    def whole_draft():
        _, logits = m.draft(hd, mx.array([[9]]), head_cache)
        mx.eval(m.draft_argmax(logits[:, -1]))
        head_cache.trim(1)

    step = median(window(1))
    print(f"load average {os.getloadavg()[0]:.2f}; plain step {step * 1e3:.1f} ms; T=4 window {median(window(4)) / step:.2f} steps")
    print("| head | draft vocabulary | head layer | LM head | whole draft (plain steps) |")
    print("|---|---|---|---|---|")
    full = m.head
    group = group_size_of(lm.config.get("quantization") or lm.config.get("text_config", {}).get("quantization"))
    for bits in (0, 8, 4):
        m.head = full if bits == 0 else quantized_head(full, bits, group)
        for n in (0, 32768, 16384):
            m.use_draft_vocab(ids[:n] if n else None)
            lm_head = median(lambda: mx.eval(m.draft_logits(hd)))
            print(f"| {f'{bits}-bit' if bits else 'as stored'} | {n or 'whole'} | {median(head_layer) / step:.3f} | "
                  f"{lm_head / step:.3f} | {median(whole_draft) / step:.3f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?")
    ap.add_argument("--build", type=Path, metavar="DIR")
    ap.add_argument("--depths", type=int, nargs="+", default=[3, 7])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--parts", action="store_true")
    a = ap.parse_args()
    if a.parts:
        parts(a.model)
        return
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

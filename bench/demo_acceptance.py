"""Greedy MTP acceptance of a checkpoint's head on held-out code prompts.

For each prompt the backbone decodes greedily, one token at a time, exactly as
plain greedy decoding does (the model is loaded through the project's loader,
`mtp_serve.models.loader.load_model`). At every step, before the backbone
scores the next position, the head drafts from (H[p], emb(x[p+1])), where H[p]
is the backbone's hidden of the previous position and x[p+1] the token just
emitted, with its KV cache warm over the prompt. The draft is accepted when
it equals the backbone's next greedy token: that is exactly the depth-1
acceptance of greedy MTP decoding. Depth 2 chains the head on its own output
(hidden after `mtp.norm`, emb of draft 1); its acceptance is reported
conditional on draft 1 being accepted, and the expected tokens per depth-2
round follow from both.

Prompts: the held-out files of the demo model's training run
(`heldout_files.json` next to the checkpoint, paths relative to the Python
standard library this interpreter ships), `--prompt-tokens` tokens from a
third of the way into each file.

    python bench/demo_acceptance.py --model models/demo --prompts 10 --prompt-tokens 128 --new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import mtp_serve  # noqa: F401  (before mlx.core: preloads OpenBLAS)

import mlx.core as mx

from mtp_serve.models.draft_vocab import DRAFT_VOCAB_FILE, load_draft_ids
from mtp_serve.models.loader import load_model

REPO = Path(__file__).resolve().parents[1]


def heldout_prompts(model_dir: Path, tokenizer, n: int, length: int, src: Path) -> list[tuple[str, list[int]]]:
    files = json.loads((model_dir / "heldout_files.json").read_text())
    out = []
    for rel in files:
        p = src / rel
        if not p.exists():
            continue
        ids = tokenizer.encode(p.read_text(encoding="utf-8"), add_special_tokens=False)
        if len(ids) < length + 16:
            continue
        start = min(len(ids) // 3, len(ids) - length - 1)
        out.append((rel, ids[start : start + length]))
        if len(out) == n:
            break
    return out


def measure(model, prompt: list[int], new_tokens: int) -> dict:
    """Greedy decode `new_tokens` tokens; count depth-1 and depth-2 draft hits."""
    cache = model.make_cache()
    head_cache = model.make_head_cache()
    x = mx.array([prompt])
    H, logits = model.forward(x, cache)
    model.draft(H[:, :-1], x[:, 1:], head_cache)  # warm the head's KV over the prompt
    tok = mx.argmax(logits[:, -1], axis=-1)
    h_last = H[:, -1:]
    out = [tok.item()]
    hit1 = hit2 = tries2 = 0
    pending_d2 = None  # (depth-2 draft, whether its draft 1 was accepted)
    for _ in range(new_tokens):
        head_h, dl = model.draft(h_last, tok[:, None], head_cache)
        d1 = model.draft_argmax(dl[:, -1])
        _, dl2 = model.draft(head_h, d1[:, None], head_cache)  # chained step (speculative entry)
        d2 = model.draft_argmax(dl2[:, -1])
        head_cache.trim(1)
        H, logits = model.forward(tok[:, None], cache)
        nxt = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(d1, d2, nxt)
        if pending_d2 is not None and pending_d2[1]:
            tries2 += 1
            hit2 += int(pending_d2[0] == nxt.item())
        ok1 = d1.item() == nxt.item()
        hit1 += ok1
        pending_d2 = (d2.item(), ok1)
        tok, h_last = nxt, H[:, -1:]
        out.append(nxt.item())
    return dict(hit1=hit1, n1=new_tokens, hit2=hit2, n2=tries2, tokens=out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "models" / "demo"))
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--src", default=str(Path(os.__file__).parent), help="root the held-out paths are relative to")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each prompt's continuation")
    ap.add_argument("--draft-vocab", type=int, nargs="+", default=None, metavar="N",
                    help="also measure drafting from the checkpoint's N most frequent tokens (0: the whole vocabulary)")
    args = ap.parse_args(argv)

    lm = load_model(args.model)
    if not lm.model.has_mtp:
        sys.exit(f"{args.model}: {lm.mtp_status}")
    prompts = heldout_prompts(Path(args.model), lm.tokenizer, args.prompts, args.prompt_tokens, Path(args.src))
    if not prompts:
        sys.exit("no held-out prompts found (heldout_files.json missing, or the stdlib sources are not on this machine)")
    if not args.draft_vocab:
        results = {"summary": measure_all(lm, prompts, args)}
    else:  # one run per draft-vocabulary size, written together
        results = {"draft_vocab": {n: measure_with_draft_vocab(lm, prompts, n, args) for n in args.draft_vocab}}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results.get("summary", results)


def measure_with_draft_vocab(lm, prompts, size: int, args) -> dict:
    ids = load_draft_ids(lm.path, size) if size else None
    if size and ids is None:
        sys.exit(f"{lm.path}: no {DRAFT_VOCAB_FILE} (mtp-tune --draft-vocab-text FILE measures one)")
    lm.model.use_draft_vocab(ids)
    print(f"== drafting from {'the whole vocabulary' if ids is None else f'the {len(ids)} most frequent tokens'}")
    return measure_all(lm, prompts, args)


def measure_all(lm, prompts, args) -> dict:
    """The summary, with the per-prompt rows under "rows"."""
    t0 = time.time()
    rows = []
    for rel, ids in prompts:
        r = measure(lm.model, ids, args.new_tokens)
        r["file"] = rel
        rows.append(r)
        print(f"{rel:40s} depth-1 {r['hit1']:3d}/{r['n1']}  depth-2|1 {r['hit2']:3d}/{r['n2']}", flush=True)
        if args.verbose:
            print("   ", repr(lm.tokenizer.decode(r["tokens"])[:300]))
    h1, n1 = sum(r["hit1"] for r in rows), sum(r["n1"] for r in rows)
    h2, n2 = sum(r["hit2"] for r in rows), sum(r["n2"] for r in rows)
    a1 = h1 / n1
    a2 = h2 / n2 if n2 else 0.0
    res = dict(model=str(args.model), prompts=len(rows), prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
               depth1_acceptance=a1, depth2_conditional_acceptance=a2,
               expected_tokens_per_round_depth1=1 + a1, expected_tokens_per_round_depth2=1 + a1 + a1 * a2,
               seconds=time.time() - t0)
    print(f"greedy depth-1 acceptance: {a1:.3f} ({h1}/{n1}); depth-2 given depth-1: {a2:.3f} ({h2}/{n2})")
    print(f"expected tokens per round: depth 1 {1 + a1:.2f}, depth 2 {1 + a1 + a1 * a2:.2f}")
    res["rows"] = [{k: v for k, v in r.items() if k != "tokens"} for r in rows]
    return res


if __name__ == "__main__":
    main()

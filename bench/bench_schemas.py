"""Structured output over real-world schemas: what is served, what the output is, what it costs.

    python bench/bench_schemas.py [--model DIR] [--max-tokens 256] [--depth 3] [--limit N] [--json out.json]

Over the shipped sample of JSONSchemaBench (bench/data/jsonschemabench: 120 schemas, 12 per
category), each schema goes through the server's own path (`constraints.json_schema`, which
serves it with `schema_relax`) as a chat `response_format` would, in both modes:
- share served, strict and relaxed, per category (and why the rest were refused);
- the relaxed constraint decodes greedily (repetition penalty 1.3) on the model (default: the
  demo model), plain and with MTP at a fixed depth; the finished output is checked with the report responses carry
  (`structured.output_report`: jsonschema against the full original schema): share valid,
  and every invalid or cut one listed;
- compile time per schema (the rewriting, and llguidance's compile for this tokenizer; median,
  p99) and mask time (one next-token mask: median, p99; and per generated token);
- MTP against plain on the constrained outputs: token-identical outputs, tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Dict, List

from common import MaskTimes, pc
from mtp_serve.engine.generator import generate
from mtp_serve.engine.grammar import Constraint, GrammarCompiler
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.models.demo_model import default_model_path
from mtp_serve.models.loader import load_model
from mtp_serve.server import constraints, schema_relax, structured
from mtp_serve.server.errors import APIError

DATA = Path(__file__).resolve().parent / "data" / "jsonschemabench"
CATEGORIES = ("Github_trivial", "Github_easy", "Github_medium", "Github_hard", "Github_ultra", "Glaiveai2K",
              "JsonSchemaStore", "Kubernetes", "Snowplow", "WashingtonPost")
PROMPT = "Write one JSON document that follows the schema you were given."


def quantile(xs: List[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def decode(lm, prompt: List[int], constraint: Constraint, depth: int, max_tokens: int, repetition_penalty: float = 1.0):
    """(tokens, text, finish reason, seconds, mask times); greedy."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, constraint=constraint, repetition_penalty=repetition_penalty)
    toks, text, finish = [], [], None
    with MaskTimes() as mt:
        t = pc()
        for chunk in generate(lm.model, lm.tokenizer, prompt, params, depth):
            toks += chunk.token_ids
            text.append(chunk.text)
            finish = chunk.finish_reason or finish
        secs = pc() - t
    return toks, "".join(text), finish, secs, mt.times


def serve_both(schema: dict) -> Dict[str, object]:
    """Each mode's SchemaConstraint, or the 400's message; and the uncached rewrite time."""
    out: Dict[str, object] = {}
    schema_relax._serve.cache_clear()
    t = pc()
    for mode in ("relaxed", "strict"):
        try:
            out[mode] = constraints.json_schema(schema, "response_format.schema", mode)
        except APIError as e:
            out[mode] = e.message
    out["rewrite_s"] = pc() - t
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the demo model")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repetition-penalty", type=float, default=1.3,
                    help="greedy decoding's penalty (the demo model otherwise writes numbers of endless zeros)")
    ap.add_argument("--depth", type=int, default=3, help="MTP drafts per round (fixed)")
    ap.add_argument("--limit", type=int, default=None, help="schemas per category (default: all 12)")
    ap.add_argument("--no-decode", action="store_true", help="coverage and compile times only")
    ap.add_argument("--json", default=None, help="write every schema's result here")
    args = ap.parse_args()

    lm = load_model(args.model or default_model_path())
    tok = lm.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                     enable_thinking=False)
    eos = list(getattr(tok, "eos_token_ids", None) or [tok.eos_token_id])
    compiler = GrammarCompiler(getattr(tok, "_tokenizer", tok), lm.model.vocab_size, eos)
    decode(lm, prompt, Constraint.json_schema({"type": "object"}), args.depth, 8)  # warm-up

    rows = []
    for cat in CATEGORIES:
        for path in sorted((DATA / cat).glob("*.json"))[: args.limit]:
            schema = json.loads(path.read_text())
            served = serve_both(schema)
            row = {"category": cat, "file": path.name, "rewrite_ms": 1e3 * served["rewrite_s"],
                   "strict": not isinstance(served["strict"], str), "relaxed": not isinstance(served["relaxed"], str)}
            c = served["relaxed"]
            if not row["relaxed"]:
                row["refused"] = c
            else:
                s = c.served[""]
                row.update(relaxed_keywords=list(s.relaxed), ignored=list(s.ignored))
                t = pc()
                compiler.matcher(Constraint(c.kind, c.source))
                row["compile_ms"] = 1e3 * (pc() - t)
                if not row["strict"]:
                    row["strict_refusal"] = served["strict"]
                if not args.no_decode:
                    runs = {}
                    for name, depth in (("plain", 0), ("mtp", args.depth)):
                        toks, text, finish, secs, masks = decode(lm, prompt, Constraint(c.kind, c.source), depth,
                                                                 args.max_tokens, args.repetition_penalty)
                        runs[name] = {"tokens": toks, "text": text, "finish": finish, "seconds": secs, "masks": masks}
                    report = structured.output_report(c, runs["mtp"]["text"], [], runs["mtp"]["finish"])
                    row.update(finish=runs["mtp"]["finish"], valid=report["valid"], errors=report["errors"],
                               mtp_equal=runs["mtp"]["tokens"] == runs["plain"]["tokens"],
                               n_tokens={k: len(r["tokens"]) for k, r in runs.items()},
                               seconds={k: r["seconds"] for k, r in runs.items()},
                               mask_times={k: r["masks"] for k, r in runs.items()})
            rows.append(row)
            print(f"  {cat:15s} {path.name:32s} strict={'y' if row['strict'] else 'n'} relaxed={'y' if row['relaxed'] else 'n'}"
                  + (f" finish={row.get('finish')} valid={row.get('valid')} mtp==plain={row.get('mtp_equal')}" if "finish" in row else ""),
                  flush=True)
    summarize(rows, args)
    if args.json:
        for r in rows:
            r.pop("mask_times", None)
        Path(args.json).write_text(json.dumps(rows, indent=1))


def summarize(rows: List[dict], args) -> None:
    print("\nCoverage: share of schemas served (--json-schema-mode strict / relaxed); outputs finished within "
          f"{args.max_tokens} tokens, valid against the full schema")
    print(f"{'category':16s} {'n':>3s} {'strict':>7s} {'relaxed':>8s} {'finished':>9s} {'valid':>6s}")
    for cat in list(CATEGORIES) + ["all"]:
        rs = [r for r in rows if cat in ("all", r["category"])]
        if not rs:
            continue
        done = [r for r in rs if r.get("finish") == "stop"]
        pct = lambda k: 100.0 * sum(bool(r[k]) for r in rs) / len(rs)  # noqa: E731
        valid = f"{sum(r['valid'] is True for r in done)}/{len(done)}" if done else "-"
        print(f"{cat:16s} {len(rs):3d} {pct('strict'):6.0f}% {pct('relaxed'):7.0f}% {len(done):9d} {valid:>6s}")
    for r in rows:
        if not r["relaxed"]:
            print(f"refused (relaxed): {r['category']}/{r['file']}: {r['refused'][:200]}")
        elif r.get("finish") == "stop" and r["valid"] is not True:
            print(f"reported invalid: {r['category']}/{r['file']}: valid={r['valid']} {r['errors'][:2]}")
    kinds: Dict[str, int] = {}
    for r in rows:
        for p in r.get("relaxed_keywords", []):
            kinds[p.rsplit("/", 1)[-1]] = kinds.get(p.rsplit("/", 1)[-1], 0) + 1
    print("relaxed keywords (occurrences):", ", ".join(f"{k} {n}" for k, n in sorted(kinds.items(), key=lambda x: -x[1])) or "none")
    print("schemas with unknown formats ignored:", sum(bool(r.get("ignored")) for r in rows))
    rewrite = [r["rewrite_ms"] for r in rows]
    comp = [r["compile_ms"] for r in rows if "compile_ms" in r]
    print(f"\nrewrite (both modes, uncached) ms: median {statistics.median(rewrite):.2f}  p99 {quantile(rewrite, 0.99):.2f}")
    print(f"llguidance compile for this tokenizer ms: median {statistics.median(comp):.2f}  p99 {quantile(comp, 0.99):.2f}")
    dec = [r for r in rows if "mask_times" in r]
    if not dec:
        return
    for k in ("plain", "mtp"):
        masks = [t for r in dec for t in r["mask_times"][k]]
        toks = sum(r["n_tokens"][k] for r in dec)
        secs = sum(r["seconds"][k] for r in dec)
        print(f"{k:5s}: {toks} tokens, {toks / secs:.1f} tok/s; mask ms: median {1e3 * statistics.median(masks):.3f}  "
              f"p99 {1e3 * quantile(masks, 0.99):.3f}  per generated token {1e3 * sum(masks) / max(toks, 1):.3f}")
    same = sum(r["mtp_equal"] for r in dec)
    print(f"MTP output token-identical to plain: {same}/{len(dec)}")


if __name__ == "__main__":
    main()

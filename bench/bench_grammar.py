"""Structured output: the grammar engine chosen by measuring, and what constraints cost.

    python bench/bench_grammar.py [--big-tokenizer DIR] [--skip-xgrammar] [--max-tokens 128] [--repeats 3]

1. Grammar engines (llguidance, the one the engine uses, and xgrammar when it is
   installed: `pip install xgrammar`, which pulls in torch): for the demo model's
   tokenizer and a Qwen-sized one (~250k tokens; `--big-tokenizer`, a directory
   with tokenizer.json, e.g. one trained by `--train-big-tokenizer DIR`): time to
   prepare the tokenizer, to compile a nested JSON schema, and the median time of
   one next-token mask while walking a valid document token by token.
2. Decoding on the demo model, greedy, round-robin over the modes: unconstrained
   plain and MTP, constrained plain and MTP (a Lark grammar of printable-ASCII
   code lines: close to what the model writes, so outputs stay long and a mask is
   computed at every position), each at a fixed depth; tokens/s, acceptance per
   position, and the time spent computing masks per generated token. Prints
   the two target ratios: constrained MTP / unconstrained MTP and constrained MTP /
   constrained plain.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from common import MaskTimes, pc
from mtp_serve.engine.generator import generate
from mtp_serve.engine.grammar import Constraint
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.models.demo_model import default_model_path
from mtp_serve.models.loader import load_model

NESTED_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["project", "modules"],
    "properties": {
        "project": {"type": "object", "required": ["name", "version"], "properties": {
            "name": {"type": "string", "pattern": "^[a-z][a-z0-9_-]{1,30}$"},
            "version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"},
            "license": {"enum": ["MIT", "Apache-2.0", "BSD-3-Clause"]}}},
        "modules": {"type": "array", "minItems": 1, "maxItems": 8, "items": {"$ref": "#/$defs/module"}},
    },
    "$defs": {"module": {"type": "object", "required": ["path", "functions"], "properties": {
        "path": {"type": "string"},
        "functions": {"type": "array", "items": {"type": "object", "required": ["name", "args"], "properties": {
            "name": {"type": "string"}, "args": {"type": "array", "items": {"type": "string"}},
            "returns": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "complexity": {"type": "integer", "minimum": 1, "maximum": 50}}}}}}},
}
NESTED_DOC = {
    "project": {"name": "mtp_serve", "version": "0.1.0", "license": "MIT"},
    "modules": [{"path": "engine/speculative.py", "functions": [
        {"name": "draft", "args": ["model", "batch", "depths"], "returns": "Drafts", "complexity": 7},
        {"name": "verify", "args": ["model", "batch", "drafts"], "returns": "Verified", "complexity": 4},
        {"name": "accept", "args": ["verified", "rows"], "returns": None, "complexity": 6}]}],
}
# What the decoding benchmark constrains to: code lines of printable ASCII (close to what
# the demo model writes anyway, so outputs stay long and masks are computed at every token).
CODE_LINES = 'start: LINE{1,400}\nLINE: /[ -~]{0,160}\\n/'


def median_ms(xs):
    return 1e3 * statistics.median(xs)


# ---------------------------------------------------------------- grammar engines


def bench_llguidance(hf_tok, vocab: int, doc_ids) -> dict:
    import llguidance
    import llguidance.hf
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    t = pc()
    lltok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab)
    prep = pc() - t
    t = pc()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(NESTED_SCHEMA)
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = pc() - t
    bits = allocate_token_bitmask(1, lltok.vocab_size)
    times = []
    for tok in doc_ids:
        t = pc()
        fill_next_token_bitmask(matcher, bits, 0)
        times.append(pc() - t)
        assert matcher.consume_token(tok), matcher.get_error()
    return {"prepare_s": prep, "compile_ms": 1e3 * compile_s, "mask_ms": median_ms(times), "mask_ms_max": 1e3 * max(times)}


def bench_xgrammar(hf_tok, vocab: int, doc_ids) -> dict:
    import xgrammar as xgr

    t = pc()
    info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    prep = pc() - t
    t = pc()
    compiled = compiler.compile_json_schema(json.dumps(NESTED_SCHEMA), any_whitespace=False, separators=(",", ":"))
    matcher = xgr.GrammarMatcher(compiled)
    compile_s = pc() - t
    bits = xgr.allocate_token_bitmask(1, info.vocab_size)
    times = []
    for tok in doc_ids:
        t = pc()
        matcher.fill_next_token_bitmask(bits)
        times.append(pc() - t)
        assert matcher.accept_token(tok)
    return {"prepare_s": prep, "compile_ms": 1e3 * compile_s, "mask_ms": median_ms(times), "mask_ms_max": 1e3 * max(times)}


def compare_engines(tokenizers: dict, skip_xgrammar: bool) -> list:
    rows = []
    doc = json.dumps(NESTED_DOC, separators=(",", ":"))
    for label, (hf_tok, vocab) in tokenizers.items():
        doc_ids = hf_tok.encode(doc, add_special_tokens=False)
        engines = {"llguidance": bench_llguidance}
        if not skip_xgrammar:
            engines["xgrammar"] = bench_xgrammar
        for name, fn in engines.items():
            try:
                r = fn(hf_tok, vocab, doc_ids)
            except ImportError as e:
                r = {"error": f"not installed ({e})"}
            except Exception as e:  # noqa: BLE001 - report, keep benchmarking the rest
                r = {"error": f"{type(e).__name__}: {e}"[:200]}
            rows.append({"tokenizer": label, "vocab": vocab, "engine": name, "doc_tokens": len(doc_ids), **r})
    return rows


def train_big_tokenizer(out: Path) -> None:
    """A ~248k-token byte-level BPE (Qwen3.5's vocabulary size) trained on this Python's sources."""
    import glob

    from mtp_serve.testing.tokenizer_builder import save_tokenizer, train_tokenizer

    files = sorted(glob.glob(str(Path(json.__file__).parents[1] / "**" / "*.py"), recursive=True))
    texts = (Path(f).read_text(encoding="utf-8", errors="replace") for f in files)
    save_tokenizer(train_tokenizer(texts, vocab_size=248320, min_frequency=1), out)


# ---------------------------------------------------------------- decoding


def decode(lm, prompt, constraint, depth, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, constraint=constraint, ignore_eos=True)
    toks, stats, first, last = [], None, None, None
    for chunk in generate(lm.model, lm.tokenizer, prompt, params, depth):
        last = pc()
        first = first or last
        toks += chunk.token_ids
        stats = chunk.stats
    return toks, stats, (last - first)


def bench_decoding(lm, depth: int, max_tokens: int, repeats: int) -> dict:
    prompts = [lm.tokenizer.encode(p) for p in (
        "# utils/text.py\ndef slugify(value):\n", "# config.py\nimport os\n\nDEFAULTS = {\n",
        "# cli.py\nimport argparse\n\ndef main():\n", "# models.py\nclass User:\n    def __init__(self, name):\n")]
    code = Constraint("lark", CODE_LINES)
    modes = {"plain": (None, 0), f"mtp d{depth}": (None, depth),
             "constrained plain": (code, 0), f"constrained mtp d{depth}": (code, depth)}
    for c, d in modes.values():  # warm-up: kernels, the grammar compiler
        decode(lm, prompts[0], c, d, 16)
    res = {m: {"tokens": 0, "seconds": 0.0, "drafted": [], "accepted": [], "mask_s": 0.0, "masks": 0} for m in modes}
    names = list(modes)
    for r in range(repeats):
        for i, prompt in enumerate(prompts):
            k = (r * len(prompts) + i) % len(names)
            for name in names[k:] + names[:k]:
                c, d = modes[name]
                with MaskTimes() as mt:
                    toks, stats, secs = decode(lm, prompt, c, d, max_tokens)
                e = res[name]
                e["tokens"] += len(toks) - 1
                e["seconds"] += secs
                e["mask_s"] += mt.seconds
                e["masks"] += mt.calls
                e["drafted"] = [a + b for a, b in zip(e["drafted"], stats.drafted)] if e["drafted"] else list(stats.drafted)
                e["accepted"] = [a + b for a, b in zip(e["accepted"], stats.accepted)] if e["accepted"] else list(stats.accepted)
    out = {}
    for name, e in res.items():
        out[name] = {
            "tok_s": e["tokens"] / e["seconds"],
            "acceptance_per_position": [round(a / d, 3) for a, d in zip(e["accepted"], e["drafted"]) if d],
            "mask_ms_per_token": 1e3 * e["mask_s"] / max(e["tokens"], 1),
            "mask_ms_per_mask": 1e3 * e["mask_s"] / e["masks"] if e["masks"] else 0.0,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--big-tokenizer", default=None, help="a directory with a ~250k-token tokenizer.json")
    ap.add_argument("--train-big-tokenizer", default=None, help="train one into this directory first (minutes)")
    ap.add_argument("--skip-xgrammar", action="store_true")
    ap.add_argument("--skip-decoding", action="store_true")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    lm = load_model(args.model or default_model_path())
    from mtp_serve.engine.warmup import calibrate_blas_threads

    calibrate_blas_threads(lm.model, lm.tokenizer, args.depth)  # as mtp-serve does at start-up
    tokenizers = {"demo": (AutoTokenizer.from_pretrained(str(lm.path)), lm.model.vocab_size)}
    if args.train_big_tokenizer:
        train_big_tokenizer(Path(args.train_big_tokenizer))
        args.big_tokenizer = args.train_big_tokenizer
    if args.big_tokenizer:
        big = AutoTokenizer.from_pretrained(args.big_tokenizer)
        tokenizers["qwen-sized"] = (big, len(big))
    print("Grammar engines: prepare the tokenizer, compile a nested JSON schema, one next-token mask (median over a document)")
    print(f"{'tokenizer':11s} {'vocab':>7s} {'engine':11s} {'prepare s':>9s} {'compile ms':>10s} {'mask ms':>8s} {'mask max':>9s}")
    for r in compare_engines(tokenizers, args.skip_xgrammar):
        if "error" in r:
            print(f"{r['tokenizer']:11s} {r['vocab']:>7d} {r['engine']:11s} ERROR {r['error']}")
        else:
            print(f"{r['tokenizer']:11s} {r['vocab']:>7d} {r['engine']:11s} {r['prepare_s']:9.2f} {r['compile_ms']:10.1f} "
                  f"{r['mask_ms']:8.3f} {r['mask_ms_max']:9.3f}")
    if args.skip_decoding:
        return
    t0 = time.time()
    res = bench_decoding(lm, args.depth, args.max_tokens, args.repeats)
    print(f"\nDecoding on {lm.path.name}, greedy, {args.max_tokens} tokens, {args.repeats} x 4 prompts, round-robin "
          f"({time.time() - t0:.0f}s):")
    print(f"{'mode':22s} {'tok/s':>7s} {'mask ms/token':>13s}  acceptance per position")
    for name, r in res.items():
        print(f"{name:22s} {r['tok_s']:7.1f} {r['mask_ms_per_token']:13.3f}  {r['acceptance_per_position']}")
    d = f"mtp d{args.depth}"
    print(f"constrained MTP / unconstrained MTP: {res['constrained ' + d]['tok_s'] / res[d]['tok_s']:.2f}x (target 0.85x); "
          f"constrained MTP / constrained plain: {res['constrained ' + d]['tok_s'] / res['constrained plain']['tok_s']:.2f}x "
          f"(target 1.5x)")


if __name__ == "__main__":
    main()

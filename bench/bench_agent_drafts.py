"""Agent turns replayed: plain decoding, MTP alone, copy drafts alone and all sources, side by side.

    python bench/bench_agent_drafts.py [--models 0.8b 0.8b-q4 2b demo] [--contexts 2048 8192 24576]
                                       [--traces write edit tools free] [--tokens 160] [--repeats 2]

Traces of coding-agent turns built from real source files (Python's own standard library,
which the demo model never saw): a context of files (cut or padded with more files to the
context length), then the reply the agent writes:
- write: one of the files rewritten whole with a one-line edit (the write tool);
- edit: `oldString` / `newString` calls quoting a few lines of a file and changing one (the edit tool);
- tools: tool calls naming paths and identifiers from the context, between short new sentences;
- free: prose from Python's language reference, nothing of it in the context.

Replayed teacher-forced on the real engine (`Scheduler`): the verify windows, the head's drafts,
the copy index and the commits are the server's own; which drafts are accepted is decided by the
trace (a benchmark-only wrapper around the round's accept step: a draft lands while it equals the
trace, and the trace's next token is emitted), and the head's drafts become the trace's tokens with
probability 0.8 (bench_acceptance_speed's oracle), as in bench_quantized. The context is prefilled
once per (model, length) (every trace's context is the same files) and restored from a prompt
cache for each trace and mode.

Modes: plain, MTP alone, copy alone, all sources, and all sources choosing by expected tokens
("by tokens": a row copies its whole match where that is expected to emit more tokens than the
head, without the measured window costs; a copy round slower than the head's rate halves its
length) to show what choosing by tokens per second buys.

Columns: decode tokens/s per mode (after the first token), each mode's ratio to plain and
to MTP alone, tokens per round with all sources and with MTP alone, the share of emitted tokens
each source drafted, the tokens all sources drafted by copying (landed or not), and the share of
all sources' decode time spent choosing copies (the index lookup and the length): with nothing
to copy, that and the copy rounds are all that separates all sources from MTP alone. Random-weight models have Qwen3.5's 0.8B / 2B shapes and vocabulary (fp32, or a 4-bit
body with `-q4`, whose head is quantized as the body and drafts from the 16,384 most frequent tokens, as
`mtp-graft` chooses for these shapes by default); the traces' token ids come from the demo model's
tokenizer (all below 4,096).
"""

from __future__ import annotations

import argparse
import inspect
import random
from contextlib import contextmanager

from common import pc  # noqa: I001  (first: sets up the backend, OpenBLAS, before mlx.core is imported)

import mlx.core as mx

import mtp_serve.engine.speculative as speculative
from bench_acceptance_speed import SHAPES, Tok, oracle_drafts
from cost_model import QWEN35_VOCAB, random_mtp_model
from mtp_serve.engine.context_drafts import MIN_COPY
from mtp_serve.engine.policy import DepthPolicy, round_bucket
from mtp_serve.engine.prompt_cache import PromptCache
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.engine.scheduler import Scheduler
from mtp_serve.engine.speculative import Accepted

MODES = ("plain", "mtp", "copy", "all", "by_tokens")
DEPTH = 3
ACCEPTANCE = 0.8
DEFAULT_DRAFT_VOCAB = 16384  # what mtp-graft's defaults choose beside a 4-bit body of these shapes (quantized.md)


# ---------------------------------------------------------------- traces


def source_files() -> list:
    """The file the agent edits first (small enough for a 2k context), then the rest of the context."""
    import bisect, calendar, colorsys, difflib, fractions, heapq, json.decoder, shlex, textwrap, tokenize  # noqa: E401

    modules = (colorsys, bisect, shlex, json.decoder, textwrap, heapq, fractions, calendar, tokenize, difflib, argparse,
               inspect)
    return [(m.__name__, inspect.getsource(m)) for m in modules]


def build_trace(kind: str, encode, context_tokens: int, rng: random.Random) -> tuple:
    """(context ids, reply ids) for one trace kind at about `context_tokens` of context."""
    context, used = [], []  # used: the files wholly inside the context
    for name, text in source_files():
        ids = encode(f"<file path=\"lib/{name.replace('.', '/')}.py\">\n{text}\n</file>\n")
        room = context_tokens - len(context)
        context += ids[:room]
        if len(ids) > room:
            break
        used.append((name, text))
    if not used:
        raise SystemExit(f"a context of {context_tokens} tokens holds no whole source file")
    name, text = used[0]  # the agent's file: wholly inside the context, far from its end at long contexts
    lines = text.splitlines()
    if kind == "write":
        k = rng.randrange(len(lines) // 4, len(lines) // 2)
        edited = lines[:k] + [lines[k] + "  # checked"] + lines[k + 1:]
        reply = "\n".join(edited[: min(len(edited), 160)])
    elif kind == "edit":
        calls = []
        for _ in range(4):
            k = rng.randrange(5, len(lines) - 6)
            old = "\n".join(lines[k : k + 4])
            new = "\n".join(lines[k : k + 2] + [lines[k + 2].replace("return", "return  ")] + lines[k + 3 : k + 4])
            calls.append(f'{{"filePath": "lib/{name}.py", "oldString": {old!r}, "newString": {new!r}}}')
        reply = "\n".join(calls)
    elif kind == "tools":
        idents = sorted({w for w in text.replace("(", " ").split() if w.isidentifier() and len(w) > 6})
        paths = [f"lib/{n.replace('.', '/')}.py" for n, _ in used]
        parts = []
        for j in range(8):
            parts.append(f"Next I look at {rng.choice(['the helper', 'its caller', 'the test', 'one more place'])}.")
            parts.append(f'<tool_call>{{"name": "grep", "arguments": {{"pattern": "{rng.choice(idents)}", '
                         f'"path": "{rng.choice(paths)}"}}}}</tool_call>')
        reply = "\n".join(parts)
    else:  # free text: prose none of the context holds (Python's language reference)
        from pydoc_data.topics import topics

        reply = topics[rng.choice(["assignment", "class", "exceptions", "naming", "execmodel"])][:4000]
    return context, encode(reply)


# ---------------------------------------------------------------- teacher-forced replay


class ByTokens(DepthPolicy):
    """The copy choice without window costs: the whole match where its expected tokens exceed
    the head's at the chosen depth; a copy round slower than the head's best rate halves the length."""

    def copy_length(self, seq, order, available, depth, bucket):
        if available < MIN_COPY:
            return 0
        return available if seq.copy_cap.expected_tokens(order, available) > self.expected_tokens(seq, depth) else 0

    def observe_copies(self, rows, lengths, depths, seconds):
        bucket = round_bucket(rows)
        for s, n in zip(rows, lengths):
            landed = s.stats.copy_accepted - getattr(s, "_landed", 0)
            s._landed = s.stats.copy_accepted
            rates = [self.expected_tokens(s, K) / t for (b, c, K), t in self.round_time.items()
                     if (b, c) == bucket and K <= self.request_cap(s)]
            if n and rates and (landed + 1) / seconds < max(rates):
                s.copy_cap.limit = max(MIN_COPY, min(s.copy_cap.limit, n) // 2)


@contextmanager
def forced_by(traces: dict):
    """The round's accept step follows each row's trace (`traces[key]`: its whole reply)."""
    real = speculative.accept

    def accept(verified, rows):
        drafts = verified.drafts
        listed = drafts.tokens.tolist() if drafts.tokens is not None else [[] for _ in rows]
        counts, tokens = [], []
        for s, K, row in zip(rows, drafts.depths, listed):
            ref = traces[s.key][len(s.committed):]
            m = 0
            while m < K and m < len(ref) - 1 and row[m] == ref[m]:
                m += 1
            counts.append(m)
            tokens.append(row[:m] + [ref[m] if m < len(ref) else 0])
        return Accepted(verified, counts, tokens)

    speculative.accept = accept
    try:
        yield
    finally:
        speculative.accept = real


@contextmanager
def choice_timer(spent: list):
    """Adds to spent[0] the seconds the scheduler spends choosing certain drafts (the context
    index lookup and the copy length): what copying costs in a round that copies nothing."""
    real = Scheduler._certain_drafts

    def timed(self, rows, depths):
        t0 = pc()
        try:
            return real(self, rows, depths)
        finally:
            spent[0] += pc() - t0

    Scheduler._certain_drafts = timed
    try:
        yield
    finally:
        Scheduler._certain_drafts = real


def replay(lm, cache, context, reply, mode: str) -> dict:
    """One teacher-forced decode of `reply` after `context`; the head's drafts at oracle acceptance."""
    depth = 0 if mode == "plain" else DEPTH
    # Copy lengths by the measured window costs, as the server chooses them.
    policy = (ByTokens if mode == "by_tokens" else DepthPolicy)(max_depth=0 if mode in ("plain", "copy") else DEPTH,
                                                                 fixed=True, timed_copies=True)
    # Pipelined plain rounds off: their accept step is not the round's, which the trace replaces
    # (on the CPU they decode no faster: bench_pipeline.py).
    sched = Scheduler(lm.model, lm.tokenizer, max_batch_size=1, prefill_chunk=1024, prompt_cache=cache, policy=policy,
                      copy_max=0 if mode in ("plain", "mtp") else 32, pipeline=False)
    # A snapshot one token short of the context: every later replay restores it and prefills one token.
    sched.add("r", context, SamplingParams(max_tokens=len(reply) + 1, ignore_eos=True), depth, (len(context) - 1,))
    trace: list = []  # the prefill's token (the model's own), then the reply
    out, stats, first, last, n_first = [], None, None, None, 0
    spent = [0.0]
    with forced_by({"r": trace}), oracle_drafts(trace, ACCEPTANCE, lm.model.vocab_size), choice_timer(spent):
        while sched.has_work():
            for _, chunk in sched.step():
                if not trace:
                    trace += chunk.token_ids[:1] + reply
                    first, n_first = pc(), len(chunk.token_ids)
                last = pc()
                out += chunk.token_ids
                stats = chunk.stats
    assert out == trace[: len(out)], "the replay left its trace"
    n = len(out) - n_first
    return {"tok_s": n / (last - first), "per_round": n / max(1, stats.backbone_passes), "emitted": n,
            "mtp": sum(stats.accepted), "copy": stats.copy_accepted, "copy_drafted": stats.copy_drafted,
            "choice_share": spent[0] / (last - first)}


# ---------------------------------------------------------------- models


def load(name: str):
    from mtp_serve.models.demo_model import default_model_path
    from mtp_serve.models.loader import load_model

    demo = load_model(str(default_model_path()))
    encode = lambda text: demo.tokenizer.encode(text)  # noqa: E731
    if name == "demo":
        return demo, encode
    if name.endswith("-q4"):
        from bench_quantized import quantized_model

        model, _ = quantized_model(name[:-3], 4)
        model.use_draft_vocab(list(range(DEFAULT_DRAFT_VOCAB)))
    else:
        model = random_mtp_model(SHAPES[name](QWEN35_VOCAB))
    return type("LM", (), {"model": model, "tokenizer": Tok()})(), encode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["0.8b", "0.8b-q4", "demo"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 24576])
    ap.add_argument("--traces", nargs="+", default=["write", "edit", "tools", "free"])
    ap.add_argument("--tokens", type=int, default=160, help="reply tokens replayed per run")
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode, alternating order (the best is kept)")
    args = ap.parse_args()
    rows = []
    for name in args.models:
        lm, encode = load(name)
        for ctx in args.contexts:
            cache = PromptCache(max_bytes=8 << 30)
            for kind in args.traces:
                context, reply = build_trace(kind, encode, ctx, random.Random(ctx))
                reply = reply[: args.tokens]
                t0 = pc()
                replay_with = lambda mode: replay(lm, cache, context, reply, mode)  # noqa: E731
                replay_with("plain")  # prefill once (stored), trace the shapes
                print(f"[{name} {ctx} {kind}] context {len(context)} tokens, reply {len(reply)}, "
                      f"warm-up {pc() - t0:.0f}s", flush=True)
                best = {}
                for r in range(args.repeats):
                    for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                        got = replay_with(mode)
                        if mode not in best or got["tok_s"] > best[mode]["tok_s"]:
                            best[mode] = got
                a = best["all"]
                row = dict(model=name, context=ctx, trace=kind, **{m: best[m]["tok_s"] for m in MODES},
                           per_round=a["per_round"], share_copy=a["copy"] / a["emitted"],
                           share_mtp=a["mtp"] / a["emitted"], per_round_bt=best["by_tokens"]["per_round"],
                           per_round_mtp=best["mtp"]["per_round"], copy_drafted=a["copy_drafted"],
                           choice_share=a["choice_share"])
                rows.append(row)
                print(f"[{name} {ctx} {kind}] plain {row['plain']:.2f} tok/s | mtp {row['mtp'] / row['plain']:.2f}x | "
                      f"copy {row['copy'] / row['plain']:.2f}x | all {row['all'] / row['plain']:.2f}x "
                      f"({row['all'] / row['mtp']:.2f}x mtp) | by tokens {row['by_tokens'] / row['plain']:.2f}x "
                      f"({row['by_tokens'] / row['mtp']:.2f}x mtp) | {row['per_round']:.2f} tokens/round "
                      f"({row['per_round_bt']:.2f} by tokens), "
                      f"copied {row['share_copy']:.0%}, head {row['share_mtp']:.0%} | MTP alone "
                      f"{row['per_round_mtp']:.2f} tokens/round | all: {row['copy_drafted']} tokens copy-drafted, "
                      f"{row['choice_share']:.2%} of decode time choosing copies", flush=True)
        lm = None  # free the model before the next one loads
        mx.clear_cache()
    print("\n| model | context | trace | plain tok/s | MTP | copy | all | all / MTP | by tokens | by tokens / MTP "
          "| tokens/round | tokens/round MTP alone | copied | head | copy-drafted | choosing copies |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['context']} | {r['trace']} | {r['plain']:.2f} | {r['mtp'] / r['plain']:.2f}x | "
              f"{r['copy'] / r['plain']:.2f}x | {r['all'] / r['plain']:.2f}x | {r['all'] / r['mtp']:.2f}x | "
              f"{r['by_tokens'] / r['plain']:.2f}x | {r['by_tokens'] / r['mtp']:.2f}x | "
              f"{r['per_round']:.2f} | {r['per_round_mtp']:.2f} | {r['share_copy']:.0%} | {r['share_mtp']:.0%} | "
              f"{r['copy_drafted']} | {r['choice_share']:.2%} |")


if __name__ == "__main__":
    main()

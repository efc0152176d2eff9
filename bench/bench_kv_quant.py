"""Quantized attention KV (--kv-bits): what it saves, what it costs, how far it drifts.

    python bench/bench_kv_quant.py                                  # demo + 0.8B shapes, 2k and 8k, agent session
    python bench/bench_kv_quant.py --models demo --contexts 2048 8192 32768
    python bench/bench_kv_quant.py --models 0.8b --contexts 2048 --tokens 16

For each model, context and KV setting (full precision = fp32 here, 8-bit, 4-bit;
groups of 64 along the head dimension) it prefills a prompt of that many tokens
once (timed), stores its state in a prompt cache, and from that snapshot decodes
greedily, plain and with MTP (depth 3), alternating, each repeat going round all
settings (so that the shared machine's changing load falls on each alike):
- KV bytes per token (every attention layer and the MTP head; also what bf16 KV
  would take, the compute dtype on Apple GPUs), and the bytes the prompt cache's
  blocks hold for the context;
- prefill seconds; decode tokens/s plain and MTP, MTP's speedup, acceptance
  (MTP's output is checked token for token against plain's at the same setting);
- greedy agreement with full precision: tokens until the first difference, and
  the share of positions that agree, over --agree-tokens (plain output).

The demo model decodes its own text (stdlib source); the 0.8B-shaped model has
random weights (fp32, the real 248,320-token vocabulary), so its drafts come
from a benchmark-only oracle (bench_acceptance_speed.py's, acceptance 0.8) and
its agreement figure says little.

Decode attention (--compare-attention): the quantized settings' decode also
through mlx-lm's quantized attention (scores and values via MLX's CPU
quantized_matmul) instead of mtp-serve's native kernel, from the same snapshot.

Prefill attention (--prefill-check): the same 8-bit prefill through the
blockwise CPU path over the dequantized cache (what mtp-serve runs) and through
mlx-lm's quantized attention (scores via quantized_matmul, whole score matrix),
against full precision.

Agent session (--session, the demo model): bench_prompt_cache.py's workload
(three conversations sharing a system prompt with tool schemas, replayed
through the real server, --session-turns turns) at each setting; the prompt
cache's bytes afterwards, per conversation, and how many such conversations a
--budget of prompt-cache memory holds.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

from common import environment, pc, write_json  # noqa: I001  (first: backend set-up before mlx.core)

import mlx.core as mx

from mtp_serve import BACKEND
from mtp_serve.engine.generator import generate
from mtp_serve.engine.prompt_cache import PromptCache
from mtp_serve.engine.sampling import SamplingParams
from mtp_serve.models import prefill_layers, quantized_attention
from mtp_serve.models.caches import FULL_KV, KVSetting

SETTINGS = {"full": FULL_KV, "8-bit": KVSetting(8, 64), "4-bit": KVSetting(4, 64)}
DEPTH = 3


def demo_model():
    from mtp_serve.models.demo_model import default_model_path
    from mtp_serve.models.loader import load_model

    from common import load_prompts

    lm = load_model(default_model_path())
    prompts, _ = load_prompts(Path(default_model_path()), lm.tokenizer, 40, 1024)  # held-out code, 1,024 tokens each
    return lm, [t for _, ids in prompts for t in ids], None


def model_08b():
    from bench_acceptance_speed import Tok
    from cost_model import QWEN35_VOCAB, qwen35_08b_text, random_mtp_model

    model = random_mtp_model(qwen35_08b_text(QWEN35_VOCAB))
    lm = type("LM", (), {"model": model, "tokenizer": Tok()})()
    tokens = mx.random.randint(0, QWEN35_VOCAB, (40000,), key=mx.random.key(1)).tolist()
    return lm, tokens, QWEN35_VOCAB


MODELS = {"demo": demo_model, "0.8b": model_08b}


def decode(lm, prompt, n, depth, cache):
    """Greedy tokens, decode tokens/s after the first token, acceptance, prefill seconds."""
    toks, first, last, stats = [], None, None, None
    t0 = pc()
    for chunk in generate(lm.model, lm.tokenizer, prompt, SamplingParams(max_tokens=n, ignore_eos=True), depth, cache,
                          checkpoints=(len(prompt) - 1,)):
        last = pc()
        first = first or last
        toks += chunk.token_ids
        stats = chunk.stats
    return toks, (len(toks) - 1) / (last - first), stats.acceptance_rate, first - t0


def agreement(ours, ref):
    first = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ref))
    return first, sum(a == b for a, b in zip(ours, ref)) / len(ref)


def kv_bytes_bf16(model, kv: KVSetting) -> int:
    args = model.text.args
    layers = sum(not layer.is_linear for layer in model.layers) + (1 if model.has_mtp else 0)
    return 2 * layers * args.num_key_value_heads * kv.bytes_per_vector(args.head_dim, 2)


def run_model(name: str, args) -> list:
    t0 = pc()
    lm, text, oracle_vocab = MODELS[name]()
    model = lm.model
    print(f"[{name}] loaded in {pc() - t0:.0f}s", flush=True)
    rows = []
    n = args.tokens if oracle_vocab else args.agree_tokens
    for ctx in args.contexts:
        prompt = text[:ctx]
        if len(prompt) < ctx:
            print(f"[{name}] only {len(prompt)} tokens of text: skipping {ctx}", flush=True)
            continue
        # Each setting prefills once into its own prompt cache; then the timed runs (plain and MTP, each
        # attention path) go round all settings per repeat, so that a change in the machine's load
        # between minutes falls on every setting alike.
        runs, ref = [], None
        for label, kv in SETTINGS.items():
            model.use_kv(kv)
            cache = PromptCache(max_bytes=64 << 30, interval=0, kv=kv)
            prefill_s = decode(lm, prompt, 2, 0, cache)[3]  # cold: prefills, stores the snapshot the runs start from
            decode(lm, prompt, 8, 0, cache)  # warm-up (kernels compiled for this setting's shapes)
            plain = decode(lm, prompt, n, 0, cache)[0]
            ref = ref or plain
            # mtp-serve's decode attention (native kernel), and with --compare-attention mlx-lm's
            # quantized attention too (from the same snapshot: no second prefill).
            paths = [("", True)] + ([(", mlx-lm attention", False)] if kv.quantized and args.compare_attention else [])
            for suffix, native in paths:
                runs.append(dict(label=label + suffix, kv=kv, native=native, cache=cache, prefill_s=prefill_s,
                                 plain=plain, plain_s=[], mtp_s=[], acc=[], outputs=[]))
        for r in range(args.repeats + 1):  # round 0: warm-up (verify windows of each width), not timed
            for run in runs:
                model.use_kv(run["kv"])
                quantized_attention.NATIVE = run["native"]
                drafts = oracle_context(run["plain"], oracle_vocab)
                with drafts:
                    for d in ((DEPTH, 0) if r % 2 == 0 else (0, DEPTH)):
                        toks, tok_s, a, _ = decode(lm, prompt, n if r else 16, d, run["cache"])
                        if r:
                            run["outputs"].append(toks)
                            (run["mtp_s"] if d else run["plain_s"]).append(tok_s)
                            if d:
                                run["acc"].append(a)
                quantized_attention.NATIVE = True
        for run in runs:
            out = run["outputs"][0]
            # MTP equals plain within a path (two attention paths may differ from each other by rounding)
            assert all(t == out for t in run["outputs"]), f"{name} {run['label']}: MTP output differs from plain"
            assert not run["native"] or out == run["plain"], f"{name} {run['label']}: output differs from the first run"
            first, share = agreement(out, ref)
            model.use_kv(run["kv"])
            plain_tok_s, mtp_tok_s = max(run["plain_s"]), max(run["mtp_s"])
            row = dict(model=name, context=ctx, kv=run["label"], kv_bytes_per_token=model.kv_bytes_per_token(),
                       kv_bytes_per_token_bf16=kv_bytes_bf16(model, run["kv"]),
                       cache_block_bytes=run["cache"].blocks.nbytes, prefill_s=run["prefill_s"],
                       plain_tok_s=plain_tok_s, mtp_tok_s=mtp_tok_s, speedup=mtp_tok_s / plain_tok_s,
                       acceptance=sum(run["acc"]) / len(run["acc"]), agree_first=first, agree_share=share,
                       agree_tokens=len(ref))
            rows.append(row)
            print_row(row)
        del runs
        gc.collect()
        model.use_kv(FULL_KV)
    if args.prefill_check and name == "demo":
        rows_pf = prefill_check(lm, text[: max(args.contexts)])
        for r in rows_pf:
            r["model"] = name
        rows += rows_pf
    del lm, model
    gc.collect()
    mx.clear_cache()
    return rows


def oracle_context(plain, oracle_vocab):
    """The 0.8B-shaped model's drafts: a benchmark-only oracle that proposes plain's tokens (acceptance 0.8)."""
    if not oracle_vocab:
        return _nothing()
    from bench_acceptance_speed import oracle_drafts

    return oracle_drafts(plain, 0.8, oracle_vocab)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def prefill_check(lm, prompt) -> list:
    """Prefill seconds (1,024-token chunks, as the engine's) full / 8-bit blockwise / 8-bit mlx-lm."""
    model = lm.model
    out = []
    for label, kv, blockwise in (("full", FULL_KV, True), ("8-bit, blockwise over dequantized KV", KVSetting(8, 64), True),
                                 ("8-bit, mlx-lm quantized attention", KVSetting(8, 64), False)):
        model.use_kv(kv)
        prefill_layers.DEQUANTIZE_QUANTIZED_KV = blockwise
        times = []
        for _ in range(2):
            caches = model.make_cache()
            t0 = pc()
            for a in range(0, len(prompt), 1024):
                _, logits = model.forward(mx.array([prompt[a : a + 1024]]), caches, last_logits=True)
                mx.eval(logits, [c.state for c in caches])
            times.append(pc() - t0)
        out.append(dict(prefill_path=label, context=len(prompt), prefill_s=min(times)))
        print(f"[prefill {len(prompt)}] {label}: {min(times):.2f}s", flush=True)
    prefill_layers.DEQUANTIZE_QUANTIZED_KV = True
    model.use_kv(FULL_KV)
    return out


def print_row(r: dict) -> None:
    print(f"[{r['model']}] ctx {r['context']:>6} {r['kv']:>5}: KV {r['kv_bytes_per_token']:>6} B/token "
          f"(bf16 {r['kv_bytes_per_token_bf16']}), blocks {r['cache_block_bytes'] / 2**20:.1f} MiB, "
          f"prefill {r['prefill_s']:.1f}s, plain {r['plain_tok_s']:.1f} tok/s, MTP {r['mtp_tok_s']:.1f} "
          f"({r['speedup']:.2f}x, acceptance {r['acceptance']:.2f}), agrees with full for {r['agree_first']} tokens, "
          f"{100 * r['agree_share']:.0f}% of {r['agree_tokens']}", flush=True)


def session(args) -> list:
    """bench_prompt_cache.py's agent workload through the real server at each setting."""
    import httpx

    from bench_prompt_cache import CONVERSATIONS, TASKS, TITLE_SYSTEM, Workload, next_turn, stream_chat
    from mtp_serve.models.demo_model import default_model_path
    from mtp_serve.testing.server_process import ServerProcess

    model_dir = Path(default_model_path())
    w = Workload(model_dir, args.system_tokens)
    out = []
    for label, kv in SETTINGS.items():
        flags = ["--model", str(model_dir), "--served-model-name", "bench", "--enable-mtp", "--log-level", "warning",
                 "--prompt-cache-bytes", "16G"] + (["--kv-bits", str(kv.bits)] if kv.quantized else [])
        t0 = pc()
        history = {c: [{"role": "system", "content": w.system}, {"role": "user", "content": TASKS[c]}] for c in CONVERSATIONS}
        prompt_tokens = 0
        with ServerProcess(flags) as server:
            for turn in range(1, args.session_turns + 1):
                for conv in CONVERSATIONS:
                    if turn == 1:
                        stream_chat(server.base_url, [{"role": "system", "content": TITLE_SYSTEM},
                                                      {"role": "user", "content": TASKS[conv]}], None, 12)
                    r = stream_chat(server.base_url, history[conv], w.tools, args.session_max_tokens)
                    prompt_tokens += r["usage"]["prompt_tokens"]
                    history[conv] = next_turn(w, history[conv], r["message"], conv, turn)
            metrics = dict(line.rsplit(" ", 1) for line in httpx.get(server.root + "/metrics", timeout=30).text.splitlines()
                           if line and not line.startswith("#"))
        held = float(metrics['mtp_prompt_cache_bytes{tier="ram"}'])
        per_conv = held / len(CONVERSATIONS)
        row = dict(kv=label, session_bytes=held, snapshots=float(metrics['mtp_prompt_cache_snapshots{tier="ram"}']),
                   kv_bytes_per_token=float(metrics["mtp_kv_bytes_per_token"]), per_conversation_bytes=per_conv,
                   conversations_per_budget=int(args.budget * 2**30 // per_conv), budget_gib=args.budget,
                   last_turn_tokens=len(w.ids(history[CONVERSATIONS[0]])), seconds=pc() - t0)
        out.append(row)
        print(f"[session] {label}: {held / 2**20:.1f} MiB in {row['snapshots']:.0f} snapshots "
              f"({per_conv / 2**20:.1f} MiB a conversation of ~{row['last_turn_tokens']} tokens): "
              f"{row['conversations_per_budget']} conversations in {args.budget} GiB ({row['seconds']:.0f}s)", flush=True)
    return out


def table(rows: list, sessions: list) -> None:
    print("\n| model | context | KV | KV bytes/token (bf16) | prefill s | plain tok/s | MTP tok/s | MTP x | acceptance | "
          "agrees with full (first diff / share) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "kv" not in r:
            continue
        print(f"| {r['model']} | {r['context']} | {r['kv']} | {r['kv_bytes_per_token']:,} ({r['kv_bytes_per_token_bf16']:,}) "
              f"| {r['prefill_s']:.1f} | {r['plain_tok_s']:.1f} | {r['mtp_tok_s']:.1f} | {r['speedup']:.2f} | "
              f"{r['acceptance']:.2f} | {r['agree_first']} / {100 * r['agree_share']:.0f}% of {r['agree_tokens']} |")
    pf = [r for r in rows if "prefill_path" in r]
    if pf:
        print("\n| prefill path (demo) | context | seconds |\n|---|---|---|")
        for r in pf:
            print(f"| {r['prefill_path']} | {r['context']} | {r['prefill_s']:.2f} |")
    if sessions:
        print("\n| agent session (demo) | prompt-cache bytes | snapshots | per conversation | conversations in "
              f"{sessions[0]['budget_gib']} GiB |\n|---|---|---|---|---|")
        base = sessions[0]["conversations_per_budget"]
        for s in sessions:
            print(f"| {s['kv']} | {s['session_bytes'] / 2**20:.1f} MiB | {s['snapshots']:.0f} | "
                  f"{s['per_conversation_bytes'] / 2**20:.1f} MiB | {s['conversations_per_budget']} "
                  f"({s['conversations_per_budget'] / base:.2f}x) |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["demo", "0.8b"], choices=sorted(MODELS))
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--agree-tokens", type=int, default=256, help="demo: tokens decoded per run (agreement, speed)")
    p.add_argument("--tokens", type=int, default=12, help="0.8b: tokens decoded per run")
    p.add_argument("--repeats", type=int, default=2,
                   help="timed runs per mode (plain and MTP alternate; each repeat goes round every setting)")
    p.add_argument("--no-prefill-check", dest="prefill_check", action="store_false")
    p.add_argument("--no-session", dest="session", action="store_false")
    p.add_argument("--compare-attention", action="store_true",
                   help="also time 8-bit and 4-bit decode through mlx-lm's quantized attention (before mtp-serve's quantized attention kernel)")
    p.add_argument("--system-tokens", type=int, default=3000, help="session: shared system prompt")
    p.add_argument("--session-turns", type=int, default=3)
    p.add_argument("--session-max-tokens", type=int, default=32)
    p.add_argument("--budget", type=float, default=1.0, help="session: prompt-cache GiB the conversations must fit")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    print(BACKEND.note, flush=True)
    rows, sessions = [], []
    for name in args.models:
        rows += run_model(name, args)
    if args.session:
        sessions = session(args)
    table(rows, sessions)
    if args.json:
        write_json(args.json, {"env": environment(sys.argv), "rows": rows, "sessions": sessions})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

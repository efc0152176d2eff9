"""Decoding at long contexts: MTP against plain steps through the server, and the
verify window's cost in plain steps over long caches.

    python bench/bench_long_context.py                          # both parts, the defaults below
    python bench/bench_long_context.py --server --contexts 1100 7400 21700 --pairs 3
    python bench/bench_long_context.py --windows --models 0.8b --window-contexts 8192 32768
    python bench/bench_long_context.py --kernel --window-contexts 8192 32768

--server: `mtp-serve --model <demo> --enable-mtp` (the embedded demo model, its defaults)
as its own process on loopback. For each context length a prompt of that many tokens
(Python stdlib source) is sent once to fill the prompt cache, then requests of
--tokens greedy tokens alternate MTP on (the server's depth and policy) and off
(`mtp_depth: 0`), --pairs times, each streamed: decode tokens/s from the first token
to the last (the prompt is restored from the cache, so prefill does not count). The
ratio MTP/plain is printed per pair and as the median.

--windows: bench_kv_steps.py's caches (random keys and values of the context's length
in every attention layer, full or 8-bit KV) and the time of a backbone forward of T
tokens, T = --window-sizes, as plain steps (T=1), the fastest of --iters runs,
settings interleaved. `--forms` adds the attention kernel's other forms, interleaved, and
prints each one's time over now's: `blocks`, the query rows in four-row blocks over each key
tile but no tiles of rows x keys (`set_row_blocks(True, tiles=False)`); `before`, each row
alone (`set_row_blocks(False)`).

--kernel: the attention kernel alone (`attention_rows`) at the model's attention shapes over
random K/V of each context, per T and form as above (the fastest of --iters): its time, its
multiply-adds per second (q.k and p.v) against the machine's peak (bench_windows.py's, every
core) and, at T=1, the K/V bytes it reads per second against the stream bandwidth (an fp32
matvec over 512 MB, bench_quantized.py's), both measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from common import environment, pc, stream_events, write_json  # noqa: I001  (first: backend set-up)

import mlx.core as mx

from mtp_serve.models.caches import set_capture

FORMS = {"now": dict(on=True), "blocks": dict(on=True, tiles=False), "before": dict(on=False)}


def use_form(form: str) -> None:
    from mtp_serve.models import quantized_attention

    quantized_attention.set_row_blocks(**FORMS[form])


def stdlib_tokens(tokenizer, n: int) -> list:
    """n tokens of Python stdlib source (whole files, largest first, then cut)."""
    src = Path(os.__file__).parent
    ids: list = []
    for p in sorted(src.glob("*.py"), key=lambda p: -p.stat().st_size):
        ids += tokenizer.encode(p.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
        if len(ids) >= n:
            return ids[:n]
    raise SystemExit(f"not enough stdlib source for {n} tokens")


def decode_rate(base: str, prompt: list, tokens: int, depth) -> tuple:
    """(decode tokens/s from first to last token, tokens, cached prompt tokens, mean tokens per round)."""
    body = {"model": "demo", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if depth is not None:
        body["mtp_depth"] = depth
    first = last = None
    n, usage = 0, {}
    for event in stream_events(f"{base}/v1/completions", body):
        if event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices", []):
            if choice.get("text"):
                now = pc()
                first = first or now
                last = now
                n += 1
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    spec = usage.get("speculative") or {}
    generated = usage.get("completion_tokens", n)
    return (generated - 1) / max(last - first, 1e-9), generated, cached, spec.get("tokens_per_pass")


def server_part(args) -> list:
    from mtp_serve.models.demo_model import default_model_path
    from mtp_serve.testing.server_process import ServerProcess
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    rows = []
    with ServerProcess(["--model", default_model_path(), "--enable-mtp", "--served-model-name", "demo",
                        *args.server_args]) as server:
        base = server.root
        for ctx in args.contexts:
            prompt = stdlib_tokens(tokenizer, ctx)
            decode_rate(base, prompt, 8, 0)  # prefill; the prompt cache keeps it
            decode_rate(base, prompt, 8, None)  # the MTP path's first round at this length
            mtp, plain, per_round, cached = [], [], [], []
            for _ in range(args.pairs):
                for depth, out in ((None, mtp), (0, plain)):
                    rate, n, c, tpr = decode_rate(base, prompt, args.tokens, depth)
                    out.append(rate)
                    cached.append(c)
                    if depth is None:
                        per_round.append(tpr or 0)
            ratios = [m / p for m, p in zip(mtp, plain)]
            row = dict(context=ctx, mtp_tok_s=statistics.median(mtp), plain_tok_s=statistics.median(plain),
                       ratio=statistics.median(ratios), ratios=ratios, tokens_per_round=statistics.median(per_round),
                       cached_min=min(cached), load=os.getloadavg()[0])
            rows.append(row)
            print(f"ctx {ctx:6d}: MTP {row['mtp_tok_s']:6.1f} tok/s, plain {row['plain_tok_s']:6.1f} tok/s, "
                  f"MTP/plain {row['ratio']:.2f}x (pairs: {', '.join(f'{r:.2f}' for r in ratios)}), "
                  f"{row['tokens_per_round'] or 0:.2f} tokens/pass, prompt cached {row['cached_min']}/{ctx}, "
                  f"load {row['load']:.1f}", flush=True)
    return rows


def window_part(args) -> list:
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_kv_quant import MODELS, SETTINGS
    from bench_kv_steps import long_cache

    rows = []
    for name in args.models:
        lm, _, _ = MODELS[name]()
        model = lm.model
        for S in args.window_contexts:
            runs = []
            for label in args.kv:
                kv = SETTINGS[label]
                cache, head, hidden, reset = long_cache(model, kv, S)
                for form in args.forms:
                    runs.append(dict(label=label, form=form, kv=kv, cache=cache, reset=reset,
                                     times={T: [] for T in args.window_sizes}))
            for it in range(args.iters + 1):  # iteration 0: warm-up
                for run in runs:
                    model.use_kv(run["kv"])
                    use_form(run["form"])
                    for T in args.window_sizes:
                        run["reset"]()
                        set_capture(run["cache"], T > 1)
                        t0 = pc()
                        mx.eval(*model.forward(mx.array([[3] * T]), run["cache"]))
                        if it:
                            run["times"][T].append(pc() - t0)
                        set_capture(run["cache"], False)
            use_form("now")
            for run in runs:
                best = {T: min(v) * 1e3 for T, v in run["times"].items()}
                row = dict(model=name, context=S, kv=run["label"], form=run["form"], ms=best,
                           plain_steps={T: best[T] / best[1] for T in best})
                rows.append(row)
                print(f"[{name}] ctx {S:6d} {run['label']:6s} {run['form']:6s} plain {best[1]:7.1f} ms; "
                      + ", ".join(f"T={T} {best[T]:7.1f} ms ({row['plain_steps'][T]:.2f} steps)" for T in best if T > 1),
                      flush=True)
            for label in args.kv if "now" in args.forms else []:
                now = next(r for r in rows[-len(runs):] if r["kv"] == label and r["form"] == "now")
                for other in (r for r in rows[-len(runs):] if r["kv"] == label and r["form"] != "now"):
                    print(f"[{name}] ctx {S:6d} {label:6s} {other['form']}/now time: "
                          + ", ".join(f"T={T} {other['ms'][T] / now['ms'][T]:.2f}" for T in now["ms"]), flush=True)
    return rows


def kernel_part(args) -> list:
    """attention_rows alone at Qwen3.5-0.8B's attention shapes: ms, multiply-adds/s, K/V bytes/s."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_quantized import stream_bandwidth
    from bench_windows import peak_fma_per_s
    from cost_model import qwen35_08b_text

    from mtp_serve.models.quantized_attention import rows_kernel

    ext = rows_kernel()
    text = qwen35_08b_text(1)
    Hkv, D = text["num_key_value_heads"], text["head_dim"]
    rep = text["num_attention_heads"] // Hkv
    bandwidth, peak = stream_bandwidth(), peak_fma_per_s()
    print(f"stream bandwidth {bandwidth / 1e9:.1f} GB/s, peak {peak / 1e9:.0f} G multiply-adds/s (every core)", flush=True)
    rows = []
    for S in args.window_contexts:
        for label in args.kv:
            bits = {"full": 0, "8-bit": 8, "4-bit": 4}[label]
            k, v = (mx.random.normal((Hkv, S, D)) for _ in range(2))
            kv = [k, v] if not bits else [a for x in (k, v) for a in mx.quantize(x, group_size=64, bits=bits)]
            mx.eval(kv)
            nbytes = sum(a.nbytes for a in kv)
            qs = {T: mx.random.normal((Hkv * rep * T, D)) * D**-0.5 for T in args.window_sizes}
            mx.eval(list(qs.values()))
            best = {}
            for _ in range(args.iters + 1):
                for form in args.forms:
                    use_form(form)
                    for T in args.window_sizes:
                        t0 = pc()
                        mx.eval(ext.attention_rows(qs[T], kv, None, rep * T, T, S, Hkv, T > 1, 64 if bits else 0, bits))
                        best[form, T] = min(best.get((form, T), float("inf")), pc() - t0)
            use_form("now")
            for form in args.forms:
                ms = {T: best[form, T] * 1e3 for T in args.window_sizes}
                fma = {T: 2 * Hkv * rep * T * S * D / best[form, T] for T in args.window_sizes}
                row = dict(context=S, kv=label, form=form, ms=ms, fma_per_s=fma, peak=peak,
                           kv_bytes=nbytes, kv_bytes_per_s=nbytes / best[form, 1], bandwidth=bandwidth)
                rows.append(row)
                print(f"[kernel] ctx {S:6d} {label:6s} {form:6s} "
                      + ", ".join(f"T={T} {ms[T]:6.2f} ms ({ms[T] / ms[1]:.2f}x T=1, {fma[T] / peak:4.0%} of peak)"
                                  for T in ms)
                      + f"; T=1 reads K/V at {row['kv_bytes_per_s'] / 1e9:.1f} GB/s ({row['kv_bytes_per_s'] / bandwidth:.0%} "
                      f"of stream), load {os.getloadavg()[0]:.1f}", flush=True)
            for form in (f for f in args.forms if f != "now" and "now" in args.forms):
                print(f"[kernel] ctx {S:6d} {label:6s} {form}/now time: "
                      + ", ".join(f"T={T} {best[form, T] / best['now', T]:.2f}" for T in args.window_sizes), flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", action="store_true", help="only the server part")
    ap.add_argument("--windows", action="store_true", help="only the window costs")
    ap.add_argument("--kernel", action="store_true", help="only the attention kernel alone")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1100, 7400, 21700])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="extra mtp-serve flags (last)")
    ap.add_argument("--models", nargs="+", default=["0.8b"], help="bench_kv_quant.py's models: demo, 0.8b")
    ap.add_argument("--window-contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--window-sizes", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--kv", nargs="+", default=["full", "8-bit"], choices=["full", "8-bit", "4-bit"])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--forms", nargs="+", default=["now"], choices=list(FORMS),
                    help="the attention kernel's other forms too, interleaved (see --windows above)")
    ap.add_argument("--out", default=".work/bench/long_context.json")
    args = ap.parse_args(argv)
    if 1 not in args.window_sizes:
        args.window_sizes = [1] + args.window_sizes
    both = not (args.server or args.windows or args.kernel)
    result = {"environment": environment(sys.argv), "load_start": os.getloadavg()[0], "started": time.time()}
    if args.server or both:
        result["server"] = server_part(args)
    if args.windows or both:
        result["windows"] = window_part(args)
    if args.kernel:
        result["kernel"] = kernel_part(args)
    result["load_end"] = os.getloadavg()[0]
    write_json(args.out, result)


if __name__ == "__main__":
    main()

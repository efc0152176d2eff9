"""Decode step and verify window costs per KV setting at long contexts, without a prefill.

    python bench/bench_kv_steps.py --models 0.8b --contexts 8192 32768
    python bench/bench_kv_steps.py --models demo --contexts 32768 --iters 9

bench_kv_quant.py measures tokens/s from a real prefill, which on this CPU takes
minutes per setting at 8k on the Qwen3.5-0.8B-shaped model (and about an hour
for three settings at 32k). What quantized KV changes in decoding is the
attention over the cache, whose cost depends on the cache's length and
setting, not on its contents. So here each setting's attention caches (the
backbone's and the MTP head's) hold random keys and values of the context's
length (quantized at that setting), the GatedDeltaNet states come from a short
real forward, and the script times, interleaving the settings every iteration
(the machine is shared: a change of load falls on all alike), the fastest of
--iters runs (the least disturbed by other processes) of:
- a plain decode step (T=1 through the backbone);
- a verify window (T=K+1=4, GatedDeltaNet capture on);
- one MTP head step (a draft, T=1, over the head's own KV);
and for the quantized settings the same through mlx-lm's quantized attention
(--compare-attention; the path without mtp-serve's kernel). "MTP x (est.)" is what those
costs give a depth-3 round at per-draft acceptance --acceptance:
(1 + a + a^2 + a^3) plain steps' tokens for one verify and three head steps,
and "MTP tok/s (est.)" those tokens over that round's time.
"""

from __future__ import annotations

import argparse
import sys

from common import environment, pc, write_json  # noqa: I001  (first: backend set-up before mlx.core)

import mlx.core as mx

from mtp_serve import BACKEND
from mtp_serve.models import quantized_attention
from mtp_serve.models.caches import FULL_KV, SpeculativeGDNCache, set_capture

from bench_kv_quant import MODELS, SETTINGS

DEPTH = 3
SPARE = 256  # room in each attention buffer for the step's new entries (written in place, then dropped)


def long_cache(model, kv, S: int):
    """Backbone and head caches at `kv` holding S random entries per attention layer."""
    model.use_kv(kv)
    cache, head = model.make_cache(), model.make_head_cache()
    hidden, _ = model.forward(mx.array([[1] * 8]), cache)  # GatedDeltaNet states of the real shapes
    args = model.text.args
    shape = (1, args.num_key_value_heads, S + SPARE, args.head_dim)
    dtype = model.inner.norm.weight.dtype
    for c in [c for c in cache if not isinstance(c, SpeculativeGDNCache)] + [head]:
        k, v = (mx.random.normal(shape).astype(dtype) for _ in range(2))
        if kv.quantized:
            k, v = (mx.quantize(a, group_size=kv.group_size, bits=kv.bits) for a in (k, v))
        c.keys, c.values = k, v
        mx.eval(c.keys, c.values)
    states = [list(c.cache) if isinstance(c, SpeculativeGDNCache) else None for c in cache]
    mx.eval(hidden, [s for s in states if s is not None])

    def reset():
        for c, s in zip(cache + [head], states + [None]):
            if s is None:
                c.offset = S
            else:
                c.cache = list(s)
                c.release()
                c.capturing = False

    return cache, head, hidden[:, -1:], reset


def costs(model, run, T: int):
    cache, head, hidden, reset = run["cache"], run["head"], run["hidden"], run["reset"]
    reset()
    tokens = mx.array([[3] * T])
    set_capture(cache, T > 1)
    t0 = pc()
    h, logits = model.forward(tokens, cache)
    mx.eval(h, logits)
    step = pc() - t0
    set_capture(cache, False)
    t0 = pc()
    mx.eval(model.draft(hidden, mx.array([[5]]), head))
    return step, pc() - t0


def run_model(name: str, args) -> list:
    lm, _, _ = MODELS[name]()
    model = lm.model
    rows = []
    for S in args.contexts:
        runs = []
        for label, kv in SETTINGS.items():
            cache, head, hidden, reset = long_cache(model, kv, S)
            paths = [("", True)] + ([(", mlx-lm attention", False)] if kv.quantized and args.compare_attention else [])
            for suffix, native in paths:
                runs.append(dict(label=label + suffix, kv=kv, native=native, cache=cache, head=head, hidden=hidden,
                                 reset=reset, plain=[], verify=[], draft=[]))
        for it in range(args.iters + 1):  # iteration 0: warm-up
            for run in runs:
                model.use_kv(run["kv"])
                quantized_attention.NATIVE = run["native"]
                plain, draft = costs(model, run, 1)
                verify, _ = costs(model, run, DEPTH + 1)
                quantized_attention.NATIVE = True
                if it:
                    run["plain"].append(plain)
                    run["verify"].append(verify)
                    run["draft"].append(draft)
        base = None
        a = args.acceptance
        tokens = sum(a**i for i in range(DEPTH + 1))
        for run in runs:
            p, v, d = (min(run[k]) * 1e3 for k in ("plain", "verify", "draft"))
            base = base or (p, v)
            row = dict(model=name, context=S, kv=run["label"], plain_ms=p, verify_ms=v, draft_ms=d,
                       plain_vs_full=base[0] / p, verify_vs_full=base[1] / v, verify_in_plain_steps=v / p,
                       mtp_speedup_est=tokens * p / (v + DEPTH * d), mtp_tok_s_est=1e3 * tokens / (v + DEPTH * d),
                       acceptance=a, iters=args.iters)
            rows.append(row)
            print(f"[{name}] ctx {S:>6} {row['kv']:<24} plain {p:7.1f} ms ({row['plain_vs_full']:.2f}x full's speed), "
                  f"verify(T={DEPTH + 1}) {v:7.1f} ms ({v / p:.2f} plain steps), head {d:6.1f} ms, "
                  f"MTP x (est.) {row['mtp_speedup_est']:.2f}", flush=True)
        del runs
        model.use_kv(FULL_KV)
        mx.clear_cache()
    return rows


def layer_costs(name: str, args) -> list:
    """One attention layer's attention alone (cache already updated), the model's shapes: ms for
    T=1 and T=4 per setting and path (fp32 KV: MLX's sdpa; quantized: native kernel, mlx-lm)."""
    lm, _, _ = MODELS[name]()
    a = lm.model.text.args
    Hq, Hkv, D = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    del lm
    rows = []
    for S in args.contexts:
        k, v = (mx.random.normal((1, Hkv, S, D)) for _ in range(2))
        cases = [("full", lambda q, m: mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=m))]
        for label, kv in SETTINGS.items():
            if not kv.quantized:
                continue
            qk, qv = (mx.quantize(x, group_size=kv.group_size, bits=kv.bits) for x in (k, v))
            mx.eval(qk, qv)
            cases.append((label, lambda q, m, qk=qk, qv=qv, kv=kv: quantized_attention.quantized_attention(
                q, qk, qv, D**-0.5, m, kv.group_size, kv.bits)))
            cases.append((label + ", mlx-lm attention", lambda q, m, qk=qk, qv=qv, kv=kv:
                           quantized_attention.quantized_scaled_dot_product_attention(
                               q, qk, qv, scale=D**-0.5, mask=m, group_size=kv.group_size, bits=kv.bits)))
        times = {(c, T): [] for c, _ in cases for T in (1, DEPTH + 1)}
        qs = {T: mx.random.normal((1, Hq, T, D)) for T in (1, DEPTH + 1)}
        mx.eval(k, v, qs)
        for it in range(args.layer_iters + 1):
            for c, fn in cases:
                for T in (1, DEPTH + 1):
                    q = mx.array(qs[T])  # mlx-lm's quantized attention scales its queries in place
                    mx.eval(q)
                    t0 = pc()
                    mx.eval(fn(q, None if T == 1 else "causal"))
                    if it:
                        times[(c, T)].append(pc() - t0)
        for c, _ in cases:
            one, win = (min(times[(c, T)]) * 1e3 for T in (1, DEPTH + 1))
            rows.append(dict(model=name, context=S, kv=c, attention_t1_ms=one, attention_t4_ms=win))
            print(f"[{name} attention layer] ctx {S:>6} {c:<24} T=1 {one:6.2f} ms, T={DEPTH + 1} {win:6.2f} ms", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["0.8b"], choices=sorted(MODELS))
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--iters", type=int, default=5, help="timed iterations (the fastest counts)")
    p.add_argument("--acceptance", type=float, default=0.8, help="per-draft acceptance for the MTP estimate")
    p.add_argument("--compare-attention", action="store_true",
                   help="also time the quantized settings through mlx-lm's quantized attention")
    p.add_argument("--layer-iters", type=int, default=0,
                   help="also time one attention layer's attention alone, fastest of this many (0: skip)")
    p.add_argument("--no-steps", dest="steps", action="store_false", help="skip the whole-model step costs")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    print(BACKEND.note, flush=True)
    rows, layers = [], []
    for name in args.models:
        if args.layer_iters:
            layers += layer_costs(name, args)
        if args.steps:
            rows += run_model(name, args)
    if layers:
        print(f"\n| model | context | KV | one attention layer, T=1 ms | T={DEPTH + 1} ms |\n|---|---|---|---|---|")
        for r in layers:
            print(f"| {r['model']} | {r['context']} | {r['kv']} | {r['attention_t1_ms']:.2f} | {r['attention_t4_ms']:.2f} |")
    if not rows:
        return 0
    print("\n| model | context | KV | plain step ms | verify T=4 ms (plain steps) | head step ms | plain speed vs full | "
          "MTP x (est.) | MTP tok/s (est.) |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['context']} | {r['kv']} | {r['plain_ms']:.1f} | {r['verify_ms']:.1f} "
              f"({r['verify_in_plain_steps']:.2f}) | {r['draft_ms']:.1f} | {r['plain_vs_full']:.2f} | "
              f"{r['mtp_speedup_est']:.2f} | {r['mtp_tok_s_est']:.1f} |")
    if args.json:
        write_json(args.json, {"env": environment(sys.argv), "rows": rows, "attention_layer": layers})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

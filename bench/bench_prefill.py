"""Prefill time: mlx-lm against this project, side by side in one run.

Demo model end to end (the default table, ``--lengths``): stock ``mlx_lm.load``
and its forward (fp32, per-token GatedDeltaNet loop, prefill in
``--prefill-step`` chunks as ``generate_step`` does) against this project's
loader and forward in the same chunks, in two modes: ``previous`` runs
mlx-lm's decoder layers (model.prefill = None: materialised attention scores,
MLX's exp) with the chunked gated delta rule, ``ours`` the CPU prefill layers
(blockwise attention, fused exp-based activations). Modes rotate order every
repeat; the table gives each mode's median and the medians of the paired
ratios (mode time / ours time, pairs from the same repeat share the machine's
load).

Time to first token (``--ttft``): the main request opencode sends
(bench/data/opencode_request.json: its system prompt and ten tool schemas,
captured from ``opencode run`` 1.18.33; ~10k tokens with the demo model's
tokenizer and chat template). mlx-lm: ``generate_step`` until its first token.
This project: the engine's scheduler, as the server runs it (prefill in
``--ttft-chunk`` token steps, default the server's 512, the MTP head over the
prompt), until the first token is delivered; modes as above.

Two more tables compare only the gated delta recurrence: mlx-lm's
``qwen3_5.Model`` with random fp32 weights and Qwen3.5-0.8B-like shapes, its
per-token ops path against the chunked rule patched into mlx-lm's module
(``--model-table``), and the recurrence alone for one layer (``--op-table``).

    python bench/bench_prefill.py                          # 8,192-token demo prefill
    python bench/bench_prefill.py --lengths 2048 8192 --repeats 5 --ttft --json out.json
    python bench/bench_prefill.py --skip-demo --breakdown   # ours, time per layer kind and part
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import mtp_serve  # noqa: F401  (preloads OpenBLAS before mlx.core)

import mlx.core as mx
from mlx_lm.models import qwen3_5
from mlx_lm.models.gated_delta import (
    compute_g,
    compute_lower_bound_g,
    gated_delta_ops,
    normalize_qk,
)

from mtp_serve.models.gated_delta_chunked import CHUNK_SIZE, gated_delta_chunked

TEXT_CONFIG = {
    "model_type": "qwen3_5_text",
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": 8,
    "full_attention_interval": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "vocab_size": 8192,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}

_ORIGINAL_UPDATE = qwen3_5.gated_delta_update


def _make_chunked_update(chunk_size: int):
    def chunked_update(
        q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *,
        use_kernel=True, lower_bound=None, allow_neg_eigval=False,
    ):
        beta = mx.sigmoid(b)
        if allow_neg_eigval:
            beta = beta * 2.0
        if lower_bound is None:
            g = compute_g(A_log, a, dt_bias)
        else:
            g = compute_lower_bound_g(A_log, a, dt_bias, lower_bound)
        return gated_delta_chunked(q, k, v, g, beta, state, mask, chunk_size=chunk_size)

    return chunked_update


@contextlib.contextmanager
def gdn_path(name: str, chunk_size: int):
    """Select the recurrence used by qwen3_5.GatedDeltaNet inside the block."""
    if name == "chunked":
        qwen3_5.gated_delta_update = _make_chunked_update(chunk_size)
    try:
        yield
    finally:
        qwen3_5.gated_delta_update = _ORIGINAL_UPDATE


def build_model(seed: int = 0):
    mx.random.seed(seed)
    args = qwen3_5.ModelArgs.from_dict({"model_type": "qwen3_5", "text_config": TEXT_CONFIG})
    model = qwen3_5.Model(args)
    model.set_dtype(mx.float32)
    model.eval()
    mx.eval(model.parameters())
    return model


def prefill(model, tokens: mx.array, step: int) -> tuple[float, mx.array]:
    """mlx-lm-style prefill; returns (seconds, last-token logits)."""
    cache = model.make_cache()
    t0 = time.perf_counter()
    y = tokens
    while y.shape[0] > 1:
        n = min(step, y.shape[0] - 1)
        model(y[:n][None], cache=cache)
        mx.eval([c.state for c in cache])
        y = y[n:]
    logits = model(y[None], cache=cache)[:, -1, :]
    mx.eval(logits)
    return time.perf_counter() - t0, logits


def op_inputs(T: int, seed: int = 0):
    c = TEXT_CONFIG
    Hk, Hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    Dk, Dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    mx.random.seed(seed)
    q = mx.random.normal((1, T, Hk, Dk))
    k = mx.random.normal((1, T, Hk, Dk))
    q, k = normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    v = mx.random.normal((1, T, Hv, Dv))
    g = mx.exp(-mx.random.uniform(shape=(1, T, Hv)))
    beta = mx.sigmoid(mx.random.normal((1, T, Hv)))
    state = 0.1 * mx.random.normal((1, Hv, Dv, Dk))
    mx.eval(q, k, v, g, beta, state)
    return q, k, v, g, beta, state


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    mx.eval(out)
    return time.perf_counter() - t0, out


def rel_err(a: mx.array, b: mx.array) -> float:
    return (mx.abs(a - b).max() / mx.maximum(mx.abs(b).max(), 1e-12)).item()


def fmt_row(cols, widths):
    return "  ".join(str(c).rjust(w) for c, w in zip(cols, widths))


def compare(title: str, lengths, repeats: int, make_input, runs: dict, err_label: str) -> list:
    """Two paths side by side per length, alternating their order each repeat.

    `runs` maps two names (reference first) to fn(input) -> (seconds, output);
    prints the best time of each, their ratio and the outputs' relative error.
    """
    (a, b), widths = list(runs), [7, 10, 10, 8, 10]
    print(f"\n{title} (best of {repeats}, seconds)")
    print(fmt_row(["tokens", a, b, "ratio", err_label], widths))
    rows = []
    for T in lengths:
        x = make_input(T)
        times, outs = {a: [], b: []}, {}
        for r in range(repeats):
            for name in ((a, b) if r % 2 == 0 else (b, a)):
                dt, outs[name] = runs[name](x)
                times[name].append(dt)
        best = {k: min(v) for k, v in times.items()}
        err = rel_err(outs[b], outs[a])
        ratio = best[a] / best[b]
        print(fmt_row([T, f"{best[a]:.3f}", f"{best[b]:.3f}", f"{ratio:.1f}x", f"{err:.1e}"], widths), flush=True)
        rows.append({"tokens": T, f"{a}_s": times[a], f"{b}_s": times[b], "ratio_best": ratio,
                     f"{a}_median_s": statistics.median(times[a]), f"{b}_median_s": statistics.median(times[b]),
                     f"{a}_tok_per_s": T / best[a], f"{b}_tok_per_s": T / best[b], "rel_err": err})
    return rows


MODES = ("mlx-lm", "previous", "ours")


def rotated(repeats: int, modes=MODES):
    """Mode orders for each repeat, rotating which mode runs first."""
    for r in range(repeats):
        k = r % len(modes)
        yield modes[k:] + modes[:k]


def paired_table(title: str, rows_in, repeats: int, runs: dict, err_label: str) -> list:
    """`runs` maps mode -> fn(x) -> (seconds, output); rows_in: (label, x) pairs.

    Prints each mode's median time and the medians of the paired ratios
    (mode / ours), with the largest relative output difference from mlx-lm's."""
    modes = list(runs)
    widths = [7] + [10] * len(modes) + [16] * (len(modes) - 1) + [10]
    print(f"\n{title} (medians of {repeats}, seconds; ratios: medians of paired ratios, mode / ours)")
    print(fmt_row(["tokens", *modes, *(f"{m}/ours" for m in modes if m != "ours"), err_label], widths))
    rows = []
    for label, x in rows_in:
        times, outs = {m: [] for m in modes}, {}
        for order in rotated(repeats, tuple(modes)):
            for m in order:
                dt, outs[m] = runs[m](x)
                times[m].append(dt)
        ratios = {m: statistics.median([a / b for a, b in zip(times[m], times["ours"])]) for m in modes if m != "ours"}
        err = max(rel_err(outs[m], outs[modes[0]]) for m in modes[1:])
        med = {m: statistics.median(v) for m, v in times.items()}
        print(fmt_row([label, *(f"{med[m]:.3f}" for m in modes), *(f"{r:.2f}x" for r in ratios.values()), f"{err:.1e}"], widths),
              flush=True)
        rows.append({"tokens": label, "times_s": times, "median_s": med, "paired_ratio_vs_ours": ratios, "rel_err": err})
    return rows


def load_demo(args):
    """(mlx-lm's model in fp32, this project's LoadedModel) for the demo checkpoint."""
    from mlx.utils import tree_map
    from mlx_lm import load as mlx_lm_load

    from mtp_serve.models.demo_model import default_model_path
    from mtp_serve.models.loader import load_model

    path = args.demo_model or default_model_path()
    ref, _ = mlx_lm_load(str(path))
    ref.update(tree_map(lambda x: x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating) else x, ref.parameters()))
    return path, ref, load_model(str(path))


def mode_runner(model, mode: str, fn):
    """fn run with this project's model in `mode` ("previous": mlx-lm's layers)."""
    from mtp_serve.models.prefill_layers import PrefillLayers

    def run(x):
        model.prefill = None if mode == "previous" else PrefillLayers()
        try:
            return fn(x)
        finally:
            model.prefill = PrefillLayers()

    return run


def demo_rows(args, path, ref, lm) -> list:
    """The shipped checkpoint end to end, prefill of random tokens."""
    ours = lm.model

    def ours_prefill(tokens: mx.array):
        cache = ours.make_cache()
        t0 = time.perf_counter()
        for i in range(0, tokens.shape[0], args.prefill_step):
            _, logits = ours.forward(tokens[None, i : i + args.prefill_step], cache, last_logits=True)
            mx.eval(logits, [c.state for c in cache])
        return time.perf_counter() - t0, logits[:, -1, :]

    runs = {"mlx-lm": lambda x: prefill(ref, x, args.prefill_step),
            **{m: mode_runner(ours, m, ours_prefill) for m in args.modes if m != "mlx-lm"}}
    for run in runs.values():  # warm-up
        run(mx.random.randint(0, ours.vocab_size, (80,)))
    inputs = [(T, mx.random.randint(0, ours.vocab_size, (T,))) for T in args.lengths]
    return paired_table(f"prefill, {path} end to end (prefill step {args.prefill_step})", inputs, args.repeats, runs, "logit err")


def breakdown_rows(args, lm) -> dict:
    """Where ours spends an 8,192-token prefill: each part of each layer evaluated
    on its own (mx.eval between parts; the sum exceeds a fused run slightly),
    best of --repeats, in the demo table's chunks."""
    from collections import Counter

    from mtp_serve.backend import blas_threads_for
    from mtp_serve.models import prefill_layers as pl
    from mtp_serve.models.mlx_lm_compat import create_attention_mask, create_ssm_mask

    model, inner = lm.model, lm.model.inner

    def part(acc, key, fn):
        t0 = time.perf_counter()
        out = fn()
        mx.eval(out)
        acc[key] += time.perf_counter() - t0
        return out

    def run(tokens, acc):
        cache = model.make_cache()
        for i in range(0, tokens.shape[0], args.prefill_step):
            x = tokens[None, i : i + args.prefill_step]
            blas_threads_for(x.size)
            h = part(acc, "embedding", lambda: inner.embed_tokens(x))
            masks = (create_ssm_mask(h, cache[inner.ssm_idx]), create_attention_mask(h, cache[inner.fa_idx]))
            for layer, c in zip(model.layers, cache):
                kind = "GatedDeltaNet" if layer.is_linear else "attention"
                if layer.is_linear:
                    n = part(acc, f"{kind} layers: input norm", lambda: layer.input_layernorm(h))
                    r = part(acc, f"{kind} layers: mixer", lambda: (layer.linear_attn(n, masks[0], c, cpu_prefill=True), c.state))[0]
                else:
                    r = part(acc, f"{kind} layers: attention (norm, projections, rope, blockwise)",
                             lambda: (pl.attention(layer, h, masks[1], c), c.state))[0]
                h, hn = part(acc, f"{kind} layers: residual, post norm", lambda: (h + r, layer.post_attention_layernorm(h + r)))
                h = part(acc, f"{kind} layers: MLP, residual", lambda: h + pl.mlp(layer.mlp, hn))
            post = part(acc, "final norm", lambda: inner.norm(h))
        part(acc, "LM head, last position", lambda: model.lm_head(post[:, -1:]))
        part(acc, "(not run in prefill: LM head, every position)", lambda: model.lm_head(post))

    run(mx.random.randint(0, model.vocab_size, (300,)), Counter())  # warm-up
    tokens = mx.random.randint(0, model.vocab_size, (max(args.lengths),))
    accs = []
    for _ in range(args.repeats):
        accs.append(Counter())
        run(tokens, accs[-1])
    best = {k: min(a[k] for a in accs) for k in accs[0]}
    total = sum(v for k, v in best.items() if not k.startswith("(not"))
    print(f"\nbreakdown, ours, {tokens.size} tokens (best of {args.repeats}, seconds; parts evaluated one by one)")
    for k, v in best.items():
        print(f"{k:64s} {v:7.3f}  {100 * v / total:5.1f}%")
    print(f"{'sum':64s} {total:7.3f}")
    return best


def opencode_prompt(tokenizer, path: str) -> list:
    """Token ids of a captured chat request, rendered with the model's chat template and tools."""
    req = json.loads(open(path).read())

    def text(content):
        return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)

    messages = [{"role": m["role"], "content": text(m["content"])} for m in req["messages"]]
    rendered = tokenizer.apply_chat_template(messages, tools=req.get("tools"), add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(rendered)


def ttft_rows(args, path, ref, lm) -> list:
    """Time to the first token of the opencode prompt: mlx-lm's generate_step
    against the engine's scheduler (the server's prefill chunking, MTP head included)."""
    from mlx_lm.generate import generate_step

    from mtp_serve.engine.sampling import SamplingParams
    from mtp_serve.engine.scheduler import Scheduler

    ids = opencode_prompt(lm.tokenizer, args.opencode_request)
    depth = lm.card.default_mtp_depth if lm.model.has_mtp else 0

    def mlx_lm_first(prompt):
        t0 = time.perf_counter()
        token, logprobs = next(generate_step(mx.array(prompt), ref, max_tokens=1, prefill_step_size=args.prefill_step))
        return time.perf_counter() - t0, logprobs

    def ours_first(prompt):
        sched = Scheduler(lm.model, lm.tokenizer, max_batch_size=1, prefill_chunk=args.ttft_chunk)
        t0 = time.perf_counter()
        sched.add(0, prompt, SamplingParams(max_tokens=1), depth)
        while True:
            for _, item in sched.step():
                if isinstance(item, BaseException):
                    raise item
                return time.perf_counter() - t0, mx.array(item.token_ids)

    runs = {"mlx-lm": mlx_lm_first, **{m: mode_runner(lm.model, m, ours_first) for m in args.modes if m != "mlx-lm"}}
    for run in runs.values():  # warm-up
        run(ids[:100])
    rows = paired_table(f"time to first token, opencode prompt ({len(ids)} tokens; ours: prefill chunk {args.ttft_chunk},"
                        f" MTP depth {depth})", [(len(ids), ids)], args.repeats,
                        {m: (lambda r: (lambda x: (r(x)[0], mx.zeros(1))))(r) for m, r in runs.items()}, "-")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192], help="demo-model prefill lengths")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each mode per length")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                    help="demo and TTFT modes (ours is always run: ratios are against it)")
    ap.add_argument("--prefill-step", type=int, default=2048, help="prefill chunk of the demo table (mlx-lm's prefill_step_size)")
    ap.add_argument("--ttft", action="store_true", help="also time the first token of the opencode prompt")
    ap.add_argument("--ttft-chunk", type=int, default=512, help="the engine's prefill chunk for --ttft (mtp-serve --prefill-chunk)")
    ap.add_argument("--opencode-request", default=str(Path(__file__).parent / "data" / "opencode_request.json"))
    ap.add_argument("--skip-demo", action="store_true", help="skip the demo-model table")
    ap.add_argument("--breakdown", action="store_true", help="also time each part of ours on the longest --lengths")
    ap.add_argument("--model-table", action="store_true", help="also the gated delta rule inside mlx-lm's model")
    ap.add_argument("--op-table", action="store_true", help="also the gated delta recurrence alone")
    ap.add_argument("--op-lengths", type=int, nargs="+", default=[512, 2048, 8192], help="lengths of those two tables")
    ap.add_argument("--chunk-size", type=int, default=CHUNK_SIZE, help="chunked rule's chunk (those two tables)")
    ap.add_argument("--demo-model", default=None, help="checkpoint for the demo and TTFT tables (default: the demo model)")
    ap.add_argument("--json", type=str, default=None, help="write results here")
    args = ap.parse_args(argv)
    if "ours" not in args.modes:
        args.modes.append("ours")

    info = {
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "backend": getattr(mtp_serve, "BACKEND", None).note if hasattr(mtp_serve, "BACKEND") else "",
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "prefill_step": args.prefill_step,
        "repeats": args.repeats,
    }
    print(f"mlx {info['mlx']} on {info['device']}; {info['backend']}")
    results = {"info": info}

    if not args.skip_demo or args.ttft or args.breakdown:
        path, ref, lm = load_demo(args)
        if not args.skip_demo:
            results["demo"] = demo_rows(args, path, ref, lm)
        if args.ttft:
            results["ttft"] = ttft_rows(args, path, ref, lm)
        if args.breakdown:
            results["breakdown"] = breakdown_rows(args, lm)

    if args.model_table:
        info["text_config"], info["chunk_size"] = TEXT_CONFIG, args.chunk_size
        model = build_model()
        n_gdn = sum(1 for layer in model.layers if layer.is_linear)
        print(
            f"\nmodel: {TEXT_CONFIG['num_hidden_layers']} layers ({n_gdn} GatedDeltaNet), "
            f"hidden {TEXT_CONFIG['hidden_size']}, fp32, random weights"
        )

        def run(path):
            def go(tokens):
                with gdn_path(path, args.chunk_size):
                    return prefill(model, tokens, args.prefill_step)
            return go

        runs = {p: run(p) for p in ("ops", "chunked")}
        warm = mx.random.randint(0, TEXT_CONFIG["vocab_size"], (80,))
        for go in runs.values():  # compiled helpers, first-call allocations
            go(warm)
        results["model"] = compare("prefill, whole model", args.op_lengths, args.repeats,
                                   lambda T: mx.random.randint(0, TEXT_CONFIG["vocab_size"], (T,)), runs, "logit err")

    if args.op_table:
        c = TEXT_CONFIG
        runs = {"ops": lambda x: timed(lambda: gated_delta_ops(*x)[0]),
                "chunked": lambda x: timed(lambda: gated_delta_chunked(*x, chunk_size=args.chunk_size)[0])}
        for go in runs.values():
            go(op_inputs(64))
        results["op"] = compare(
            "recurrence only, one layer: B=1, Hk=Hv=%d, Dk=Dv=%d" % (c["linear_num_value_heads"], c["linear_key_head_dim"]),
            args.op_lengths, args.repeats, op_inputs, runs, "y err")

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

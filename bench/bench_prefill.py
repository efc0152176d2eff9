"""Prefill time of a hybrid Qwen3.5-style model: mlx-lm's per-token ops path
versus the chunked gated delta rule (models/gated_delta_chunked.py).

The model is mlx-lm's own ``qwen3_5.Model`` with random fp32 weights and
Qwen3.5-0.8B-like GatedDeltaNet shapes (fewer layers). The chunked path is
switched on, in this script only, by patching the name ``gated_delta_update``
in the ``mlx_lm.models.qwen3_5`` module namespace. Prefill follows mlx-lm's
``generate_step``: the prompt goes through the model in ``--prefill-step``
token steps, evaluating only the cache after each, then the last token alone
produces the logits. The two paths run alternately, ``--repeats`` times
each; the table reports the best (min) time of each and their ratio.

A second table times the recurrence alone (one layer's shapes) for the same
lengths: ``gated_delta_ops`` versus ``gated_delta_chunked``. A third runs the
shipped demo checkpoint end to end: stock ``mlx_lm.load`` and its forward
against this project's loader and forward (chunked rule included).

    python bench/bench_prefill.py --lengths 512 2048 8192 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time

import mtp_serve  # noqa: F401  (preloads OpenBLAS before mlx.core)

import mlx.core as mx
from mlx_lm.models import qwen3_5
from mlx_lm.models.gated_delta import (
    compute_g,
    compute_lower_bound_g,
    gated_delta_ops,
    normalize_qk,
)

from mtp_serve.models.gated_delta_chunked import gated_delta_chunked

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


def demo_rows(args) -> list:
    """The shipped checkpoint end to end: stock mlx-lm (`mlx_lm.load`, fp32, its
    per-token GatedDeltaNet loop) against this project's loader and forward."""
    from mlx.utils import tree_map
    from mlx_lm import load as mlx_lm_load

    from mtp_serve.models.demo_model import default_model_path
    from mtp_serve.models.loader import load_model

    path = args.demo_model or default_model_path()
    ref, _ = mlx_lm_load(path)
    ref.update(tree_map(lambda x: x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating) else x, ref.parameters()))
    ours = load_model(path).model

    def ours_prefill(tokens: mx.array):
        cache = ours.make_cache()
        t0 = time.perf_counter()
        for i in range(0, tokens.shape[0], args.prefill_step):
            _, logits = ours.forward(tokens[None, i : i + args.prefill_step], cache)
            mx.eval(logits, [c.state for c in cache])
        return time.perf_counter() - t0, logits[:, -1, :]

    runs = {"mlx-lm": lambda x: prefill(ref, x, args.prefill_step), "ours": ours_prefill}
    for run in runs.values():  # warm-up
        run(mx.random.randint(0, ours.vocab_size, (80,)))
    return compare(f"prefill, {path} end to end: stock mlx-lm vs mtp-serve", args.lengths, args.repeats,
                   lambda T: mx.random.randint(0, ours.vocab_size, (T,)), runs, "logit err")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--repeats", type=int, default=2, help="runs of each path per length")
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--prefill-step", type=int, default=2048, help="mlx-lm's prefill_step_size")
    ap.add_argument("--skip-model", action="store_true", help="only the op-level table")
    ap.add_argument("--skip-op", action="store_true", help="only the model table")
    ap.add_argument("--skip-demo", action="store_true", help="skip the demo-model table")
    ap.add_argument("--demo-model", default=None, help="checkpoint for the end-to-end table (default: the demo model)")
    ap.add_argument("--json", type=str, default=None, help="write results here")
    args = ap.parse_args(argv)

    info = {
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "backend": getattr(mtp_serve, "BACKEND", None).note if hasattr(mtp_serve, "BACKEND") else "",
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "text_config": TEXT_CONFIG,
        "chunk_size": args.chunk_size,
        "prefill_step": args.prefill_step,
        "repeats": args.repeats,
    }
    print(f"mlx {info['mlx']} on {info['device']}; {info['backend']}")
    results = {"info": info}

    if not args.skip_model:
        model = build_model()
        n_gdn = sum(1 for layer in model.layers if layer.is_linear)
        print(
            f"model: {TEXT_CONFIG['num_hidden_layers']} layers ({n_gdn} GatedDeltaNet), "
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
        results["model"] = compare("prefill, whole model", args.lengths, args.repeats,
                                   lambda T: mx.random.randint(0, TEXT_CONFIG["vocab_size"], (T,)), runs, "logit err")

    if not args.skip_op:
        c = TEXT_CONFIG
        runs = {"ops": lambda x: timed(lambda: gated_delta_ops(*x)[0]),
                "chunked": lambda x: timed(lambda: gated_delta_chunked(*x, chunk_size=args.chunk_size)[0])}
        for go in runs.values():
            go(op_inputs(64))
        results["op"] = compare(
            "recurrence only, one layer: B=1, Hk=Hv=%d, Dk=Dv=%d" % (c["linear_num_value_heads"], c["linear_key_head_dim"]),
            args.lengths, args.repeats, op_inputs, runs, "y err")

    if not args.skip_demo:
        results["demo"] = demo_rows(args)

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

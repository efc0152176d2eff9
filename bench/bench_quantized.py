"""Quantized models at real shapes: plain decode against mlx-lm, verify and draft costs,
MTP at a known acceptance, and bytes per step against the memory bandwidth.

    python bench/bench_quantized.py [--rows 0.8b:4 0.8b:8 2b:4 2b:8 4b:4 4b:8 a3b:4 a3b:8]
                                    [--tokens 32] [--depths 1 2 3 4] [--acceptance 0.8] [--fp32-head]
                                    [--numerics exact int8] [--gdn native mlx] [--draft-vocab 0 32768]
                                    [--vnni on off]
    python bench/bench_quantized.py --compare-heads --rows 0.8b:4      # draft cost: fp32 vs quantized head
    python bench/bench_quantized.py --kernel [--bits 4]                # the products alone, and prefill's
    python bench/bench_quantized.py --where --rows 0.8b:4              # a step's and a window's time by layer kind
    python bench/bench_quantized.py --window-commit --rows 0.8b:4      # verify windows and commits:
                                                                       # every state vs last state + replay

Random-weight models with the layer shapes of Qwen3.5-0.8B, 2B and 4B (the real
248,320-token vocabulary, tied embeddings) and a Qwen3.6-35B-A3B expert layout scaled
to fit this machine (hidden 2048, experts of 512 with 8 routed and one shared, as the
real model; 10 of its 40 layers and 64 of its 256 experts), quantized as `mlx_lm
convert -q` does (group size 64) at 4 and 8 bits, the MTP head too (`--fp32-head`: not).
Per row:
- plain decode tok/s with mtp-serve's kernel, and mlx-lm's own `generate_step` on the
  same quantized model (MLX's kernels), and their ratio;
- the verify window T=2..5 and one draft, in plain steps (`cost_model.measure_costs`);
- MTP with a benchmark-only oracle at acceptance a (bench_acceptance_speed's), depths
  1-4, against plain, beside the limit E / (verify(K+1) + K draft);
- bytes one plain step reads (weights; a MoE layer's routed and shared experts only)
  over its time, against the stream bandwidth measured here (an fp32 matvec over 512 MB);
- where a forward's time goes: milliseconds inside the quantized kernel of a T=1 and a
  T=4 forward (the rest: GatedDeltaNet and attention, norms, dispatch).
With several --numerics (the kernel's exact fp32 and int8 products), each is a line
of the table on the same model (mlx-lm measured once), one after the other.
Each row runs a few minutes on 2 cores; pick rows with --rows.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics

from common import median_seconds, pc, timed_seconds  # noqa: I001  (first: backend set-up before mlx.core)

import mlx.core as mx
from mlx.utils import tree_flatten

from bench_acceptance_speed import SHAPES, Tok, decode, oracle_drafts
from cost_model import QWEN35_VOCAB, cost_ratios, measure_costs
from mtp_serve import BACKEND
from mtp_serve import quantized_matmul as qmm_ext
from mtp_serve.engine.warmup import calibrate_blas_threads
from mtp_serve.models import gdn
from mtp_serve.models.compiled_steps import CompiledLayers
from mtp_serve.models.quantized_layers import install_decode_qmm, use_kernel
from mtp_serve.testing.quantized import quantize_head, quantize_mlx_lm_model

GROUP_SIZE = 64
A3B = dict(hidden_size=2048, num_hidden_layers=10, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512,
           shared_expert_intermediate_size=512, decoder_sparse_step=1, norm_topk_prob=True, intermediate_size=512,
           linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
           num_attention_heads=16, num_key_value_heads=2, head_dim=256, full_attention_interval=4,
           vocab_size=QWEN35_VOCAB, tie_word_embeddings=False,
           rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10]})


def quantized_model(shape: str, bits: int, quantize_mtp_head: bool = True):
    """A random MTPModel of `shape`, body (and head) quantized (never materialized in fp32 whole)."""
    from mtp_serve.models.gdn import install_capturing_gdn
    from mtp_serve.models.model_card import load_card
    from mtp_serve.models.mtp_model import MTPModel
    from mtp_serve.testing.synthetic import build_random, tiny_text_config

    family = "qwen3_5_moe" if shape == "a3b" else "qwen3_5"
    text = tiny_text_config(family, **(A3B if shape == "a3b" else SHAPES[shape](QWEN35_VOCAB)))
    model, head, _ = build_random(family, text)
    quantize_mlx_lm_model(model, bits, GROUP_SIZE)
    if quantize_mtp_head:
        quantize_head(head, bits, GROUP_SIZE)
    for layer in model.language_model.model.layers:  # one layer at a time: its fp32 weights are freed as it goes
        mx.eval(layer.parameters())
    mx.eval(model.parameters(), head.parameters())
    install_capturing_gdn(model.language_model.model.layers)
    model.eval()
    head.eval()
    mtp = MTPModel(model, model.language_model, head, load_card(family), family)
    installed = install_decode_qmm([model, head])
    assert installed or qmm_ext.load() is None, qmm_ext.status()  # off CPU (a GPU): MLX's kernels
    return mtp, text


def bytes_per_step(model, text: dict) -> int:
    """Weight bytes one plain decode step reads: all but the embedding table (one row), plus the
    tied LM head, and of each MoE layer only its routed share of the experts."""
    total = 0
    params = dict(tree_flatten(model.model.parameters()))
    for name, v in params.items():
        if name.endswith("_lanes") and name[:-len("_lanes")] in params:
            continue  # a benchmark's model holding both layouts reads one
        if "embed_tokens" in name and text.get("tie_word_embeddings"):
            total += v.nbytes  # read whole as the LM head
        elif "embed_tokens" in name:
            total += v.nbytes // v.shape[0]
        elif "switch_mlp" in name:
            total += v.nbytes * text["num_experts_per_tok"] // text["num_experts"]
        else:
            total += v.nbytes
    return total


def stream_bandwidth() -> float:
    """Bytes/s of an fp32 matvec over 512 MB (the skinny sgemm's streaming speed)."""
    W = mx.random.normal((65536, 2048))
    x = mx.random.normal((1, 2048))
    mx.eval(W, x)
    s = median_seconds(lambda: mx.eval(x @ W.T), 5)
    del W
    return 65536 * 2048 * 4 / s


def primed_cache(model) -> list:
    """A fresh cache after a 16-token prompt: what the timed steps and windows decode from."""
    cache = model.make_cache()
    h, _ = model.forward(mx.random.randint(0, 1000, (1, 16)), cache)
    mx.eval(h, [c.state for c in cache])
    return cache


def kernel_share(model, T: int, reps: int = 4) -> tuple:
    """(ms per forward of T tokens, ms of it inside the quantized kernel): where a step's time goes."""
    cache = primed_cache(model)
    wall = kern = 0.0
    for i in range(reps + 1):
        x = mx.random.randint(0, 1000, (1, T))
        mx.eval(x)
        k0, t0 = qmm_ext.seconds(), pc()
        h, lg = model.forward(x, cache)
        mx.eval(h, lg, [c.state for c in cache])
        if i:  # the first: warm-up
            wall, kern = wall + pc() - t0, kern + qmm_ext.seconds() - k0
    return 1e3 * wall / reps, 1e3 * kern / reps


def mlx_lm_tok_s(lm, prompt: list, n: int) -> float:
    """mlx-lm's own greedy decoding on the same quantized model, MLX's kernels."""
    from mlx_lm.generate import generate_step

    with use_kernel([lm.model.model, lm.model.head], False):
        first = last = None
        for (tok, _), i in zip(generate_step(mx.array(prompt), lm.model.model, max_tokens=n), range(n)):
            mx.eval(tok)
            last = pc()
            first = first or last
    return (n - 1) / (last - first)


def run_rows(shape: str, bits: int, args, bandwidth: float) -> list:
    """One row per numerics, on one model."""
    t0 = pc()
    model, text = quantized_model(shape, bits, not args.fp32_head)
    lm = type("LM", (), {"model": model, "tokenizer": Tok()})()
    print(f"[{shape} {bits}-bit] built in {pc() - t0:.0f}s", flush=True)
    prompt = mx.random.randint(0, QWEN35_VOCAB, (32,), key=mx.random.key(1)).tolist()
    ref_tok_s = mlx_lm_tok_s(lm, prompt, args.mlx_lm_tokens)
    rows = []
    for numerics, recurrence, dv, vnni in itertools.product(args.numerics, args.gdn, args.draft_vocab, args.vnni):
        qmm_ext.set_numerics(numerics)
        if qmm_ext.load() is not None:
            qmm_ext.load().set_vnni(vnni == "on")
        gdn.NATIVE = recurrence == "native"
        model.use_draft_vocab(list(range(dv)) if dv else None)
        model.compiled = CompiledLayers()  # compiled steps keep the numerics and paths they traced
        kernel = numerics if qmm_ext.load() is not None else "MLX's kernels"  # (a GPU)
        label = ", ".join([kernel] + [f"{recurrence} GDN"] * (len(args.gdn) > 1)
                          + [f"drafts from {dv}" if dv else "drafts from all"] * (len(args.draft_vocab) > 1)
                          + [f"VNNI {vnni}"] * (len(args.vnni) > 1))
        rows.append(run_row(lm, text, shape, bits, label, prompt, ref_tok_s, args, bandwidth))
    gdn.NATIVE = True
    if qmm_ext.load() is not None:
        qmm_ext.load().set_vnni(args.vnni_start == "on")
    model.use_draft_vocab(None)
    del model, lm
    gc.collect()
    mx.clear_cache()
    return rows


def run_row(lm, text: dict, shape: str, bits: int, numerics: str, prompt: list, ref_tok_s: float, args,
            bandwidth: float) -> dict:
    t0 = pc()
    model = lm.model
    calibrate_blas_threads(model, lm.tokenizer)
    costs = cost_ratios(measure_costs(model, context=32, reps=3))
    reference, plain, _ = decode(lm, prompt, args.tokens + 8, 0)
    for K in args.depths:  # trace every depth's shapes (compiled steps, MLX's fused kernels) before timing
        decode(lm, prompt, 12, K)
    row = dict(shape=shape, bits=bits, numerics=numerics, step_ms=costs["step_ms"], verify=costs["verify"],
               draft=costs["draft"],
               bytes=bytes_per_step(model, text), mlx_lm=ref_tok_s, mtp={},
               kernel={T: kernel_share(model, T) for T in (1, 4)})
    plain_runs = [plain]
    with oracle_drafts(reference, args.acceptance, QWEN35_VOCAB):
        for K in args.depths:
            toks, tok_s, tpr = decode(lm, prompt, args.tokens, K)
            same = toks == reference[: len(toks)]
            if not BACKEND.exact_windows:  # a GPU: reported, not promised (docs/quantized.md, "MLX's CUDA backend")
                row.setdefault("identical", {})[K] = same
            elif qmm_ext.numerics() == "exact" or qmm_ext.default_numerics() == "int8":  # int8: see default_numerics
                assert same, "MTP changed the output"
            plain_runs.append(decode(lm, prompt, args.tokens, 0)[1])  # alternate: load drift hits both
            E = sum(args.acceptance**j for j in range(K + 1))
            # against the plain run beside it (a busy machine's drift hits the pair alike)
            row["mtp"][K] = dict(tok_s=tok_s, ratio=tok_s / plain_runs[-1], per_round=tpr,
                                 limit=E / (costs["verify"][K + 1] + K * costs["draft"]))
    row["plain"] = sorted(plain_runs)[len(plain_runs) // 2]  # median
    row["bandwidth_share"] = row["bytes"] * row["plain"] / bandwidth
    print(f"[{shape} {bits}-bit {numerics}] plain {row['plain']:.2f} tok/s, mlx-lm {ref_tok_s:.2f} "
          f"({row['plain'] / ref_tok_s:.1f}x); verify T=4 {costs['verify'][4]:.2f}, draft {costs['draft']:.3f} steps; "
          + ", ".join(f"K{K} {m['ratio']:.2f}x (limit {m['limit']:.2f}x)" for K, m in row["mtp"].items())
          + "".join(f"; MTP tokens = plain's at K={K}: {same}" for K, same in row.get("identical", {}).items())
          + f"; {row['bytes'] / 1e6:.0f} MB/step at {row['bandwidth_share']:.2f} of bandwidth; kernel "
          + ", ".join(f"{k:.0f} of {w:.0f} ms at T={T}" for T, (w, k) in row["kernel"].items()) + " "
          f"({pc() - t0:.0f}s)", flush=True)
    return row


def compare_heads(shape: str, bits: int) -> None:
    """Draft cost with the MTP head unquantized (fp32) and quantized like the body, one
    body, alternating (`mtp-graft --quantize-head`'s question; random weights: costs only)."""
    from mtp_serve.models.mlx_lm_compat import Qwen35DecoderLayer
    from mtp_serve.models.model_card import load_card
    from mtp_serve.models.mtp_head import MTPHead
    from mtp_serve.models.mtp_model import MTPModel

    fp, _ = quantized_model(shape, bits, quantize_mtp_head=False)
    head = MTPHead(fp.text.args, Qwen35DecoderLayer)
    quantize_head(head, bits, GROUP_SIZE)
    mx.eval(head.parameters())
    head.eval()
    install_decode_qmm([head])
    q = MTPModel(fp.model, fp.text, head, load_card("qwen3_5"), "qwen3_5")
    runs: dict = {"fp32 head": [], f"{bits}-bit head": []}
    for _ in range(3):
        for name, m in zip(runs, (fp, q)):
            runs[name].append(cost_ratios(measure_costs(m, context=32, reps=3)))
    for name, cs in runs.items():
        d, st = sorted(c["draft"] for c in cs)[1], sorted(c["step_ms"] for c in cs)[1]
        print(f"[{shape} {bits}-bit body] {name}: draft {d:.3f} plain steps ({d * st:.1f} ms; step {st:.0f} ms)", flush=True)


def window_commit(shape: str, bits: int, T: int = 4, reps: int = 24) -> None:
    """Verify windows of T tokens and commits keeping k of them: GatedDeltaNet windows that write
    every position's state against windows that write their last state and replay a shorter
    commit (`ReplayStates`), each form on its own cache, interleaved in one process (medians, ms,
    beside a plain step). Two ways: each window with its commit's state computed at once, and one
    window after another with the kept state computed in the next window's graph, as in a round."""
    from mtp_serve.models.caches import keep_verified, set_capture

    model, _ = quantized_model(shape, bits)
    calibrate_blas_threads(model, Tok())
    forms = {"every state": False, "replay": True}
    caches, compiled = {}, {}

    def window(name: str, keep: int, with_state: bool) -> float:
        model.compiled, cache = compiled[name], caches[name]
        x = mx.random.randint(0, 1000, (1, T))
        mx.eval(x)
        t = pc()
        set_capture(cache, True)
        out = model.forward(x, cache)
        set_capture(cache, False)
        keep_verified(cache, [keep], T)
        mx.eval(out, [c.state for c in cache] if with_state else [])
        return pc() - t

    for name, replay in forms.items():
        caches[name] = primed_cache(model)
        gdn.REPLAY = replay
        compiled[name] = model.compiled = CompiledLayers()  # a compiled window keeps the form of its trace
        for keep in (2, 1, 4):
            window(name, keep, True)
    gdn.REPLAY = True
    runs: dict = {(way, name): {k: [] for k in range(1, T + 1)} for way in (True, False) for name in forms}
    for _ in range(reps):
        for keep in range(1, T + 1):
            for way in (True, False):
                for _ in range(2):  # the second window follows a commit of the same k
                    for name in forms:
                        runs[way, name][keep].append(window(name, keep, way))
    model.compiled = CompiledLayers()
    cache = model.make_cache()
    plain = []
    for _ in range(reps + 2):
        x = mx.random.randint(0, 1000, (1, 1))
        mx.eval(x)
        t = pc()
        out = model.forward(x, cache)
        mx.eval(out, [c.state for c in cache])
        plain.append(pc() - t)
    step = statistics.median(plain[2:])
    print(f"[{shape} {bits}-bit] plain step {step * 1e3:.1f} ms; T={T} windows, commits keeping k positions:")
    for (way, name), by_keep in runs.items():
        print(f"  {'with its state' if way else 'one after another'}, {name}: "
              + ", ".join(f"k={k} {statistics.median(v) * 1e3:.1f} ms ({statistics.median(v) / step:.2f} steps)"
                          for k, v in by_keep.items()), flush=True)


def where_time_goes(shape: str, bits: int, reps: int = 6) -> dict:
    """Where a plain step (T=1) and a verify window (T=4, capturing its states and committing
    all four, as a round does) spend their time: the forward as it runs, then with an eval after
    each decoder layer, split into the GatedDeltaNet layers, the attention layers (each with its
    MLP or MoE) and the final norm with the LM head, each with its milliseconds inside the
    quantized kernel (medians of `reps`, ms). The per-layer evals stop MLX from overlapping
    layers, so their sum runs a little over the plain forward."""
    from mtp_serve.models.caches import keep_verified, set_capture

    model, _ = quantized_model(shape, bits)
    calibrate_blas_threads(model, Tok())
    cache = primed_cache(model)
    run_layer = model.run_layer
    parts: dict = {}

    def timed_layer(layer, h, mask, c, rope=None):
        mx.eval(h)
        t, k = pc(), qmm_ext.seconds()
        out = run_layer(layer, h, mask, c, rope)
        mx.eval(out, c.state)
        part = parts.setdefault("GatedDeltaNet layers" if layer.is_linear else "attention layers", [0.0, 0.0])
        part[0], part[1] = part[0] + pc() - t, part[1] + qmm_ext.seconds() - k
        return out

    def forward(T: int, per_layer: bool) -> dict:
        parts.clear()
        x = mx.random.randint(0, 1000, (1, T))
        mx.eval(x)
        set_capture(cache, T > 1)
        model.run_layer = timed_layer if per_layer else run_layer
        t, k = pc(), qmm_ext.seconds()
        hidden, logits = model.forward(x, cache)
        if per_layer:
            mx.eval(hidden)
            t1, k1 = pc(), qmm_ext.seconds()
        mx.eval(hidden, logits, [c.state for c in cache])
        out = {"forward": (pc() - t, qmm_ext.seconds() - k)}
        if per_layer:
            out.update(parts)
            out["norm and LM head"] = (pc() - t1, qmm_ext.seconds() - k1)
        model.run_layer = run_layer
        set_capture(cache, False)
        if T > 1:
            keep_verified(cache, [T], T)
            mx.eval([c.state for c in cache])
        return out

    found = {}  # (T, per_layer) -> {part: (ms, kernel ms)}
    for T in (1, 4):
        for per_layer in (False, True):
            forward(T, per_layer)  # warm-up (traces, the threads)
            runs = [forward(T, per_layer) for _ in range(reps)]
            parts_ms = found[T, per_layer] = {
                name: tuple(statistics.median(r[name][i] for r in runs) * 1e3 for i in (0, 1)) for name in runs[0]}
            print(f"[{shape} {bits}-bit] T={T}{', eval after each layer' if per_layer else ''}: "
                  + ", ".join(f"{name} {w:.1f} (kernel {k:.1f})" for name, (w, k) in parts_ms.items()), flush=True)
    return found


def where_table(found: dict) -> None:
    """--where's rows side by side: ms (kernel ms) of a T=1 step and a T=4 window, then by part."""
    names = ("GatedDeltaNet layers", "attention layers", "norm and LM head")
    print("\n| shape, bits | T=1 forward | T=4 window | T=4 / T=1 | "
          + " | ".join(f"{n}, T=1 / T=4" for n in names) + " |\n|" + "---|" * (4 + len(names)))
    for (shape, bits), f in found.items():
        (w1, k1), (w4, k4) = f[1, False]["forward"], f[4, False]["forward"]
        print(f"| {shape} {bits}-bit | {w1:.1f} ({k1:.1f}) | {w4:.1f} ({k4:.1f}) | {w4 / w1:.2f} | "
              + " | ".join("{:.1f} ({:.1f}) / {:.1f} ({:.1f})".format(*f[1, True][n], *f[4, True][n]) for n in names)
              + " |")
    print("ms (of them in the quantized kernel), medians; by part: with an eval after each layer")


def kernel_only(bits: int, threads: int) -> None:
    """The products alone at Qwen3.5-0.8B's shapes (min of repeated calls, ms): exact and int8
    numerics against MLX's `quantized_matmul` and an fp32 matmul of the same shape; then a
    prefill-sized product: MLX's kernel, dequantized per call (what prefill runs), fp32 resident."""
    from mtp_serve.models.quantized_layers import dequantized_matmul

    def best(f, reps):
        return 1e3 * min(timed_seconds(f, reps))

    qmm_ext.set_threads(threads)
    print(f"{bits}-bit, group {GROUP_SIZE}, kernel on {threads} thread(s); ms per product (min of repeats)")
    print("| shape (out x in) | rows | exact | int8 | MLX quantized_matmul | fp32 matmul |\n|---|---|---|---|---|---|")
    for N, K in ((6144, 1024), (3584, 1024), (1024, 3584), (248320, 1024)):
        w, s, b = mx.quantize(0.05 * mx.random.normal((N, K)), group_size=GROUP_SIZE, bits=bits)
        W = mx.random.normal((N, K))
        mx.eval(w, s, b, W)
        reps = 5 if N > 100000 else 15
        for M in (1, 2, 4, 8):
            x = mx.random.normal((M, K))
            mx.eval(x)
            t = {}
            for mode in qmm_ext.NUMERICS:
                qmm_ext.set_numerics(mode)
                t[mode] = best(lambda: mx.eval(qmm_ext.qmm(x, w, s, b, GROUP_SIZE, bits)), reps)
            ref = best(lambda: mx.eval(mx.quantized_matmul(x, w, s, b, transpose=True, group_size=GROUP_SIZE,
                                                          bits=bits)), 3) if N < 100000 else float("nan")
            fp = best(lambda: mx.eval(x @ W.T), reps)
            print(f"| {N} x {K} | {M} | {t['exact']:.3f} | {t['int8']:.3f} | {ref:.2f} | {fp:.3f} |", flush=True)
        del W
    qmm_ext.set_numerics(None)
    N, K = 3584, 1024
    w, s, b = mx.quantize(0.05 * mx.random.normal((N, K)), group_size=GROUP_SIZE, bits=bits)
    W = mx.dequantize(w, s, b, group_size=GROUP_SIZE, bits=bits)
    for M in (64, 512):
        x = mx.random.normal((M, K))
        mx.eval(w, s, b, W, x)
        mlx = best(lambda: mx.eval(mx.quantized_matmul(x, w, s, b, transpose=True, group_size=GROUP_SIZE, bits=bits)), 2)
        deq = best(lambda: mx.eval(dequantized_matmul(x, w, s, b, GROUP_SIZE, bits)), 3)
        fp = best(lambda: mx.eval(x @ W.T), 3)
        print(f"prefill-sized, {N} x {K}, {M} rows: MLX's kernel {mlx:.1f} ms, dequantized per call {deq:.1f} ms "
              f"(what mtp-serve runs), fp32 resident {fp:.1f} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", default=["0.8b:4", "0.8b:8", "2b:4", "2b:8", "4b:4", "4b:8", "a3b:4", "a3b:8"])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--mlx-lm-tokens", type=int, default=6, help="mlx-lm is slow on quantized models on CPU")
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--acceptance", type=float, default=0.8)
    ap.add_argument("--fp32-head", action="store_true", help="keep the MTP head unquantized (mtp-graft's default)")
    ap.add_argument("--numerics", nargs="+", default=[qmm_ext.default_numerics()], choices=qmm_ext.NUMERICS,
                    help="the kernel's numerics, a line each (default: mtp-serve's default)")
    ap.add_argument("--gdn", nargs="+", default=["native"], choices=["native", "mlx"],
                    help="the GatedDeltaNet recurrence of decode steps and windows: mtp-serve's native kernel "
                         "or mlx-lm's ops, a line each")
    ap.add_argument("--draft-vocab", type=int, nargs="+", default=[0],
                    help="the head drafts from the N most frequent tokens (--draft-vocab N; 0: all), a line each")
    # The int8 kernel's AVX-512 VNNI form: on where the CPU has it and MTP_SERVE_NO_VNNI is unset.
    vnni_start = "on" if qmm_ext.load() is not None and qmm_ext.load().vnni() else "off"
    ap.add_argument("--vnni", nargs="+", default=[vnni_start], choices=["on", "off"],
                    help="int8 numerics on AVX-512 VNNI where the CPU has it, or the AVX2 form, a line each")
    ap.add_argument("--compare-heads", action="store_true",
                    help="only the draft cost of an unquantized and a quantized head on each row's body (dense shapes)")
    ap.add_argument("--kernel", action="store_true", help="only the products alone at 0.8B shapes (and prefill's)")
    ap.add_argument("--bits", type=int, default=4, help="with --kernel")
    ap.add_argument("--threads", type=int, default=1, help="with --kernel: the kernel's threads")
    ap.add_argument("--where", action="store_true",
                    help="where a T=1 step and a T=4 window spend their time, by layer kind, kernel ms beside")
    ap.add_argument("--window-commit", action="store_true",
                    help="T=4 verify windows, commits keeping 1-4: every state written against replays")
    args = ap.parse_args()
    args.vnni_start = vnni_start
    print(BACKEND.note)
    print(qmm_ext.status())
    if (args.kernel or args.window_commit or args.where) and qmm_ext.load() is None:
        raise SystemExit("--kernel, --window-commit and --where time mtp-serve's CPU kernel, which is off here")
    if args.kernel:
        kernel_only(args.bits, args.threads)
        return
    if args.where:
        found = {}
        for spec in args.rows:
            shape, bits = spec.split(":")
            found[shape, bits] = where_time_goes(shape, int(bits))
            gc.collect()
            mx.clear_cache()
        where_table(found)
        return
    if args.window_commit:
        for spec in args.rows:
            shape, bits = spec.split(":")
            window_commit(shape, int(bits))
        return
    if args.compare_heads:
        for spec in args.rows:
            shape, bits = spec.split(":")
            compare_heads(shape, int(bits))
        return
    bandwidth = stream_bandwidth()
    print(f"stream bandwidth (fp32 matvec over 512 MB): {bandwidth / 1e9:.1f} GB/s", flush=True)
    rows = []
    for spec in args.rows:
        shape, bits = spec.split(":")
        rows += run_rows(shape, int(bits), args, bandwidth)
    Ks = args.depths
    print(f"\n| shape | bits | numerics | plain tok/s | mlx-lm tok/s | x mlx-lm | verify T=2/3/4/5 (steps) | draft (steps) | "
          + " | ".join(f"MTP K={K} x plain (limit)" for K in Ks) + " | MB/step | GB/s | of bandwidth | kernel ms of step ms, T=1 | T=4 |")
    print("|" + "---|" * (13 + len(Ks)))
    for r in rows:
        v = "/".join(f"{r['verify'][T]:.2f}" for T in (2, 3, 4, 5))
        mtp = " | ".join(f"{r['mtp'][K]['ratio']:.2f}x ({r['mtp'][K]['limit']:.2f}x)" for K in Ks)
        print(f"| {r['shape']} | {r['bits']} | {r['numerics']} | {r['plain']:.2f} | {r['mlx_lm']:.2f} | {r['plain'] / r['mlx_lm']:.1f}x | {v} | "
              f"{r['draft']:.3f} | {mtp} | {r['bytes'] / 1e6:.0f} | {r['bytes'] * r['plain'] / 1e9:.1f} | "
              f"{r['bandwidth_share']:.2f} | " + " | ".join(f"{k:.0f} / {w:.0f}" for w, k in r["kernel"].values()) + " |")
    for r in rows:
        if "identical" in r:  # off CPU
            print(f"{r['shape']} {r['bits']}-bit: MTP's tokens plain's at "
                  + ", ".join(f"K={K} {'yes' if same else 'NO'}" for K, same in r["identical"].items()))
    print(f"plain: median of {1 + len(Ks)} runs; MTP K: over the plain run beside it; "
          f"acceptance a = {args.acceptance} (oracle); limit: E[tokens per round] / (verify(K+1) + K * draft); "
          f"bandwidth {bandwidth / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()

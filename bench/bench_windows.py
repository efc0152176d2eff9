"""Verify windows of T tokens in plain steps, and the products' rate against the machine's peak.

    python bench/bench_windows.py [--shapes 0.8b 2b 4b a3b] [--bodies fp32 8 4] [--windows 1 2 4 8 16 32]
                                  [--contexts 0 8192 32768] [--reps 5] [--forms now before|block|group|vnni]

Random-weight models with Qwen3.5's layer shapes and real vocabulary (bench_acceptance_speed's
SHAPES; the A3B expert layout of bench_quantized, quantized bodies only), an fp32 body or one
quantized as `mlx_lm convert -q` does (group size 64) at 8 or 4 bits, the threads chosen as the
server's start-up calibration chooses them. Per (shape, body, context):
- a T-token verify window (GatedDeltaNet state capture on) and its commit, in plain one-token steps
  (medians; the forms alternate inside each repetition), after a prompt of the context's length
  (context 0: a 16-token prompt; the cache grows by one token a window, as a round that keeps one);
- the rate of the body's products alone at each T: one layer's MLP projections (gate, up, down) over
  T rows, in multiply-adds per second, against the peak (independent FMA chains in registers,
  every core, `skinny_sgemm.c`'s `mtp_skinny_peak_fma`) measured in the same run;
- the weight bytes a plain step reads over its time, against the stream bandwidth (an fp32 matvec
  over 512 MB), measured in the same run.
With `--forms now before`, each measurement also runs on the kernels' earlier forms (fp32 windows
of more than 8 rows on OpenBLAS, no AVX-512 forms) on the same model, and the ratio is printed;
`--forms now block`: int8 quantized products on the block form (x rounded per 32 values) instead;
`--forms now group`: on the group form over the checkpoint's layout (each block of W transposed and
unpacked per call) instead of the lane layout repacked at load (the model then holds both layouts);
`--forms now vnni`: the lanes with every product on vpdpbusd (AMX off, where the CPU has AMX);
`--forms now noprefetch`: the lanes without the software prefetch of the weights ahead of each read.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import threading

from common import median_seconds, pc  # noqa: I001  (first: backend set-up before mlx.core)

import mlx.core as mx

from bench_acceptance_speed import SHAPES, Tok
from bench_quantized import bytes_per_step, quantized_model, stream_bandwidth
from cost_model import QWEN35_VOCAB, random_mtp_model
from mtp_serve import quantized_matmul as qmm_ext
from mtp_serve import skinny_gemm
from mtp_serve.models import quantized_layers
from mtp_serve.engine.warmup import calibrate_blas_threads
from mtp_serve.engine.window_costs import prefilled_cache, time_window

PROMPT_AT_ZERO = 16
_DEFAULT_PREFETCH: dict = {}  # the kernel's prefetch distance as loaded, restored after "noprefetch"


def peak_fma_per_s(seconds: float = 0.3) -> float:
    """Multiply-adds per second of every core at once (registers only): the arithmetic ceiling."""
    if not skinny_gemm.active():
        return float("nan")
    iters = max(1000, int(skinny_gemm.peak_fma(200000) * seconds / 384))  # ~`seconds` per thread (384 a round)

    def every_core() -> float:
        rates = []
        threads = [threading.Thread(target=lambda: rates.append(skinny_gemm.peak_fma(iters)))
                   for _ in range(os.cpu_count() or 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(rates)

    return max(every_core() for _ in range(3))  # the best of three: other processes only slow it


def use_forms(form: str) -> None:
    """"now": the kernels as they run; "before": fp32 products of more than 8 rows on OpenBLAS and
    none on the AVX-512 forms (fp32 or quantized): how verify windows ran before those forms;
    "block": as now, but int8 quantized products on the block form (x rounded per 32 values, the
    pair form from 4 rows) instead of the group form; "group": the group form over the original layout
    instead of the lanes (every form but "now" and "vnni" computes on the original layout); "vnni": the
    lanes without AMX's tiles (windows on vpdpbusd)."""
    before = form == "before"
    skinny_gemm.set_max_rows(8 if before else 64)
    skinny_gemm.set_wide_rows(0 if before else 2)
    ext = qmm_ext.load()
    if ext is not None:
        ext.set_pair_rows(0 if before else 4)
        ext.set_int8_group(form in ("now", "group", "vnni", "noprefetch"))
        ext.set_amx(form in ("now", "noprefetch") and os.environ.get("MTP_SERVE_NO_AMX") != "1")
        _DEFAULT_PREFETCH.setdefault("bytes", ext.prefetch_distance())
        ext.set_prefetch_distance(0 if form == "noprefetch" else _DEFAULT_PREFETCH["bytes"])
    quantized_layers.set_lanes(form in ("now", "vnni", "noprefetch"))


def build(shape: str, body: str, both_layouts: bool = False):
    """(MTPModel, text config) of `shape` with an fp32 or a quantized body (`both_layouts`: its quantized
    layers keep the original layout beside the lanes, for the forms that read it)."""
    if body == "fp32":
        if shape == "a3b":
            raise SystemExit("the A3B layout is built quantized only (--bodies 8 4)")
        text = SHAPES[shape](QWEN35_VOCAB)
        return random_mtp_model(text), text
    if not both_layouts:
        return quantized_model(shape, int(body))
    os.environ["MTP_SERVE_NO_LANES"] = "1"
    try:
        model, text = quantized_model(shape, int(body))
    finally:
        del os.environ["MTP_SERVE_NO_LANES"]
    quantized_layers.repack_lanes([m for root in (model.model, model.head) if root is not None
                                   for _, m in root.named_modules()], keep_original=True)
    return model, text


def window_seconds(model, context: int, forms, Ts, reps: int) -> dict:
    """form -> {"plain": median s of a plain step, "kernel": median s of it inside the quantized kernel,
    T: median s of a T-token window (capture on) and its commit}, after a prompt of `context` tokens;
    the forms alternate inside each repetition, in reverse order every other one, so other processes'
    load and the order hit them alike (the first repetition is a warm-up)."""
    cache = prefilled_cache(model, context)

    def timed(T: int) -> float:
        kernel[0] = qmm_ext.seconds()
        t = time_window(model, cache, T, pc)
        kernel[0] = qmm_ext.seconds() - kernel[0]
        return t

    kernel = [0.0]
    times = {form: {k: [] for k in ("plain", "kernel", *Ts)} for form in forms}
    for rep in range(reps + 1):
        for form in (forms if rep % 2 == 0 else forms[::-1]):
            use_forms(form)
            row = {"plain": timed(1), "kernel": kernel[0], **{T: timed(T) for T in Ts}}
            if rep:
                for k, v in row.items():
                    times[form][k].append(v)
    use_forms("now")
    return {form: {k: statistics.median(v) for k, v in t.items()} for form, t in times.items()}


def mlp_rate(model, Ts) -> dict:
    """T -> multiply-adds per second of layer 0's MLP projections over T rows (whatever kernel takes them)."""
    layer = model.text.model.layers[0]
    mlp = layer.mlp
    projs = [p for p in (getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")) if p is not None]
    if not projs:  # MoE: the shared expert
        mlp = mlp.shared_expert
        projs = [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    H = model.text.args.hidden_size
    out = {}
    for T in Ts:
        xs = [mx.random.normal((1, T, H)), mx.random.normal((1, T, _in(projs[2])))]
        mx.eval(xs)
        macs = T * sum(_in(p) * _out(p) for p in projs)
        s = median_seconds(lambda: mx.eval(projs[0](xs[0]), projs[1](xs[0]), projs[2](xs[1])), 7)
        out[T] = macs / s
    return out


def _in(p) -> int:
    bits = getattr(p, "bits", None)
    return p.weight.shape[1] * 32 // bits if bits else p.weight.shape[1]


def _out(p) -> int:
    return p.weight.shape[0]


def run(shape: str, body: str, args, bandwidth: float, peak: float) -> None:
    t0 = pc()
    model, text = build(shape, body, both_layouts=any(f not in ("now", "vnni", "noprefetch") for f in args.forms))
    calibrate_blas_threads(model, Tok())
    print(f"[{shape} {body}] built and calibrated in {pc() - t0:.0f}s (skinny sgemm on: {skinny_gemm.enabled()})",
          flush=True)
    for ctx in args.contexts:
        costs, steps = {}, {}
        for form, med in window_seconds(model, ctx or PROMPT_AT_ZERO, args.forms, args.windows, args.reps).items():
            step = steps[form] = med["plain"]
            costs[form] = {T: med[T] / step for T in args.windows}
            wins = "  ".join(f"T={T}: {c:5.2f}" for T, c in costs[form].items())
            print(f"  context {ctx:>6}, {form:>6} kernels: plain step {1e3 * step:7.1f} ms "
                  f"(quantized kernel {1e3 * med['kernel']:.1f}) "
                  f"({bytes_per_step(model, text) / step / 1e9:5.1f} GB/s, stream {bandwidth / 1e9:.1f})   "
                  f"window in plain steps  {wins}", flush=True)
        if len(costs) == 2:
            a, b = args.forms
            print(f"  context {ctx:>6}, {a} / {b}: "
                  + "  ".join(f"T={T}: {costs[a][T] / costs[b][T]:5.2f}" for T in args.windows), flush=True)
            print(f"  context {ctx:>6}, plain step {a} / {b}: {steps[a] / steps[b]:5.2f}", flush=True)
    for form in args.forms:
        use_forms(form)
        rates = mlp_rate(model, args.windows)
        print(f"  {form:>6} kernels, MLP products, multiply-adds/s (share of peak {peak / 1e9:.0f} G): "
              + "  ".join(f"T={T}: {r / 1e9:5.1f} G ({r / peak:4.0%})" for T, r in rates.items()), flush=True)
    use_forms("now")
    del model
    gc.collect()
    mx.clear_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["0.8b", "2b"], choices=["0.8b", "2b", "4b", "a3b"])
    ap.add_argument("--bodies", nargs="+", default=["fp32", "8", "4"], choices=["fp32", "8", "4"])
    ap.add_argument("--windows", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--contexts", nargs="+", type=int, default=[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--forms", nargs="+", default=["now"], choices=["now", "before", "block", "group", "vnni", "noprefetch"],
                    help="before / block / group / vnni / noprefetch: windows on the kernels' other forms too, side by side (use_forms)")
    args = ap.parse_args()
    load = os.getloadavg()
    bandwidth = stream_bandwidth()
    peak = peak_fma_per_s()
    print(f"load average {load[0]:.2f}; stream {bandwidth / 1e9:.1f} GB/s; peak {peak / 1e9:.0f} G multiply-adds/s "
          f"({os.cpu_count()} cores)", flush=True)
    for shape in args.shapes:
        for body in args.bodies:
            if shape == "a3b" and body == "fp32":
                continue
            run(shape, body, args, bandwidth, peak)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

"""The int8 group form's products alone: weights repacked at load into the lane layout against the
checkpoint's layout (each block of W transposed and unpacked per call), alternated in one process.

    python bench/bench_lanes.py [--bits 4 8] [--rows 1 4 8 16 32] [--threads 1] [--isa avx512-vnni avx-vnni avx2]
    python bench/bench_lanes.py --amx            # the lanes on AVX-512 VNNI against the lanes on AMX tiles

Qwen3.5-0.8B's and 2B's product shapes (group size 64, bf16 scales, as `mlx_lm convert -q`), random
weights; CPU time of the process (one thread by default, so other processes' load costs less), the
fastest of `--reps`, both forms alternating inside each repetition. The lane form gives each row the
group form's bits (tests/test_quantized_lanes.py); this measures what skipping the per-call unpacking buys.
With `--amx`, both forms are the lanes: vpdpbusd's integer sums (AMX off) -> AMX's tile dot products
(windows of 2+ rows; the same bits), where the CPU has AMX.
"""

from __future__ import annotations

import argparse
import os
import time

import common  # noqa: F401  (backend set-up before mlx.core)

import mlx.core as mx

from mtp_serve import quantized_matmul as qmm_ext

SHAPES = {  # name: (N, K)
    "0.8b mlp up": (3584, 1024),
    "0.8b mlp down": (1024, 3584),
    "0.8b gdn in": (6144, 1024),
    "0.8b lm head": (248320, 1024),
    "2b mlp up": (6144, 2048),
    "2b mlp down": (2048, 6144),
}


def isa_setting(ext, isa: str) -> bool:
    """Select the instruction set; False where this CPU lacks it."""
    if isa == "avx512-vnni" and not ext.vnni_supported() or isa == "avx-vnni" and not ext.avx_vnni_supported():
        return False
    ext.set_vnni(isa == "avx512-vnni")
    ext.set_avx_vnni(isa == "avx-vnni")
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", nargs="+", type=int, default=[4, 8], choices=[4, 8])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8, 16, 32])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--isa", nargs="+", default=["avx512-vnni"], choices=["avx512-vnni", "avx-vnni", "avx2"])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--amx", action="store_true", help="the lanes without AMX -> with AMX (instead of checkpoint -> lanes)")
    args = ap.parse_args()
    ext = qmm_ext.load()
    if ext is None:
        raise SystemExit(qmm_ext.status())
    qmm_ext.set_numerics("int8")
    ext.set_threads(args.threads)
    if args.amx and not (hasattr(ext, "amx_supported") and ext.amx_supported()):
        raise SystemExit("--amx: no AMX on this CPU (or the kernel did not grant its tile state)")
    amx_was = args.amx and ext.amx()
    print(f"load average {os.getloadavg()[0]:.2f}; {args.threads} thread(s); CPU ms per product, "
          + ("lanes without -> with AMX" if args.amx else "checkpoint layout -> lanes") + " (ratio)", flush=True)

    def first(x, w, s, b, lanes, bits):
        if not args.amx:
            return qmm_ext.qmm(x, w, s, b, 64, bits)
        ext.set_amx(False)
        try:
            out = qmm_ext.qmm_lanes(x, [lanes], 64, bits)[0]
            mx.eval(out)  # (while AMX is off)
            return out
        finally:
            ext.set_amx(True)

    def cpu_ms(f) -> float:
        t0 = time.process_time()
        mx.eval(f())
        return (time.process_time() - t0) * 1e3

    for isa in args.isa:
        if not isa_setting(ext, isa):
            print(f"{isa}: not on this CPU")
            continue
        for bits in args.bits:
            for name in args.shapes:
                N, K = SHAPES[name]
                w, s, b = mx.quantize(mx.random.normal((N, K)) * 0.05, group_size=64, bits=bits)
                s, b = s.astype(mx.bfloat16), b.astype(mx.bfloat16)
                lanes = (qmm_ext.to_lanes(w), qmm_ext.to_lanes(s), qmm_ext.to_lanes(b), N)
                mx.eval(w, s, b, lanes[:3])
                cells = []
                for M in args.rows:
                    x = mx.random.normal((M, K))
                    mx.eval(x)
                    group, lane = [], []
                    for _ in range(args.reps):
                        group.append(cpu_ms(lambda: first(x, w, s, b, lanes, bits)))
                        lane.append(cpu_ms(lambda: qmm_ext.qmm_lanes(x, [lanes], 64, bits)[0]))
                    g, l = min(group), min(lane)
                    cells.append(f"T={M} {g:.3f} -> {l:.3f} ({l / g:.2f})")
                print(f"{isa}, {bits}-bit {name} {N} x {K}: " + "  ".join(cells), flush=True)
                del w, s, b, lanes
    if args.amx:
        ext.set_amx(amx_was)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

"""Which operations of a verify window give a row the bits it gets alone, on this device.

    python bench/row_invariance.py [--dtypes float32 bfloat16] [--rows 2 3 4 5 8]

Greedy MTP is plain decoding token for token only if every operation of a T-token verify
window computes each position exactly as a single step would. For each operation (MLX's
quantized and plain matmuls, gathered experts, causal attention, norms, the depthwise conv,
the GatedDeltaNet recurrence of a window), this computes M rows at once and each row
alone and prints, per M, "ok" or the rows whose bits differ and by how much. On CPU,
mtp-serve's own kernels take the decode products (`tests/test_quantized_matmul.py`); this
script calls MLX's, which is what runs on a GPU backend (docs/quantized.md, "MLX's CUDA backend").
"""

from __future__ import annotations

import argparse
from typing import Callable

from common import pc  # noqa: F401,I001  (first: backend set-up before mlx.core)

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import gated_delta_update

from mtp_serve.models import activations
from mtp_serve.models.gdn import gated_delta_steps
from mtp_serve.models.mlx_lm_compat import compute_g


def check(name: str, rows: list, together: Callable, alone: Callable) -> None:
    """together(M): M rows at once (first axis); alone(M, i): row i computed by itself."""
    res = []
    for M in rows:
        many = together(M)
        ones = [alone(M, i) for i in range(M)]
        mx.eval(many, ones)
        bad = [i for i in range(M) if not mx.array_equal(many[i], ones[i]).item()]
        diff = max(mx.abs(many[i].astype(mx.float32) - ones[i].astype(mx.float32)).max().item() for i in range(M))
        res.append(f"M={M} " + ("ok" if not bad else f"differ (rows {bad}, max {diff:.1e})"))
    print(f"{name}: " + ", ".join(res), flush=True)


def products(dt: mx.Dtype, rows: list) -> None:
    n = max(rows)
    for bits in (4, 8):
        for N, K in ((2048, 2048), (6144, 2048), (248320, 1024)):
            w, s, b = mx.quantize((0.05 * mx.random.normal((N, K))).astype(dt), group_size=64, bits=bits)
            X = mx.random.normal((n, K)).astype(dt)
            mx.eval(w, s, b, X)
            qm = lambda x: mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=bits)  # noqa: E731
            check(f"quantized_matmul {dt} {bits}-bit {N}x{K}", rows, lambda M: qm(X[:M]), lambda M, i: qm(X[i:i + 1])[0])
    for N, K in ((2048, 2048), (6144, 2048)):
        W, X = mx.random.normal((N, K)).astype(dt), mx.random.normal((n, K)).astype(dt)
        mx.eval(W, X)
        check(f"matmul {dt} {N}x{K}", rows, lambda M: X[:M] @ W.T, lambda M, i: (X[i:i + 1] @ W.T)[0])
    E, N, K = 64, 512, 2048  # 8 routed experts a token, each token its own
    w, s, b = mx.quantize((0.05 * mx.random.normal((E, N, K))).astype(dt), group_size=64, bits=4)
    X, idx = mx.random.normal((n, 1, 1, K)).astype(dt), mx.random.randint(0, E, (n, 8)).astype(mx.uint32)
    mx.eval(w, s, b, X, idx)
    gq = lambda x, ix: mx.gather_qmm(x, w, s, b, rhs_indices=ix, transpose=True, group_size=64, bits=4)  # noqa: E731
    check(f"gather_qmm {dt} 4-bit", rows, lambda M: gq(X[:M], idx[:M]), lambda M, i: gq(X[i:i + 1], idx[i:i + 1])[0])


def attention_and_norms(dt: mx.Dtype, rows: list) -> None:
    n, H, Hkv, D, L = max(rows), 16, 2, 256, 40  # L cached keys, then the window's queries
    q = mx.random.normal((1, H, n, D)).astype(dt)
    k, v = (mx.random.normal((1, Hkv, L + n, D)).astype(dt) for _ in range(2))
    mx.eval(q, k, v)
    sd = lambda qq, m, mask: mx.fast.scaled_dot_product_attention(  # noqa: E731
        qq, k[:, :, :m], v[:, :, :m], scale=D**-0.5, mask=mask)
    check(f"causal attention {dt}", rows, lambda M: sd(q[:, :, :M], L + M, "causal")[0].transpose(1, 0, 2),
          lambda M, i: sd(q[:, :, i:i + 1], L + i + 1, None)[0, :, 0])
    x, wn = mx.random.normal((n, 2048)).astype(dt), mx.random.normal((2048,)).astype(dt)
    logits = mx.random.normal((n, 248320)).astype(dt)
    mx.eval(x, wn, logits)
    check(f"rms_norm {dt}", rows, lambda M: mx.fast.rms_norm(x[:M], wn, 1e-6), lambda M, i: mx.fast.rms_norm(x[i:i + 1], wn, 1e-6)[0])
    check(f"logsumexp {dt}", rows, lambda M: mx.logsumexp(logits[:M], axis=-1), lambda M, i: mx.logsumexp(logits[i:i + 1], axis=-1)[0])


def gated_delta(rows: list) -> None:
    """A window's conv and recurrence against the single steps plain decoding runs."""
    n, C, KS = max(rows), 6144, 4
    conv = nn.Conv1d(C, C, KS, groups=C, bias=False)
    x = mx.random.normal((1, KS - 1 + n, C))
    mx.eval(conv.parameters(), x)
    check("depthwise conv (MLX's conv1d)", rows, lambda M: conv(x[:, :KS - 1 + M])[0], lambda M, i: conv(x[:, i:i + KS])[0, 0])
    check("depthwise conv (shifted multiply-adds: mtp-serve's decode conv)", rows,
          lambda M: activations.depthwise_conv(x[:, :KS - 1 + M], conv.weight)[0],
          lambda M, i: activations.depthwise_conv(x[:, i:i + KS], conv.weight)[0, 0])
    B, Hk, Hv, D = 1, 16, 32, 128
    q, k = (0.1 * mx.random.normal((B, n, Hk, D)) for _ in range(2))
    v, a, b = mx.random.normal((B, n, Hv, D)), mx.random.normal((B, n, Hv)), mx.random.normal((B, n, Hv))
    A_log, dt_bias, s0 = mx.random.normal((Hv,)), mx.random.normal((Hv,)), 0.1 * mx.random.normal((B, Hv, D, D))
    mx.eval(q, k, v, a, b, A_log, dt_bias, s0)
    g, beta = compute_g(A_log, a, dt_bias), mx.sigmoid(b)

    def step(i: int) -> mx.array:  # plain decoding: one token at a time from s0
        st = s0
        for j in range(i + 1):
            y, st = gated_delta_update(q[:, j:j + 1], k[:, j:j + 1], v[:, j:j + 1], a[:, j:j + 1], b[:, j:j + 1],
                                       A_log, dt_bias, st, None)
        return y[0, 0]

    check("GatedDeltaNet window by steps (mtp-serve's off the native kernel)", rows,
          lambda M: gated_delta_steps(q[:, :M], k[:, :M], v[:, :M], g[:, :M], beta[:, :M], s0, None)[0][0],
          lambda M, i: step(i))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 3, 4, 5, 8])
    args = ap.parse_args()
    print(f"MLX {mx.__version__} on {mx.default_device()}", flush=True)
    mx.random.seed(0)
    gated_delta(args.rows)
    for name in args.dtypes:
        dt = getattr(mx, name)
        attention_and_norms(dt, args.rows)
        products(dt, args.rows)


if __name__ == "__main__":
    main()

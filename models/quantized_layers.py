"""Quantized layers whose decode-sized products run on mtp-serve's CPU kernel.

After loading, every affine-quantized `nn.QuantizedLinear`, `nn.QuantizedEmbedding`
(its `as_linear`: a tied LM head) and mlx-lm `QuantizedSwitchLinear` (MoE experts,
`gather_qmm`) of the model and its MTP head is switched to the subclass below
(a class swap, as `gdn.py` does: the weights and the module tree stay as mlx-lm
built them). Inputs of at most `MAX_ROWS` rows go to `mtp_serve.quantized_matmul`,
which reads each packed weight once for all rows and gives every row the same
bits whatever the rows beside it (verify windows score like plain steps).

Larger dense inputs (prefill) dequantize the weight to fp32 for the call and take
the fp32 matmul: MLX 0.32's CPU `quantized_matmul` costs about T times its
one-row cost (1.8 s for 512 rows of a 3584 x 1024 4-bit product, against 29 ms
dequantized; bench/bench_quantized.py). Nothing fp32 stays resident: the weight is
dequantized per call, in slices of at most `DEQUANT_SLICE` elements. Gathered
experts beyond the kernel's rows and anything the kernel does not take go to MLX
as before. Works inside mx.compile (the kernel is an MLX primitive).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator, List

import mlx.core as mx
import mlx.nn as nn

from mtp_serve import quantized_matmul as qmm_ext
from mtp_serve.backend import SMALL_MATMUL_ROWS

from .mlx_lm_compat import QuantizedSwitchLinear

# Tokens per product through the kernel: decode steps, verify windows and drafts of a
# batch (the fp32 path's decode threshold). Prefill keeps MLX's kernel.
MAX_ROWS = SMALL_MATMUL_ROWS
# MoE: (token, expert) rows of a gathered product, e.g. 64 tokens with 16 experts each.
MAX_GATHERED_ROWS = 16 * MAX_ROWS
# Largest fp32 slice of a weight a prefill product dequantizes at once (64 MB).
DEQUANT_SLICE = 1 << 24


def _rows(x: mx.array) -> int:
    n = 1
    for d in x.shape[:-1]:
        n *= d
    return n


def _affine(layer: nn.Module, x: mx.array) -> bool:
    return (getattr(layer, "mode", "affine") == "affine" and mx.issubdtype(x.dtype, mx.floating)
            and layer.get("biases") is not None)


def dequantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                       bits: int) -> mx.array:
    """x @ dequantize(w).T in fp32 (prefill-sized x), the weight dequantized per call in slices of rows."""
    N, K = w.shape[0], x.shape[-1]
    xf = x if x.dtype == mx.float32 else x.astype(mx.float32)
    step = max(1, DEQUANT_SLICE // K)
    parts = []
    if scales.dtype != mx.float32:  # dequantized in fp32: bf16 scales would give bf16 weights
        scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
    for n in range(0, N, step):
        wf = mx.dequantize(w[n:n + step], scales[n:n + step], biases[n:n + step], group_size=group_size, bits=bits)
        parts.append(xf @ wf.T)
    y = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    return y if x.dtype == mx.float32 else y.astype(x.dtype)


def _takes(layer: nn.Module, x: mx.array, rows: int, limit: int = MAX_ROWS) -> bool:
    return (rows <= limit and mx.issubdtype(x.dtype, mx.floating)
            and qmm_ext.supports(layer.bits, layer.group_size, getattr(layer, "mode", "affine"), x.shape[-1],
                                 layer["scales"].dtype)
            and layer.get("biases") is not None)


class DecodeQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        if _takes(self, x, _rows(x)):
            y = qmm_ext.qmm(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits)
        elif _affine(self, x):
            y = dequantized_matmul(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits)
        else:
            return super().__call__(x)
        if "bias" in self:
            y = y + self["bias"]
        return y


def project(x: mx.array, layers: List[nn.Module]) -> List[mx.array]:
    """`[layer(x) for layer in layers]`, as one kernel call where every layer is a kernel-sized
    `DecodeQuantizedLinear` of one group size, bits and scale dtype without a bias (a
    GatedDeltaNet's four input projections, an attention's q/k/v, an MLP's gate and up)."""
    first = layers[0]
    rows = _rows(x)
    if len(layers) > 1 and all(
        type(l) is DecodeQuantizedLinear and "bias" not in l and _takes(l, x, rows)
        and (l.group_size, l.bits, l["scales"].dtype) == (first.group_size, first.bits, first["scales"].dtype)
        for l in layers
    ):
        return qmm_ext.qmm_multi(x, [(l["weight"], l["scales"], l["biases"]) for l in layers], first.group_size,
                                 first.bits)
    return [layer(x) for layer in layers]


class DecodeQuantizedEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x: mx.array) -> mx.array:
        if _takes(self, x, _rows(x)):
            return qmm_ext.qmm(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits)
        if _affine(self, x):
            return dequantized_matmul(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits)
        return super().as_linear(x)


class DecodeQuantizedSwitchLinear(QuantizedSwitchLinear):
    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        pairs = 1
        for d in qmm_ext._broadcast_shapes(tuple(x.shape[:-2]), tuple(indices.shape)):
            pairs *= d
        if getattr(self, "global_scale", None) is not None or not _takes(self, x, pairs * x.shape[-2], MAX_GATHERED_ROWS):
            return super().__call__(x, indices, sorted_indices)
        y = qmm_ext.gather_qmm(x, self["weight"], self["scales"], self["biases"], indices, self.group_size, self.bits)
        if "bias" in self:
            y = y + mx.expand_dims(self["bias"][indices], -2)
        return y


_SWAPS = (
    (nn.QuantizedLinear, DecodeQuantizedLinear),
    (nn.QuantizedEmbedding, DecodeQuantizedEmbedding),
    (QuantizedSwitchLinear, DecodeQuantizedSwitchLinear),
)

KERNEL_LAYERS = tuple(sub for _, sub in _SWAPS)


def install_decode_qmm(modules: Iterable[nn.Module]) -> int:
    """Switch the quantized layers under `modules` to the kernel's subclasses (when the
    kernel is available: builds it at the first quantized model); the number switched."""
    layers = [m for root in modules if root is not None for _, m in root.named_modules()
              if any(type(m) is base for base, _ in _SWAPS)]
    if not layers or qmm_ext.load() is None:
        return 0
    swapped = 0
    for m in layers:  # a module shared by model and head is listed twice
        sub = next((sub for base, sub in _SWAPS if type(m) is base), None)
        if sub is not None:
            m.__class__ = sub
            swapped += 1
    return swapped


@contextmanager
def use_kernel(modules: Iterable[nn.Module], on: bool) -> Iterator[None]:
    """Inside the block the switched layers are (on=False) or are not (on=True) MLX's own
    classes again (benchmarks compare with mlx-lm on the same model; already compiled
    steps keep what they traced)."""
    modules = [m for m in modules if m is not None]
    pairs = [(base, sub) if not on else (sub, base) for base, sub in _SWAPS]
    switched = []
    for root in modules:
        for _, m in root.named_modules():
            to = next((a for a, b in pairs if type(m) is b), None)
            if to is not None:
                switched.append((m, type(m)))
                m.__class__ = to
    try:
        yield
    finally:
        for m, cls in switched:
            m.__class__ = cls


def quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases, group_size: int, bits: int,
                     mode: str = "affine") -> mx.array:
    """`mx.quantized_matmul(..., transpose=True)`, on the kernel where it takes the product
    (prefill-sized x: dequantized, when the kernel is loaded)."""
    if (biases is not None and mode == "affine" and mx.issubdtype(x.dtype, mx.floating)
            and qmm_ext.supports(bits, group_size, mode, x.shape[-1], scales.dtype)):
        if _rows(x) <= MAX_ROWS:
            return qmm_ext.qmm(x, w, scales, biases, group_size, bits)
        return dequantized_matmul(x, w, scales, biases, group_size, bits)
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits, mode=mode)

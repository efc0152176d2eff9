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

With int8 numerics the dense layers' and embeddings' 4- and 8-bit weights are repacked once
at install into the kernel's lane layout (`repack_lanes`; mtp_serve/native/qmm_lanes.inc),
which replaces the packed weight, scales and biases: no per-call transpose or unpacking, and
the same bits. What still wants the original layout derives it from the lanes: a prefill
product its slices of rows, an embedding lookup its rows, `rows_of` (draft vocabularies)
its rows, anything reading `.weight` the whole array (lazily: a shape read costs nothing).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterable, Iterator, List, Optional, Tuple

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


# The lane layout's arrays, in place of the packed originals (their module keys: LANE_KEYS[name]).
PACKED = ("weight", "scales", "biases")
LANE_KEYS = {k: f"{k}_lanes" for k in PACKED}
# Benchmarks: False computes layers that kept their originals (repack_lanes(keep_original=True)) on them.
_use_lanes = True


def set_lanes(on: bool) -> None:
    """Whether layers holding both layouts compute on the lanes (benchmarks compare the two)."""
    global _use_lanes
    _use_lanes = on


def _lanes(layer: nn.Module) -> bool:
    return "weight_lanes" in layer and (_use_lanes or "weight" not in layer)


def packed(layer: nn.Module, n0: int = 0, n1: Optional[int] = None) -> Tuple[mx.array, mx.array, Optional[mx.array]]:
    """Rows [n0, n1) of the layer's weight, scales and biases in MLX's packed layout (derived from the
    lanes where only those are kept)."""
    if "weight" in layer:
        n1 = layer["weight"].shape[0] if n1 is None else n1
        b = layer.get("biases")
        return layer["weight"][n0:n1], layer["scales"][n0:n1], b[n0:n1] if b is not None else None
    n1 = layer.lane_rows if n1 is None else n1
    return tuple(qmm_ext.from_lanes(layer[LANE_KEYS[k]], n0, n1) for k in PACKED)


def rows_of(layer: nn.Module, ids: mx.array) -> Tuple[mx.array, mx.array, Optional[mx.array]]:
    """The layer's weight, scales and biases at rows `ids`, in MLX's packed layout."""
    if "weight" in layer:
        b = layer.get("biases")
        return layer["weight"][ids], layer["scales"][ids], b[ids] if b is not None else None
    return tuple(qmm_ext.take_lanes(layer[LANE_KEYS[k]], ids) for k in PACKED)


def _scales_dtype(layer: nn.Module) -> mx.Dtype:
    return (layer["scales"] if "scales" in layer else layer["scales_lanes"]).dtype


def _has_biases(layer: nn.Module) -> bool:
    return layer.get("biases") is not None or "biases_lanes" in layer


def _rows(x: mx.array) -> int:
    n = 1
    for d in x.shape[:-1]:
        n *= d
    return n


def _affine(layer: nn.Module, x: mx.array) -> bool:
    return (getattr(layer, "mode", "affine") == "affine" and mx.issubdtype(x.dtype, mx.floating)
            and _has_biases(layer))


def dequantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                       bits: int) -> mx.array:
    """x @ dequantize(w).T in fp32 (prefill-sized x), the weight dequantized per call in slices of rows."""
    return _dequantized(x, w.shape[0], lambda n0, n1: (w[n0:n1], scales[n0:n1], biases[n0:n1]), group_size, bits)


def _dequantized(x: mx.array, N: int, rows, group_size: int, bits: int) -> mx.array:
    """dequantized_matmul over a weight whose rows [n0, n1) `rows(n0, n1)` gives as (w, scales, biases)."""
    K = x.shape[-1]
    xf = x if x.dtype == mx.float32 else x.astype(mx.float32)
    step = max(1, DEQUANT_SLICE // K)
    parts = []
    for n in range(0, N, step):
        w, scales, biases = rows(n, min(N, n + step))
        if scales.dtype != mx.float32:  # dequantized in fp32: bf16 scales would give bf16 weights
            scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
        wf = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits)
        parts.append(xf @ wf.T)
    y = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    return y if x.dtype == mx.float32 else y.astype(x.dtype)


def _takes(layer: nn.Module, x: mx.array, rows: int, limit: int = MAX_ROWS) -> bool:
    return (rows <= limit and mx.issubdtype(x.dtype, mx.floating)
            and qmm_ext.supports(layer.bits, layer.group_size, getattr(layer, "mode", "affine"), x.shape[-1],
                                 _scales_dtype(layer))
            and _has_biases(layer))


def _on_lanes(layer: nn.Module) -> bool:
    """The layer's kernel products run on its lanes (int8 numerics; exact ones derive the original)."""
    return _lanes(layer) and qmm_ext.numerics() == "int8"


def _lane_product(layer: nn.Module) -> tuple:
    return layer["weight_lanes"], layer["scales_lanes"], layer["biases_lanes"], layer.lane_rows


def _kernel(layer: nn.Module, x: mx.array) -> mx.array:
    """The layer's product on the kernel (x of at most MAX_ROWS rows)."""
    if _on_lanes(layer):
        return qmm_ext.qmm_lanes(x, [_lane_product(layer)], layer.group_size, layer.bits)[0]
    return qmm_ext.qmm(x, *packed(layer), layer.group_size, layer.bits)


def _prefill(layer: nn.Module, x: mx.array) -> mx.array:
    """The layer's product dequantized in slices (prefill-sized x), from either layout: the same bits."""
    N = layer.lane_rows if "weight" not in layer else layer["weight"].shape[0]
    return _dequantized(x, N, lambda n0, n1: packed(layer, n0, n1), layer.group_size, layer.bits)


class _Lanes:
    """`.weight`, `.scales`, `.biases` of a layer repacked to lanes: the original arrays, derived
    (lazily: mlx-lm and shape reads see what they expect; evaluating one materializes a copy)."""

    def __getattr__(self, key: str):
        if key in PACKED and "weight_lanes" in self and key not in self:
            return packed(self)[PACKED.index(key)]
        return super().__getattr__(key)


class DecodeQuantizedLinear(_Lanes, nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        if _takes(self, x, _rows(x)):
            y = _kernel(self, x)
        elif _affine(self, x):
            y = _prefill(self, x)
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
        and (l.group_size, l.bits, _scales_dtype(l)) == (first.group_size, first.bits, _scales_dtype(first))
        for l in layers
    ):
        int8 = qmm_ext.numerics() == "int8"  # once: it costs tens of microseconds a call
        lanes = [int8 and _lanes(l) for l in layers]
        if all(lanes):
            return qmm_ext.qmm_lanes(x, [_lane_product(l) for l in layers], first.group_size, first.bits)
        if not any(lanes):
            return qmm_ext.qmm_multi(x, [packed(l) for l in layers], first.group_size, first.bits)
    return [layer(x) for layer in layers]


class DecodeQuantizedEmbedding(_Lanes, nn.QuantizedEmbedding):
    def __call__(self, x: mx.array) -> mx.array:
        if "weight" in self:
            return super().__call__(x)
        w, scales, biases = rows_of(self, x)  # nn.QuantizedEmbedding's lookup, on the derived rows
        return mx.dequantize(w, scales=scales, biases=biases, group_size=self.group_size, bits=self.bits,
                             mode=self.mode)

    def as_linear(self, x: mx.array) -> mx.array:
        if _takes(self, x, _rows(x)):
            return _kernel(self, x)
        if _affine(self, x):
            return _prefill(self, x)
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
    if os.environ.get("MTP_SERVE_NO_LANES") != "1" and qmm_ext.numerics() == "int8":
        repack_lanes(layers)
    return swapped


def repack_lanes(layers: Iterable[nn.Module], keep_original: bool = False) -> int:
    """Repack the dense layers' and embeddings' 4- and 8-bit weights (scales, biases) to the kernel's lane
    layout, in place of the originals (`keep_original`: beside them, for benchmarks); the number repacked.
    One layer at a time, so the load's peak is one layer's extra copy."""
    done = 0
    for m in layers:
        if (type(m) not in (DecodeQuantizedLinear, DecodeQuantizedEmbedding) or "weight" not in m
                or "weight_lanes" in m or getattr(m, "mode", "affine") != "affine" or m.get("biases") is None
                or m["weight"].ndim != 2 or not qmm_ext.lanes_supported(m.bits)
                or not qmm_ext.supports(m.bits, m.group_size, "affine", m["weight"].shape[1] * 32 // m.bits,
                                        m["scales"].dtype)):
            continue
        m.lane_rows = m["weight"].shape[0]
        for k in PACKED:
            m[LANE_KEYS[k]] = qmm_ext.to_lanes(m[k])
            if not keep_original:
                del m[k]
        mx.eval([m[LANE_KEYS[k]] for k in PACKED])
        done += 1
    return done


@contextmanager
def use_kernel(modules: Iterable[nn.Module], on: bool) -> Iterator[None]:
    """Inside the block the switched layers are (on=False) or are not (on=True) MLX's own
    classes again (benchmarks compare with mlx-lm on the same model; already compiled
    steps keep what they traced)."""
    modules = [m for m in modules if m is not None]
    pairs = [(base, sub) if not on else (sub, base) for base, sub in _SWAPS]
    switched, derived = [], []
    for root in modules:
        for _, m in root.named_modules():
            to = next((a for a, b in pairs if type(m) is b), None)
            if to is not None:
                if not on and "weight" not in m and "weight_lanes" in m:  # MLX's class reads the original layout
                    for k, v in zip(PACKED, packed(m)):
                        m[k] = v
                    derived.append(m)
                switched.append((m, type(m)))
                m.__class__ = to
    try:
        yield
    finally:
        for m, cls in switched:
            m.__class__ = cls
        for m in derived:
            for k in PACKED:
                del m[k]


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

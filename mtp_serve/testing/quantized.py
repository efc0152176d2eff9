"""Quantized synthetic models for tests and benchmarks: a loaded model's body (and
head) quantized in memory the way `mlx_lm convert -q` quantizes a checkpoint
(mlx-lm's `quantize_model` with the model's own predicate), then switched to the
decode kernel as `load_model` does for a quantized checkpoint."""

from __future__ import annotations

import contextlib
import io

import mlx.core as mx
import mlx.nn as nn

# Dims that every quantized product of the synthetic families can take at 4 and 8 bits
# with group sizes up to 64 (the kernel needs K a multiple of 64 at 4 bits).
QUANT_TEXT = dict(hidden_size=128, intermediate_size=256, head_dim=32, linear_value_head_dim=32,
                  linear_key_head_dim=32, moe_intermediate_size=64, shared_expert_intermediate_size=64)


def quantize_mlx_lm_model(model: nn.Module, bits: int, group_size: int) -> nn.Module:
    """mlx-lm's own quantization (as `mlx_lm convert -q`), in place; MLX's kernels."""
    from mtp_serve.models.mlx_lm_compat import quantize_model

    with contextlib.redirect_stdout(io.StringIO()):  # it prints bits per weight
        quantize_model(model, {}, group_size, bits)
    return model


def quantize_head(head: nn.Module, bits: int, group_size: int) -> None:
    nn.quantize(head, group_size, bits,
                class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0)


def quantize_loaded(mtp_model, bits: int, group_size: int, head: bool = True, kernel: bool = True) -> int:
    """Quantize a loaded MTPModel's body (and head) in place before its first step;
    with `kernel`, switch its quantized layers to the decode kernel. Returns the
    number of layers switched."""
    from mtp_serve.models.quantized_layers import install_decode_qmm

    quantize_mlx_lm_model(mtp_model.model, bits, group_size)
    if head and mtp_model.head is not None:
        quantize_head(mtp_model.head, bits, group_size)
    mx.eval(mtp_model.model.parameters(), mtp_model.head.parameters() if mtp_model.head is not None else [])
    return install_decode_qmm([mtp_model.model, mtp_model.head]) if kernel else 0

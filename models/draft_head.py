"""The MTP head quantized for drafting: cheap drafts beside a quantized body.

A grafted head is stored unquantized (the graft is lossless), so next to a 4-bit
body its decoder layer alone costs about a tenth of a plain step per draft at
Qwen3.5-0.8B's shapes (at 4 bits: a third of that). Exactness does not depend on the head's precision (the
verify pass decides every token), only acceptance does, so the head may draft
from a quantized copy: `draft_head_bits` in the model's `mtp_serve.json` (which
`mtp-tune` writes after measuring acceptance against the unquantized head).

Quantization is mlx-lm's affine form with the body's group size, every product
whose input width the group divides; the products then run on mtp-serve's
decode kernel, as the body's do.
"""

from __future__ import annotations

import copy
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from .quantized_layers import install_decode_qmm

HEAD_BITS = (4, 8)
DEFAULT_GROUP_SIZE = 64


def head_is_quantized(head: nn.Module) -> bool:
    return any(isinstance(m, nn.QuantizedLinear) or hasattr(m, "scales") for _, m in head.named_modules())


def group_size_of(quantization: Optional[dict]) -> int:
    """The body's affine group size (64 when the body is unquantized or in another mode)."""
    if quantization and quantization.get("mode", "affine") == "affine" and quantization.get("group_size"):
        return int(quantization["group_size"])
    return DEFAULT_GROUP_SIZE


def quantized_head(head: nn.Module, bits: int, group_size: int = DEFAULT_GROUP_SIZE) -> nn.Module:
    """A copy of `head` with its products quantized to `bits` (the original is left as is)."""
    if bits not in HEAD_BITS:
        raise ValueError(f"draft head bits must be one of {HEAD_BITS} (0: unquantized), got {bits}")
    q = copy.deepcopy(head)
    nn.quantize(q, group_size, bits,
                class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0)
    mx.eval(q.parameters())
    install_decode_qmm([q])  # decode-sized products on mtp-serve's kernel where it is built
    return q

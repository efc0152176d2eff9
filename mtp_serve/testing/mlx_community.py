"""Rewrite a raw Hugging Face `qwen4_exp` checkpoint in the layout mlx-lm's main-branch model
writes (what mlx-community conversions hold), full precision or quantized, so tests load that
layout through the real loader.

That layout: the text model under `model.*` (not `model.language_model.*`), `lm_head` at the
top, norms left zero-centred, experts stacked as `switch_mlp.{gate,up,down}_proj` [E, out, in],
every conv1d as MLX's [C, K, 1], the n-gram hash constants saved as int64 parameters, and no
MTP head or vision tower. Quantized: mlx affine on every Linear / Embedding whose input width
the group size divides, except the MoE router (`mlp.gate`), with `quantization` in config.json.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx

from mtp_serve.models import qwen4_exp
from mtp_serve.models.loader import load_weights

_KEEP_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def mlx_lm_weights(hf: Dict[str, mx.array], config: dict) -> Dict[str, mx.array]:
    """Raw HF tensors -> mlx-lm main's names and shapes (unquantized)."""
    args = qwen4_exp.Qwen4ExpArgs.from_config(config)
    out: Dict[str, mx.array] = {}
    for k, v in hf.items():
        if k.startswith(("mtp.", "model.visual.")):
            continue  # mlx-lm's text-only port drops the head and the tower
        if k.startswith("model.language_model."):
            k = "model." + k[len("model.language_model."):]
        if k.endswith(".mlp.experts.gate_up_proj"):
            p = k[: -len("experts.gate_up_proj")]
            out[p + "switch_mlp.gate_proj.weight"], out[p + "switch_mlp.up_proj.weight"] = mx.split(v, 2, axis=-2)
            continue
        if k.endswith(".mlp.experts.down_proj"):
            out[k[: -len("experts.down_proj")] + "switch_mlp.down_proj.weight"] = v
            continue
        if k.endswith("conv1d.weight") and v.ndim == 3 and v.shape[1] == 1:
            v = v.swapaxes(1, 2)  # [C, 1, K] -> [C, K, 1]
        out[k] = v
    for layer in range(args.num_hidden_layers):
        if layer + 1 not in args.ple_layer_ids:
            continue
        emb = qwen4_exp.NGramEmbedding(args, args.ple_layer_ids.index(layer + 1))
        p = f"model.layers.{layer}.ple.ple_embedding."
        out[p + "layer_multipliers"] = mx.array(emb._mult, dtype=mx.int64)
        out[p + "ngram_heads_vocab_sizes"] = mx.array(emb._sizes, dtype=mx.int64)
        out[p + "ngram_heads_offsets"] = mx.array(emb._offsets, dtype=mx.int64)
    return out


def _quantizable(key: str, v: mx.array, group_size: int) -> bool:
    return (key.endswith(".weight") and v.ndim >= 2 and "conv1d" not in key and not key.endswith(".mlp.gate.weight")
            and v.shape[-1] % group_size == 0)


def quantize_weights(weights: Dict[str, mx.array], bits: int, group_size: int) -> Dict[str, mx.array]:
    out: Dict[str, mx.array] = {}
    for k, v in weights.items():
        if not _quantizable(k, v, group_size):
            out[k] = v
            continue
        p = k[: -len(".weight")]
        out[k], out[p + ".scales"], out[p + ".biases"] = mx.quantize(v, group_size=group_size, bits=bits)
    return out


def write_mlx_community(src: Path, dst: Path, bits: Optional[int] = None, group_size: int = 32) -> Path:
    """Write `src` (raw HF qwen4_exp) to `dst` in mlx-lm main's layout; `bits`: quantize the body."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    weights = mlx_lm_weights(load_weights(src), config)
    if bits:
        weights = quantize_weights(weights, bits, group_size)
        config["quantization"] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for name in _KEEP_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst

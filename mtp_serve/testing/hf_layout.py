"""Write mlx-lm models (plus an MTP head) in the layout the official Hugging Face
checkpoints use: `model.language_model.*` (Qwen3.5/3.6) or `model.*` (Qwen3-Next),
top-level `lm_head` and `mtp.*`, zero-centred norms, unsanitized conv1d
weights [C, 1, K], MoE experts fused (Qwen3.5/3.6 body, Qwen3.6 head) or per
expert (Qwen3-Next, Qwen3.5 head). Used for the demo model and for the
synthetic checkpoints the tests load through the real loader.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

# Norms stored zero-centred in HF checkpoints (mlx-lm adds 1 on load).
_SHIFTED_NORM = re.compile(r"(input_layernorm|post_attention_layernorm|q_norm|k_norm|pre_fc_norm_embedding|pre_fc_norm_hidden)\.weight$|(^|\.)norm\.weight$")


def _unshift_norm(key: str, v: mx.array) -> mx.array:
    if v.ndim == 1 and _SHIFTED_NORM.search(key) and "linear_attn.norm" not in key:
        return v - 1.0
    return v


def _experts_to_hf(prefix: str, params: Dict[str, mx.array], fused: bool) -> Dict[str, mx.array]:
    gate = params.pop(f"{prefix}.switch_mlp.gate_proj.weight")
    up = params.pop(f"{prefix}.switch_mlp.up_proj.weight")
    down = params.pop(f"{prefix}.switch_mlp.down_proj.weight")
    if fused:
        return {f"{prefix}.experts.gate_up_proj": mx.concatenate([gate, up], axis=-2), f"{prefix}.experts.down_proj": down}
    out = {}
    for e in range(gate.shape[0]):
        out[f"{prefix}.experts.{e}.gate_proj.weight"] = gate[e]
        out[f"{prefix}.experts.{e}.up_proj.weight"] = up[e]
        out[f"{prefix}.experts.{e}.down_proj.weight"] = down[e]
    return out


def _to_hf(params: Dict[str, mx.array], fused_experts: bool) -> Dict[str, mx.array]:
    params = dict(params)
    out: Dict[str, mx.array] = {}
    prefixes = sorted({k.split(".switch_mlp.")[0] for k in params if ".switch_mlp." in k})
    for p in prefixes:
        out.update(_experts_to_hf(p, params, fused_experts))
    for k, v in params.items():
        if "conv1d.weight" in k:
            v = v.moveaxis(2, 1)  # [C, K, 1] -> [C, 1, K]
        out[k] = _unshift_norm(k, v)
    return out


def hf_weights(model: nn.Module, head: Optional[nn.Module], model_type: str, mtp_fused_experts: bool = False) -> Dict[str, mx.array]:
    """All tensors of model and head under their HF names."""
    body = dict(tree_flatten(model.parameters()))
    if model_type == "qwen3_next":
        renamed = body
        fused_body = False
    else:
        renamed = {}
        for k, v in body.items():
            if k.startswith("language_model.model."):
                k = "model.language_model." + k[len("language_model.model."):]
            elif k.startswith("language_model."):
                k = k[len("language_model."):]
            renamed[k] = v
        fused_body = True
    weights = _to_hf(renamed, fused_body)
    if head is not None:
        mtp = _to_hf(dict(tree_flatten(head.parameters())), mtp_fused_experts)
        weights.update({f"mtp.{k}": v for k, v in mtp.items()})
    return weights


def save_hf_checkpoint(
    out_dir: Path,
    weights: Dict[str, mx.array],
    config: dict,
    *,
    dtype: mx.Dtype = mx.bfloat16,
    mtp_shard: bool = True,
    max_shard_tensors: Optional[int] = None,
) -> None:
    """Save as safetensors shards plus `model.safetensors.index.json`.

    With `mtp_shard` the head goes to its own `mtp.safetensors` (as Qwen3.6 repos
    ship it). `max_shard_tensors` splits the body across several shards.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {k: (v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) and not k.endswith("A_log") else v) for k, v in weights.items()}
    body = sorted(k for k in weights if not (mtp_shard and k.startswith("mtp.")))
    n = max_shard_tensors or len(body) or 1
    groups = [body[i : i + n] for i in range(0, len(body), n)] or [[]]
    shards = {}
    for i, keys in enumerate(groups):
        shards[f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"] = keys
    if mtp_shard and any(k.startswith("mtp.") for k in weights):
        shards["mtp.safetensors"] = sorted(k for k in weights if k.startswith("mtp."))
    weight_map = {}
    for name, keys in shards.items():
        mx.save_safetensors(str(out_dir / name), {k: weights[k] for k in keys}, metadata={"format": "pt"})
        weight_map.update({k: name for k in keys})
    total = sum(v.nbytes for v in weights.values())
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


def qwen4_exp_hf_weights(model: nn.Module, head: Optional[nn.Module], split_ngram_parts: int) -> Dict[str, mx.array]:
    """A `models.qwen4_exp.Model` (+ head) under the raw HF names transformers' Qwen4Exp
    loads: fused experts, conv weights [C, 1, K], zero-centred norms, each n-gram table in
    `split_ngram_parts` row shards (`ngram_embedding.shard_{i}.weight`)."""
    from mtp_serve.models.qwen4_exp import _SHIFTED

    out: Dict[str, mx.array] = {}
    params = dict(tree_flatten(model.parameters()))
    prefixes = sorted({k.split(".switch_mlp.")[0] for k in params if ".switch_mlp." in k})
    for p in prefixes:
        params.update(_experts_to_hf(p, params, fused=True))
    for k, v in params.items():
        if k.startswith("language_model.model."):
            k = "model.language_model." + k[len("language_model.model."):]
        elif k.startswith("language_model."):
            k = k[len("language_model."):]
        if k.endswith("linear_attn.conv1d.weight"):
            v = v.moveaxis(2, 1)
        elif k.endswith(".ple.conv_weight"):
            k, v = k[: -len("conv_weight")] + "conv1d.weight", v[:, None, :]
        elif _SHIFTED.search(k) and v.ndim == 1:
            v = v - 1.0
        if k.endswith("ngram_embedding.weight"):
            for i, part in enumerate(mx.split(v, split_ngram_parts, axis=0)):
                out[k[: -len("weight")] + f"shard_{i}.weight"] = part
            continue
        out[k] = v
    if head is not None:
        mtp = _to_hf(dict(tree_flatten(head.parameters())), fused_experts=False)
        out.update({f"mtp.{k}": v for k, v in mtp.items()})
    return out

"""`mtp-convert` for qwen4_exp: mlx-lm's converter has no model for it, so the body is
converted here into this project's own layout (models/qwen4_exp.py's names: shards joined,
experts stacked, norms shifted), optionally quantized with MLX's affine quantizer (every
layer whose input width the group size divides, the n-gram tables included), and saved
with the config's `quantization` field as mlx-lm's converter writes it. The head is grafted
afterwards by `mtp-graft`'s own code, as for the other families.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import qwen4_exp
from .mtp_weights import split_mtp_weights
from .vision import is_vision_key

SHARD_BYTES = 5 << 30
_COPIED = ("*.json", "*.jinja", "*.txt", "tokenizer.model", "*.tiktoken")
_NOT_COPIED = {"config.json", "model.safetensors.index.json"}


def convert(source: Path, out: Path, *, quantize: bool = False, q_group_size: Optional[int] = None,
            q_bits: Optional[int] = None, q_mode: str = "affine", dtype: Optional[str] = None) -> None:
    from .loader import load_weights  # (the loader imports this family's modules)

    if q_mode != "affine":
        raise qwen4_exp.unsupported(f"--q-mode {q_mode} (affine only)")
    config = json.loads((source / "config.json").read_text())
    model = qwen4_exp.build(config)
    body, _ = split_mtp_weights(load_weights(source))
    body = {k: v for k, v in body.items() if not is_vision_key(k)}  # the tower: carry_vision's, unquantized
    model.load_weights(list(model.sanitize(body).items()), strict=True)
    text = config.get("text_config", config)
    target = getattr(mx, dtype or text.get("torch_dtype") or config.get("torch_dtype") or "bfloat16")
    model.set_dtype(target, lambda t: mx.issubdtype(t, mx.floating))
    if quantize:
        gs, bits = q_group_size or 64, q_bits or 4
        nn.quantize(model, gs, bits, class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % gs == 0)
        config["quantization"] = {"group_size": gs, "bits": bits, "mode": q_mode}
    out.mkdir(parents=True, exist_ok=True)
    _save(out, dict(tree_flatten(model.parameters())))
    for pattern in _COPIED:
        for f in source.glob(pattern):
            if f.name not in _NOT_COPIED:
                shutil.copy2(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _save(out: Path, weights: dict) -> None:
    shards, size = [[]], 0
    for k in sorted(weights):
        if size and size + weights[k].nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += weights[k].nbytes
    weight_map = {}
    for i, keys in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(out / name), {k: weights[k] for k in keys}, metadata={"format": "mlx"})
        weight_map.update({k: name for k in keys})
    total = sum(v.nbytes for v in weights.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))

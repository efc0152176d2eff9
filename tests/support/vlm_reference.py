"""The reference vision forward for the vision exactness tests: mlx-vlm 0.7.10's Qwen3.5 /
Qwen3.5-MoE model (its own vision tower, get_rope_index and interleaved M-RoPE) loaded from a
checkpoint directory in Hugging Face layout, e.g. a synthetic one (`vision=True`).

    logits = reference_logits(path, ids, images)   # [len(ids), vocab], float32

`images` are PreparedImage (models/vision), in prompt order; `ids` hold each image's
<|image_pad|> run already expanded to image.n_tokens. mlx-vlm is installed without its
dependencies (install.sh --test); tests skip where it cannot be imported.
"""

import json
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import numpy as np
import pytest


@lru_cache(maxsize=4)
def reference_model(model_dir: str):
    qwen3_5 = pytest.importorskip("mlx_vlm.models.qwen3_5")
    from mtp_serve.models.loader import load_weights

    config = json.loads((Path(model_dir) / "config.json").read_text())
    if config["model_type"] == "qwen3_5_moe":
        module = pytest.importorskip("mlx_vlm.models.qwen3_5_moe")
    else:
        module = qwen3_5
    model = module.Model(module.ModelConfig.from_dict(config))
    # As mlx-vlm's own loader: the model's sanitize, then the tower's (the MoE model's sanitize
    # leaves the Conv3d in PyTorch layout).
    weights = model.vision_tower.sanitize(model.sanitize(load_weights(Path(model_dir))))
    model.load_weights(list(weights.items()), strict=True)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def reference_logits(model_dir, ids: Sequence[int], images: Sequence = ()) -> mx.array:
    """mlx-vlm's logits for one prompt, [len(ids), vocab] float32 (no cache: one full forward)."""
    model = reference_model(str(model_dir))
    kwargs = {}
    if images:
        kwargs = {"pixel_values": mx.array(np.concatenate([i.pixels for i in images])),
                  "image_grid_thw": mx.array([list(i.grid_thw) for i in images])}
    out = model(mx.array([list(ids)]), **kwargs)
    return out.logits[0].astype(mx.float32)

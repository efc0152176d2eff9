"""Build the vision tower from a checkpoint's weights: `Vision` is what MTPModel holds.

Accepts the raw Hugging Face names (`model.visual.*`, PyTorch Conv3d layout
[out, C, t, p, p]) and mlx-vlm / mlx-community names (`vision_tower.*`, MLX layout
[out, t, p, p, C]); a quantized tower (mlx-vlm can quantize it) is dequantized on load.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx

from mtp_serve.models.vision.image import PreparedImage
from mtp_serve.models.vision.spec import VisionSpec
from mtp_serve.models.vision.tower import TowerConfig, VisionTower

log = logging.getLogger(__name__)

TOWER_PREFIXES = ("model.visual.", "vision_tower.", "model.language_model.visual.", "visual.")


def tower_prefix(weights: Dict[str, mx.array]) -> Optional[str]:
    """The prefix under which `weights` holds a vision tower, or None."""
    for prefix in TOWER_PREFIXES:
        if f"{prefix}patch_embed.proj.weight" in weights:
            return prefix
    return None


def is_vision_key(key: str) -> bool:
    return key.startswith(TOWER_PREFIXES)


def conv_to_mlx(w: mx.array, in_channels: int) -> mx.array:
    """PyTorch Conv3d [out, C, t, p, p] -> MLX [out, t, p, p, C]; MLX layout passes through."""
    if w.ndim == 5 and w.shape[1] == in_channels and w.shape[-1] != in_channels:
        return w.transpose(0, 2, 3, 4, 1)
    return w


def _quant_params(quantization: Optional[dict], full_key: str) -> dict:
    q = dict(quantization or {})
    own = q.get(full_key[: -len(".weight")])  # mlx's per-layer overrides are keyed by module path
    if isinstance(own, dict):
        q.update(own)
    return {"group_size": int(q.get("group_size", 64)), "bits": int(q.get("bits", 4)), "mode": q.get("mode", "affine")}


def tower_weights(weights: Dict[str, mx.array], prefix: str, c: TowerConfig,
                  quantization: Optional[dict] = None) -> Dict[str, mx.array]:
    """The tower's tensors under `prefix`, renamed to VisionTower's parameters, dequantized,
    with the patch-embedding conv in MLX layout. `weights` is left as it is."""
    out = {}
    for key, value in weights.items():
        if not key.startswith(prefix) or "position_ids" in key:
            continue
        quantized = f"{key.rsplit('.', 1)[0]}.scales" in weights
        if quantized and key.endswith((".scales", ".biases")):
            continue
        name = key[len(prefix):]
        if quantized and name.endswith(".weight"):
            base = key[: -len(".weight")]
            value = mx.dequantize(value, weights[f"{base}.scales"], weights.get(f"{base}.biases"),
                                  **_quant_params(quantization, key))
        if name == "patch_embed.proj.weight":
            value = conv_to_mlx(value, c.in_channels)
        out[name] = value
    return out


class Vision:
    """A checkpoint's vision side: its spec and its tower."""

    def __init__(self, spec: VisionSpec, tower: VisionTower, out_dtype=mx.float32):
        self.spec = spec
        self.tower = tower
        self.out_dtype = out_dtype

    def encode(self, images: List[PreparedImage]) -> List[mx.array]:
        """Per image: [n_tokens, text_hidden] in the text model's compute dtype."""
        out = []
        for image in images:
            emb = self.tower(mx.array(image.pixels), image.grid_thw).astype(self.out_dtype)
            if emb.shape[0] != image.n_tokens:
                raise ValueError(f"vision tower gave {emb.shape[0]} tokens for an image of {image.n_tokens}")
            out.append(emb)
        return out


def load_vision(config: dict, weights: Dict[str, mx.array], model_dir: Path, dtype=mx.float32) -> Optional[Vision]:
    """The checkpoint's Vision, or None for a text-only config or weights without the tower."""
    vc = config.get("vision_config")
    if not vc:
        return None
    prefix = tower_prefix(weights)
    if prefix is None:
        log.warning("%s: config.json has a vision_config but the weights have no vision tower "
                    "(text-only conversions drop it); serving without image input", model_dir)
        return None
    if isinstance(dtype, str):
        dtype = getattr(mx, dtype)
    try:
        c = TowerConfig.from_dict(vc)
        spec = VisionSpec.from_model_dir(config, model_dir)
    except (ValueError, TypeError) as e:  # a tower this server cannot run: serve the text model alone
        log.warning("%s: vision tower not loaded (%s); serving without image input", model_dir, e)
        return None
    tower = VisionTower(c)
    quantization = config.get("quantization") or config.get("quantization_config")
    tower.load_weights(list(tower_weights(weights, prefix, c, quantization).items()), strict=True)
    tower.set_dtype(dtype)
    mx.eval(tower.parameters())
    tower.eval()
    return Vision(spec, tower, out_dtype=dtype)

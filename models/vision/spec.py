"""What the rest of the server needs to know about a checkpoint's vision side.

Read from config.json (top-level token ids, `vision_config`, the text config's rope
parameters) and preprocessor_config.json (resize bounds, normalisation), with
Qwen3.5's own defaults where a file leaves a value out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# Qwen3.5 / Qwen3-VL processor defaults (preprocessor_config.json of the released checkpoints).
DEFAULT_MIN_PIXELS = 65_536
DEFAULT_MAX_PIXELS = 16_777_216
DEFAULT_MEAN = (0.5, 0.5, 0.5)
DEFAULT_STD = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class VisionSpec:
    image_token_id: int          # <|image_pad|>
    vision_start_token_id: int   # <|vision_start|>
    vision_end_token_id: int     # <|vision_end|>
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple
    image_std: tuple
    mrope_section: tuple
    mrope_interleaved: bool

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this (one merged token covers factor x factor pixels)."""
        return self.patch_size * self.spatial_merge_size

    @classmethod
    def from_config(cls, config: dict, preprocessor: Optional[dict] = None) -> "VisionSpec":
        vc = config["vision_config"]
        pre = preprocessor or {}
        missing = [k for k in ("vision_start_token_id", "vision_end_token_id") if k not in config]
        if missing or ("image_token_id" not in config and "image_token_index" not in config):
            raise ValueError(f"config.json has a vision_config but lacks {', '.join(missing) or 'image_token_id'}")
        text = config.get("text_config", config)
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        section = rope.get("mrope_section") or config.get("rope_scaling", {}).get("mrope_section") or [11, 11, 10]
        size = pre.get("size") or {}
        min_pixels = pre.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or DEFAULT_MIN_PIXELS
        max_pixels = pre.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or DEFAULT_MAX_PIXELS
        return cls(
            image_token_id=int(config.get("image_token_id", config.get("image_token_index"))),
            vision_start_token_id=int(config["vision_start_token_id"]),
            vision_end_token_id=int(config["vision_end_token_id"]),
            patch_size=int(vc.get("patch_size", pre.get("patch_size", 16))),
            temporal_patch_size=int(vc.get("temporal_patch_size", pre.get("temporal_patch_size", 2))),
            spatial_merge_size=int(vc.get("spatial_merge_size", pre.get("merge_size", 2))),
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            image_mean=tuple(float(v) for v in pre.get("image_mean", DEFAULT_MEAN)),
            image_std=tuple(float(v) for v in pre.get("image_std", DEFAULT_STD)),
            mrope_section=tuple(int(s) for s in section),
            # Qwen3-VL and Qwen3.5 interleave the sections; the key is absent from older configs.
            mrope_interleaved=bool(rope.get("mrope_interleaved", True)),
        )

    @classmethod
    def from_model_dir(cls, config: dict, model_dir: Path) -> "VisionSpec":
        path = Path(model_dir) / "preprocessor_config.json"
        pre = json.loads(path.read_text()) if path.exists() else None
        return cls.from_config(config, pre)

"""Image input for Qwen3.5 / Qwen3.6 checkpoints: preprocessing, the vision tower, M-RoPE."""

from mtp_serve.models.vision.image import ImageError, ImageLimits, PreparedImage, prepare_image, smart_resize
from mtp_serve.models.vision.loader import Vision, is_vision_key, load_vision, tower_prefix
from mtp_serve.models.vision.mrope import apply_mrope, mrope_positions
from mtp_serve.models.vision.spec import VisionSpec

__all__ = [
    "ImageError", "ImageLimits", "PreparedImage", "Vision", "VisionSpec", "apply_mrope", "is_vision_key",
    "load_vision", "mrope_positions", "prepare_image", "smart_resize", "tower_prefix",
]
